"""Paged vs contiguous KV cache: prefill time and decode tokens/s over context lengths and page sizes.

Model: a small random checkpoint with the 2B's attention shape (16 q heads, 8 kv heads, head_dim 128)
but a 256-wide hidden state and ``paged_layers`` layers, so attention (where paging costs something)
dominates step time as it does at long context, and a 4k sweep fits in minutes on 2 cores. Prefix
caching is off so every repeat really prefills. One engine per KV configuration, all loaded at once,
and the configurations alternate within each repeat. Overheads are per repeat:
``paged time per token / contiguous time per token - 1`` (decode) and ``paged prefill / contiguous - 1``.
"""

from __future__ import annotations

import gc
import math

from bench.context import BenchContext
from bench.prompts import text_of_tokens
from bench.section import SectionResult
from bench.stats import alternate
from bench.timing import GenTiming, run_engine
from bench.vs_transformers import greedy, make_engine


def _prefill_s(t: GenTiming) -> float:
    """Prefill wall time as the engine measured it (falls back to TTFT when it reports no rate)."""
    rate = t.extra.get("prefill_tokens_per_s", 0.0)
    tokens = t.extra.get("prefill_tokens", 0.0)
    return tokens / rate if rate > 0 and tokens > 0 else t.ttft_s


def run(ctx: BenchContext) -> SectionResult:
    from orin_vlm_node.engine.events import Request, Turn

    cfg = ctx.config
    res = SectionResult("paged_vs_contiguous")
    model_dir = ctx.kv_shape_checkpoint(cfg.paged_layers)
    max_ctx = max(cfg.context_lengths) + cfg.paged_decode_tokens + 64
    max_ctx = 64 * math.ceil(max_ctx / 64)
    bytes_per_token = 2 * cfg.paged_layers * 8 * 128 * 4  # K+V, layers, kv heads, head_dim, fp32
    pool_mb = math.ceil(1.5 * max_ctx * bytes_per_token / 2**20)
    res.setup.update(
        model=f"random, {cfg.paged_layers} layers, hidden 256, 16 q heads / 8 kv heads, head_dim 128, fp32",
        context_lengths=list(cfg.context_lengths),
        page_sizes=list(cfg.page_sizes),
        decode_tokens=cfg.paged_decode_tokens,
        max_context_tokens=max_ctx,
        kv_pool_mb=pool_mb,
        repeats=cfg.paged_repeats,
        engine="CPU, default dynamic decode step, prefix caching off",
    )
    variants = {"contiguous": {"use_paged_attention": False}}
    for ps in cfg.page_sizes:
        variants[f"page{ps}"] = {"use_paged_attention": True, "page_size": ps}
    ctx.log(f"paged: loading {len(variants)} engines (max context {max_ctx})")
    engines = {
        name: make_engine(model_dir, "fp32", prefix_caching=False, max_context_tokens=max_ctx, kv_pool_mb=pool_mb, **kw)
        for name, kw in variants.items()
    }
    prompt_tokens: dict[int, int] = {}
    try:
        for i, length in enumerate(sorted(cfg.context_lengths)):
            text = text_of_tokens(model_dir, length)
            counter = iter(range(10**6))

            def runner(engine, text=text, counter=counter):
                def go() -> GenTiming:
                    req = Request(
                        turn=Turn(text=text),
                        sampling=greedy(cfg.paged_decode_tokens),
                        request_id=f"paged-{next(counter)}",
                    )
                    return run_engine(engine, req)

                return go

            ctx.log(f"paged: context {length}")
            runs = alternate(
                {name: runner(e) for name, e in engines.items()},
                repeats=cfg.paged_repeats,
                warmup=cfg.warmup if i == 0 else 0,
            )
            prompt_tokens[length] = runs["contiguous"][-1].prompt_tokens
            base_decode = [1.0 / r.decode_tok_s if r.decode_tok_s > 0 else math.inf for r in runs["contiguous"]]
            base_prefill = [_prefill_s(r) for r in runs["contiguous"]]
            for name, timings in runs.items():
                labels = {"context": str(length), "kv": name}
                res.add(
                    f"ctx{length}.{name}.decode_tok_s",
                    "tok/s",
                    [r.decode_tok_s for r in timings],
                    f"decode at ~{length} tokens of context",
                    **labels,
                )
                res.add(
                    f"ctx{length}.{name}.prefill_s",
                    "s",
                    [_prefill_s(r) for r in timings],
                    f"prefill of a {length}-token prompt",
                    **labels,
                )
                if name == "contiguous":
                    continue
                per_tok = [1.0 / r.decode_tok_s if r.decode_tok_s > 0 else math.inf for r in timings]
                res.add(
                    f"ctx{length}.{name}.decode_overhead",
                    "fraction",
                    [p / b - 1.0 for p, b in zip(per_tok, base_decode, strict=True)],
                    "paged decode time per token / contiguous - 1 (per repeat)",
                    **labels,
                )
                res.add(
                    f"ctx{length}.{name}.prefill_overhead",
                    "fraction",
                    [p / b - 1.0 for p, b in zip([_prefill_s(r) for r in timings], base_prefill, strict=True)],
                    "paged prefill time / contiguous - 1 (per repeat)",
                    **labels,
                )
    finally:
        engines.clear()
        gc.collect()
    res.setup["prompt_tokens"] = {str(k): v for k, v in prompt_tokens.items()}
    res.setup["summary"] = (
        f"Model: {res.setup['model']} (2B KV shape, few layers to keep time down). Prompt lengths "
        f"{list(cfg.context_lengths)}, then {cfg.paged_decode_tokens} greedy decode tokens; dynamic decode step, "
        f"prefix caching off; {cfg.paged_repeats} alternating repeats. Overhead > 0 means paged is slower."
    )
    return res
