"""Continuous batching: 1, 2, 4 and 8 requests at once vs one, on one engine.

What a robot with several askers (channels) gets from one model: N requests start together (each asks a
different question, fixed-length greedy answers), each stream read on a thread of its own (as the node's
runner threads do: whoever waits for an event runs the next scheduler step for everybody), and per N:

* ``aggregate_tok_s``: decode tokens of all members over the span from the first member's first token
  to the last member's end, less the prefill time of the later members (their prompt pieces run as
  steps inside that span): the decode rate of the batch; ``throughput_tok_s`` keeps the prefills in;
* ``speedup``: ``aggregate_tok_s`` of N over that of 1, paired per repeat (the goal reads N = 4);
* ``ttft_s`` (every member) and ``member_tok_s`` (each member's own decode rate: its per-token latency is
  the inverse); ``member_latency_vs_one``: the members' mean per-token latency over that of one request
  alone, paired per repeat.

The first member asks the same question at every N, and its tokens must be the same at every N (the
section fails otherwise): batching must not change an answer. Checkpoints: the default model, and in
full/medium mode the 2B-shape random checkpoint (fp32), where decode is bound by reading the weights, as
on a Jetson. The ``gpu`` section measures the same with kernels + CUDA graphs (:func:`measure`).
"""

from __future__ import annotations

import threading
import time

import torch

from bench.context import BenchContext
from bench.section import SectionResult
from bench.stats import paired_ratio
from bench.vs_transformers import greedy, make_engine

QUESTIONS = (
    "Describe the scene in front of the robot.",
    "What should the arm pick up first?",
    "Is the path to the door clear?",
    "Which objects are on the table?",
    "Where is the charging station?",
    "What colour is the box on the left?",
    "Is anybody standing near the shelf?",
    "How far away is the wall?",
)


def _together(engine, n: int, tokens: int, tag: str) -> dict:
    """N requests at once, each consumed on a thread of its own (as the node's runner threads do); their
    timings and the first member's tokens."""
    from orin_vlm_node.engine.events import Finished, Request, Turn

    start, end = [0.0] * n, [0.0] * n
    finals: list[Finished | None] = [None] * n
    ready = threading.Barrier(n)

    def ask(i: int) -> None:
        sampling = greedy(tokens, ignore_eos=True)
        request = Request(turn=Turn(text=QUESTIONS[i]), sampling=sampling, request_id=f"{tag}-{i}")
        ready.wait()
        start[i] = time.perf_counter()
        finals[i] = list(engine.generate(request))[-1]
        end[i] = time.perf_counter()

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i, final in enumerate(finals):
        if not isinstance(final, Finished) or final.finish_reason != "length":
            raise RuntimeError(f"batch of {n}: request {i} ended with {final}")
    # A member's first token: its start plus its TTFT (random weights may stream no text to time it by).
    # From the first member's first token to the last end, the steps that prefill the later members run
    # too (one prompt piece each): take their prefill time out to get the decode rate of the batch.
    firsts = [t + f.metrics["ttft_s"] for t, f in zip(start, finals, strict=True)]
    decoded = sum(len(f.token_ids) - 1 for f in finals)
    span = max(end) - min(firsts)
    first = firsts.index(min(firsts))
    prefills = sum(_prefill_s(f) for i, f in enumerate(finals) if i != first)
    return {
        "aggregate": decoded / (span - prefills),
        "throughput": decoded / span,
        "ttft": [f.metrics["ttft_s"] for f in finals],
        "member": [f.metrics["decode_tokens_per_s"] for f in finals],
        "batch": max(f.metrics["batch_size"] for f in finals),
        "first_tokens": finals[0].token_ids,
    }


def _prefill_s(final) -> float:
    m = final.metrics
    return m["prefill_tokens"] / m["prefill_tokens_per_s"] if m["prefill_tokens_per_s"] > 0 else 0.0


def measure(res: SectionResult, prefix: str, engine, sizes, tokens: int, repeats: int, warmup: int) -> None:
    """Figures ``<prefix>batch<N>.*`` of ``engine`` for every N of ``sizes`` (the first must be 1)."""
    runs: dict[int, list[dict]] = {n: [] for n in sizes}
    for r in range(warmup + repeats):
        for n in sizes:  # alternating: drift hits every N alike
            out = _together(engine, n, tokens, f"{prefix}{n}-{r}")
            if out["batch"] != n:
                raise RuntimeError(f"{n} requests decoded at most {out['batch']} together (max_batch too small?)")
            if r >= warmup:
                runs[n].append(out)
    reference = runs[sizes[0]][0]["first_tokens"]
    exact = engine.parts.dtype == torch.float32
    for n in sizes:
        for out in runs[n]:
            tokens = out["first_tokens"]
            if tokens == reference:
                continue
            pairs = enumerate(zip(tokens, reference, strict=False))
            agree = next((i for i, (a, b) in pairs if a != b), min(len(tokens), len(reference)))
            if exact:  # fp32: the same tokens, whatever the batch
                raise RuntimeError(f"{prefix}: the first request's tokens differ in a batch of {n} from alone")
            # Half precision: a batch's split-K plan (and a GEMM's tiling) sums in another order, and a random
            # model's greedy choice can flip on a last-bit difference. Said in the results, not hidden.
            res.notes.append(
                f"{prefix}batch{n}: the first request agrees with it alone for {agree} of "
                f"{len(reference)} tokens ({engine.parts.dtype}: summation order differs by batch)"
            )
            break
    one = [out["aggregate"] for out in runs[1]]
    one_latency = [_member_latency(out) for out in runs[1]]
    for n in sizes:
        k = f"{prefix}batch{n}"
        agg = [out["aggregate"] for out in runs[n]]
        res.add(f"{k}.aggregate_tok_s", "tok/s", agg, f"decode tokens/s of {n} requests together", batch=str(n))
        res.add(f"{k}.speedup", "x", paired_ratio(agg, one), f"aggregate of {n} / aggregate of 1", batch=str(n))
        res.add(f"{k}.throughput_tok_s", "tok/s", [out["throughput"] for out in runs[n]],
                f"decode tokens of {n} requests over the span, prefills included", batch=str(n))  # fmt: skip
        res.add(f"{k}.ttft_s", "s", [t for out in runs[n] for t in out["ttft"]], "TTFT of every member",
                batch=str(n))  # fmt: skip
        res.add(f"{k}.member_tok_s", "tok/s", [t for out in runs[n] for t in out["member"]],
                "each member's own decode rate", batch=str(n))  # fmt: skip
        res.add(f"{k}.member_latency_vs_one", "x", paired_ratio([_member_latency(out) for out in runs[n]], one_latency),
                f"mean per-token latency of the {n} members / that of one request alone", batch=str(n))  # fmt: skip


def _member_latency(out: dict) -> float:
    """Mean seconds per decoded token of a batch's members."""
    return sum(1.0 / rate for rate in out["member"]) / len(out["member"])


def run(ctx: BenchContext) -> SectionResult:
    cfg = ctx.config
    res = SectionResult("batching")
    sizes = tuple(cfg.batch_sizes)
    model_dir, what = ctx.default_model()
    ctx.log(f"batching: default model, batches of {sizes}")
    engine = make_engine(model_dir, "fp32", prefix_caching=False, max_sessions=0, max_batch=max(sizes))
    measure(res, "default.", engine, sizes, cfg.batch_tokens, cfg.repeats, cfg.warmup)
    engine = None
    missing = ctx.big_checkpoint_missing()
    if missing:
        res.skip_part("2b_fp32", missing)
    else:
        ctx.log("batching: 2B-shape checkpoint (fp32)")
        big = make_engine(ctx.big_checkpoint(), "fp32", prefix_caching=False, max_sessions=0, max_batch=max(sizes))
        measure(res, "2b_fp32.", big, sizes, cfg.big_batch_tokens, cfg.big_repeats, cfg.warmup)
        res.setup["2b_checkpoint"] = ctx.big_checkpoint_origin
    res.setup.update(
        model=what,
        batch_sizes=list(sizes),
        tokens=cfg.batch_tokens,
        big_tokens=cfg.big_batch_tokens,
        summary=(
            f"{what} and the 2B-shape checkpoint (fp32); {len(sizes)} batch sizes {list(sizes)}, different "
            f"questions, fixed-length greedy answers ({cfg.batch_tokens} / {cfg.big_batch_tokens} tokens), streams "
            "read in turn from one thread; alternating repeats."
        ),
    )
    return res
