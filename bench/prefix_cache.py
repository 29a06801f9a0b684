"""Prefix cache and multi-turn sessions: what reusing KV saves in time to first token.

1. ``image_system``: the same system prompt and image with a new question each repeat (a robot asking
   about what it sees), on two engines, prefix caching off vs on. The "on" engine served the same
   system prompt + image once before (unrecorded), so its request can reuse that KV; the pair shares
   the question. ``ttft_cut = 1 - on / off`` per pair.
2. ``multi_turn``: turn 2 of a session (history cached in the session's KV) vs a stateless request
   that recomputes a conversation of the same content (turn 1 text + the answer + turn 2 text as one
   user turn, same system prompt and image), both on the caching-off engine.
Model: the default model (see ``setup``); in full/medium mode (1) runs on the 2B-shape random checkpoint
(bf16) as well, where the vision tower and prefill dominate TTFT as on a real model (``2b_bf16.*``).
"""

from __future__ import annotations

from bench.context import BenchContext
from bench.section import SectionResult
from bench.stats import alternate, paired_ratio
from bench.timing import GenTiming, run_engine
from bench.vs_transformers import greedy, make_engine

SYSTEM_PROMPT = (
    "You are the vision assistant of a mobile robot working in a warehouse. Answer briefly and precisely, "
    "name colours and shapes exactly, say where things are relative to each other, and never guess."
)
QUESTIONS = (
    "What shape is in the picture?",
    "What color is the largest shape?",
    "How many shapes are there?",
    "Describe the picture in one sentence.",
    "Which shape is on the left?",
    "Is there anything red in the image?",
)
FOLLOW_UP = "And what color is it?"


def _image_system(res: SectionResult, prefix: str, off, on, request, repeats: int, warmup: int) -> None:
    """TTFT of the same system prompt + image with a new question, caching off vs on (primed once)."""
    run_engine(on, request("Look at this picture."))  # fills the cache with system prompt + image
    q = iter(QUESTIONS * 100)
    pending: list[str] = []

    def next_question() -> str:
        # off and on of one pair must ask the same question: the first of a pair draws, the second reuses.
        if pending:
            return pending.pop()
        text = next(q)
        pending.append(text)
        return text

    runs = alternate(
        {
            "off": lambda: run_engine(off, request(next_question())),
            "on": lambda: run_engine(on, request(next_question())),
        },
        repeats=repeats,
        warmup=warmup,
    )
    o, n = runs["off"], runs["on"]
    k = f"{prefix}image_system"
    res.add(f"{k}.off.ttft_s", "s", [r.ttft_s for r in o], "TTFT, prefix caching off", cache="off")
    res.add(f"{k}.on.ttft_s", "s", [r.ttft_s for r in n], "TTFT, prefix caching on (hit)", cache="on")
    res.add(
        f"{k}.ttft_cut",
        "fraction",
        [1.0 - x for x in paired_ratio([r.ttft_s for r in n], [r.ttft_s for r in o])],
        "1 - TTFT(on) / TTFT(off) per pair",
        cache="on",
    )
    res.add(
        f"{k}.on.prefix_hit_tokens",
        "tokens",
        [r.extra.get("prefix_hit_tokens", 0.0) for r in n],
        "prompt tokens served from the prefix cache",
    )
    res.setup[f"{k}_prompt_tokens"] = o[-1].prompt_tokens


def _big(ctx: BenchContext, res: SectionResult, image) -> None:
    """The same image + system prompt measurement on the 2B-shape checkpoint (bf16), where the vision
    tower and prefill, not preprocessing, dominate TTFT as they do on a real model."""
    from orin_vlm_node.engine.events import Request, Turn

    missing = ctx.big_checkpoint_missing()
    if missing:
        res.skip_part("2b_bf16.image_system", missing)
        return
    big = ctx.big_checkpoint()
    ctx.log("prefix_cache: 2B-shape checkpoint, caching off / on (bf16)")
    off = make_engine(big, "bf16", prefix_caching=False)
    on = make_engine(big, "bf16", prefix_caching=True)
    ids = iter(range(10**6))

    def request(text: str) -> Request:
        return Request(turn=Turn(text=text, images=(image,)), sampling=greedy(1), system_prompt=SYSTEM_PROMPT,
                       request_id=f"prefix-big-{next(ids)}")  # fmt: skip

    _image_system(res, "2b_bf16.", off, on, request, ctx.config.big_repeats + 1, ctx.config.warmup)
    res.setup["2b_checkpoint"] = ctx.big_checkpoint_origin


def run(ctx: BenchContext) -> SectionResult:
    from orin_vlm_node.engine.events import Request, Turn

    cfg = ctx.config
    res = SectionResult("prefix_cache")
    model_dir, what = ctx.default_model()
    image = ctx.image(*cfg.prefix_image_size, seed=2)
    sampling = greedy(cfg.prefix_max_new_tokens)
    ctx.log("prefix_cache: loading engines (caching off / on)")
    off = make_engine(model_dir, "fp32", prefix_caching=False)
    on = make_engine(model_dir, "fp32", prefix_caching=True)
    ids = iter(range(10**6))

    def request(text: str, session: str | None = None, images=(image,)) -> Request:
        return Request(
            turn=Turn(text=text, images=images),
            sampling=sampling,
            system_prompt=SYSTEM_PROMPT,
            session_id=session,
            request_id=f"prefix-{next(ids)}",
        )

    try:
        # -- 1. repeated image + system prompt -------------------------------------------------------------
        _image_system(res, "", off, on, request, cfg.repeats, cfg.warmup)

        # -- 2. multi-turn: session turn 2 vs recomputing the conversation ---------------------------------
        sessions = iter(range(10**6))
        answers: list[str] = []

        def session_turn2() -> GenTiming:
            sid = f"bench-session-{next(sessions)}"
            first = run_engine(off, request(QUESTIONS[0], session=sid))
            answers.append(first.text)
            t2 = run_engine(off, request(FOLLOW_UP, session=sid, images=()))
            off.reset(sid)
            return t2

        def recompute() -> GenTiming:
            # Same content as the session's turn 2 context, sent as one stateless request.
            text = f"{QUESTIONS[0]}\n{answers[-1] if answers else ''}\n{FOLLOW_UP}"
            return run_engine(off, request(text))

        runs = alternate({"session": session_turn2, "recompute": recompute}, repeats=cfg.repeats, warmup=cfg.warmup)
        s, r = runs["session"], runs["recompute"]
        res.add(
            "multi_turn.session.ttft_s",
            "s",
            [x.ttft_s for x in s],
            "turn-2 TTFT, history cached in the session",
            mode="session",
        )
        res.add(
            "multi_turn.recompute.ttft_s",
            "s",
            [x.ttft_s for x in r],
            "TTFT of a stateless request recomputing the conversation",
            mode="recompute",
        )
        res.add(
            "multi_turn.ttft_cut",
            "fraction",
            [1.0 - x for x in paired_ratio([x.ttft_s for x in s], [x.ttft_s for x in r])],
            "1 - TTFT(session turn 2) / TTFT(recompute) per pair",
        )
        res.setup["multi_turn_prompt_tokens"] = {"session_turn2": s[-1].prompt_tokens, "recompute": r[-1].prompt_tokens}
        res.setup["multi_turn_prefilled_tokens"] = {
            "session_turn2": s[-1].extra.get("prefill_tokens"),
            "recompute": r[-1].extra.get("prefill_tokens"),
        }
    finally:
        off.reset()
        on.reset()
    off = on = None
    _big(ctx, res, image)
    res.setup.update(
        model=what,
        image_hw=list(cfg.prefix_image_size),
        max_new_tokens=cfg.prefix_max_new_tokens,
        summary=(
            f"{what}; image {cfg.prefix_image_size[0]}x{cfg.prefix_image_size[1]}, system prompt of "
            f"{len(SYSTEM_PROMPT)} chars, new question per repeat; {cfg.repeats} alternating repeats."
        ),
    )
    return res
