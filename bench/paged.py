"""Paged vs contiguous KV cache: decode tokens/s at long context, on fresh and on churned block tables.

Model: a small random checkpoint with the 2B's attention shape (16 q heads, 8 kv heads, head_dim 128)
but a 256-wide hidden state and ``paged_layers`` layers, so attention (where paging costs something)
dominates a step as it does at long context. Prefix caching is off. The checkpoint says only tokens that
are whole characters, so the engine streams one delta per token (below).

For every context length each engine holds one conversation (a session): its first turn prefills a
prompt of that length (in ``prefill_chunk_tokens`` pieces), then every repeat is a short follow-up turn
that decodes ``paged_decode_tokens`` tokens (``ignore_eos``) at that context: decode is measured where it
matters without prefilling 16k tokens again for every repeat.

The engines take turns token by token: in every repeat all follow-up turns are open together and each
engine computes its next token in turn (the order flipped every round), so the k-th tokens of all engines
are computed within one round of a few tens of milliseconds. A token's overhead is ``paged time / the
contiguous engine's time for its token of the same round - 1``; a repeat's figure is the median over its
tokens. Why: decode at long context is bound by memory bandwidth, which this shared machine's neighbours
change from second to second; with whole 64-token turns in turn (1..2 s each at 16k) one engine's turns
spread over 40 points and two identical engines sat 10..30% apart, more than the 5% the goal allows.

``page16_churn`` is a paged engine whose pool has seen churn before each conversation: requests of mixed
lengths, one after another, while another conversation stays open and grows between them (its blocks sit
among everyone else's), so the measured conversation's table is what a long-running node has, not a
fresh pool's. ``table_runs`` counts the runs of consecutive blocks its table ends with (1 = contiguous).

``contiguous_control`` is a second contiguous engine, identical to the first and built last. Its
"overhead" is what two engines doing the same work differ by in this run (where their memory landed,
what the machine did meanwhile): a paged overhead within that spread is not a cost of paging.
"""

from __future__ import annotations

import gc
import math
import random
import statistics
import time

from bench.context import BenchContext
from bench.prompts import text_of_tokens
from bench.section import SectionResult
from bench.timing import GenTiming, run_engine
from bench.vs_transformers import greedy, make_engine

FOLLOW_UP = "Continue."
CHURN_REQUESTS = 24
KEEP = "churn-keep"  # the conversation that stays open during churn
CONTROL = "contiguous_control"  # a second contiguous engine: the spread between identical engines
# A repeat counts when every engine streamed at least this many timed deltas. The checkpoint is talkative
# (every token it can say is whole characters), so each delta is one token; a model whose text held back
# incomplete characters would stream stretches of tokens in one delta, computed by one engine before the
# next takes a turn, and such a repeat would not pair the engines' tokens.
MIN_TIMED_DELTAS = 16


def _prefill_s(t: GenTiming) -> float:
    """Prefill wall time as the engine measured it (falls back to TTFT when it reports no rate)."""
    rate = t.extra.get("prefill_tokens_per_s", 0.0)
    tokens = t.extra.get("prefill_tokens", 0.0)
    return tokens / rate if rate > 0 and tokens > 0 else t.ttft_s


def _request(text: str, n: int, session: str | None, rid: str):
    from orin_vlm_node.engine.events import Request, Turn

    return Request(turn=Turn(text=text), sampling=greedy(n, ignore_eos=True), session_id=session, request_id=rid)


def _churn(engine, model_dir, longest: int, seed: int) -> None:
    """Requests of mixed lengths, with the KEEP conversation growing between them."""
    rng = random.Random(seed)
    sizes = [n for n in (16, 64, 200, 500, 1000, 2000) if n <= longest // 2] or [16]
    for i in range(CHURN_REQUESTS):
        n = rng.choice(sizes)
        run_engine(engine, _request(text_of_tokens(model_dir, n), rng.randint(1, 8), None, f"churn-{seed}-{i}"))
        if i % 4 == 0:
            run_engine(engine, _request(FOLLOW_UP, rng.randint(8, 40), KEEP, f"keep-{seed}-{i}"))


def _interleaved(engines: dict, session: str, tokens: int, tag: str) -> dict[str, list[float]]:
    """One follow-up turn of ``tokens`` tokens on every engine, the engines stepping in turn: each ``next``
    on an engine's stream computes its next streamed delta. Per engine: the seconds per token of each decode
    delta (the first delta, which carries the turn's prefill, left out)."""
    from orin_vlm_node.engine.events import Finished, TextDelta

    names = list(engines)
    streams = {n: engines[n].generate(_request(FOLLOW_UP, tokens, session, f"paged-{tag}-{n}")) for n in names}
    per_token: dict[str, list[float]] = {n: [] for n in names}
    seen: dict[str, int] = dict.fromkeys(names, 0)
    done: set[str] = set()
    rounds = 0
    while len(done) < len(names):
        for name in names if rounds % 2 == 0 else names[::-1]:
            if name in done:
                continue
            t0 = time.perf_counter()
            event = next(streams[name])
            elapsed = time.perf_counter() - t0
            if isinstance(event, TextDelta) and event.token_ids:
                seen[name] += 1
                if seen[name] > 1:
                    per_token[name].append(elapsed / len(event.token_ids))
            elif isinstance(event, Finished):
                if event.finish_reason == "error":
                    raise RuntimeError(f"engine {name} failed: {event.error}")
                done.add(name)
        rounds += 1
    return per_token


def run(ctx: BenchContext) -> SectionResult:
    from orin_vlm_node.kvcache.attention import block_runs

    cfg = ctx.config
    res = SectionResult("paged_vs_contiguous")
    model_dir = ctx.kv_shape_checkpoint(cfg.paged_layers)
    longest = max(cfg.context_lengths)
    # The conversation grows by every follow-up; the KEEP conversation of the churned engine needs room too.
    max_ctx = 64 * math.ceil((longest + (cfg.paged_repeats + cfg.warmup + 1) * (cfg.paged_decode_tokens + 32)) / 64)
    bytes_per_token = 2 * cfg.paged_layers * 8 * 128 * 4  # K+V, layers, kv heads, head_dim, fp32
    pool_mb = math.ceil(2.5 * max_ctx * bytes_per_token / 2**20)
    res.setup.update(
        model=f"random, {cfg.paged_layers} layers, hidden 256, 16 q heads / 8 kv heads, head_dim 128, fp32",
        context_lengths=list(cfg.context_lengths),
        page_sizes=list(cfg.page_sizes),
        decode_tokens=cfg.paged_decode_tokens,
        max_context_tokens=max_ctx,
        kv_pool_mb=pool_mb,
        repeats=cfg.paged_repeats,
        churn=f"{CHURN_REQUESTS} requests of 16..2000 tokens and a conversation kept open, before each context",
        engine="CPU, dynamic decode step, prefix caching off, one session per engine",
        control=f"{CONTROL}: a second contiguous engine, same settings, built last",
    )
    variants = {"contiguous": {"use_paged_attention": False}}
    for ps in cfg.page_sizes:
        variants[f"page{ps}"] = {"use_paged_attention": True, "page_size": ps}
    variants["page16_churn"] = {"use_paged_attention": True, "page_size": 16, "max_sessions": 2}
    variants[CONTROL] = {"use_paged_attention": False}
    ctx.log(f"paged: loading {len(variants)} engines (max context {max_ctx})")
    engines = {
        name: make_engine(model_dir, "fp32", prefix_caching=False, max_context_tokens=max_ctx, kv_pool_mb=pool_mb, **kw)
        for name, kw in variants.items()
    }
    try:
        for i, length in enumerate(sorted(cfg.context_lengths)):
            ctx.log(f"paged: context {length}: opening the conversations")
            session = f"ctx{length}"
            opened = {}
            for name, engine in engines.items():
                if name.endswith("_churn"):
                    _churn(engine, model_dir, longest, seed=length)
                opened[name] = run_engine(engine, _request(text_of_tokens(model_dir, length), 1, session, session))
            ctx.log(f"paged: context {length}: {cfg.paged_repeats} repeats, the engines token by token")
            for w in range(cfg.warmup if i == 0 else 0):
                _interleaved(engines, session, cfg.paged_decode_tokens, f"{length}-warmup{w}")
            runs = [
                _interleaved(engines, session, cfg.paged_decode_tokens, f"{length}-{r}")
                for r in range(cfg.paged_repeats)
            ]
            timed = [run for run in runs if min(len(t) for t in run.values()) >= MIN_TIMED_DELTAS]
            if len(timed) < len(runs):
                res.notes.append(
                    f"ctx{length}: {len(runs) - len(timed)} of {len(runs)} repeats left out, their text streamed in "
                    f"fewer than {MIN_TIMED_DELTAS} deltas (the random model's bytes held back as incomplete "
                    "characters), so the engines did not take turns token by token"
                )
            if timed:
                _record(res, length, timed, opened)
            churned = engines["page16_churn"]
            seq = churned.parts.session_store.get(session).seq
            runs = len(block_runs(churned.parts.cache.block_table(seq)))
            res.add(f"ctx{length}.page16_churn.table_runs", "runs", [runs],
                    "runs of consecutive blocks in the churned engine's table (1 = contiguous)",
                    context=str(length), kv="page16_churn")  # fmt: skip
            for engine in engines.values():
                engine.reset(session)
            engines["page16_churn"].reset(KEEP)
    finally:
        engines.clear()
        gc.collect()
    res.setup["summary"] = (
        f"Model: {res.setup['model']} (2B KV shape, few layers to keep time down). One conversation per "
        f"context length {list(cfg.context_lengths)}, then {cfg.paged_repeats} follow-up turns of "
        f"{cfg.paged_decode_tokens} decode tokens each; dynamic decode step, prefix caching off; page16_churn "
        f"after {CHURN_REQUESTS} mixed requests with a conversation kept open; {CONTROL} is a second contiguous "
        f"engine (the spread between identical engines). Overhead > 0 means slower than contiguous."
    )
    return res


def _record(res: SectionResult, length: int, runs: list[dict[str, list[float]]], opened: dict[str, GenTiming]) -> None:
    """Per engine: decode tok/s of each repeat (from the time its own steps took: the engine's metric would
    count the other engines' turns too) and, for all but the contiguous baseline, each repeat's median over
    its tokens of the paired overhead."""
    for name in runs[0]:
        labels = {"context": str(length), "kv": name}
        rates = [len(run[name]) / sum(run[name]) for run in runs]  # its own steps' time only
        res.add(f"ctx{length}.{name}.decode_tok_s", "tok/s", rates,
                f"decode at ~{length} tokens of context (time inside its own steps)", **labels)  # fmt: skip
        res.add(f"ctx{length}.{name}.prefill_s", "s", [_prefill_s(opened[name])],
                f"prefill of the {length}-token first turn (one sample)", **labels)  # fmt: skip
        if name == "contiguous":
            continue
        overhead = []
        for run in runs:
            pairs = zip(run[name], run["contiguous"], strict=False)  # the k-th tokens: the same round
            overhead.append(statistics.median(t / base - 1.0 for t, base in pairs))
        res.add(f"ctx{length}.{name}.decode_overhead", "fraction", overhead,
                "per repeat: median over its tokens of (time per token / the contiguous engine's in the same "
                "round) - 1", **labels)  # fmt: skip
