"""Where a decode token's time goes on the GPU: torch.profiler's kernels by category, the time any kernel runs."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from bench.context import BenchContext
from bench.gpu_engines import PATHS, PROMPT, launching, make_engine
from bench.section import SectionResult
from bench.stats import paired_ratio
from bench.timing import run_engine

# Kernel name -> the category a decode step's device time is reported in (first match wins).
KERNEL_CATEGORIES = (
    ("attention", ("paged_decode", "paged_prefill", "paged_kv_write", "flash", "fmha", "attention")),
    ("fused_elementwise", ("rms_norm", "silu_mul")),
    ("gemm", ("gemm", "gemv", "nvjet", "cutlass", "splitkreduce", "sm90_xmma", "ampere_")),
)


def kernel_category(name: str) -> str:
    """``attention``, ``fused_elementwise``, ``gemm`` or ``other_elementwise`` for a CUDA kernel's name."""
    lowered = name.lower()
    return next((cat for cat, keys in KERNEL_CATEGORIES if any(k in lowered for k in keys)), "other_elementwise")


def busy_us(intervals: Sequence[tuple[float, float]]) -> float:
    """The length of the union of (start, end) intervals: how long a device was running kernels when they
    overlap. Under programmatic dependent launch a kernel's blocks start, and wait, before the kernel ahead
    of them ends, so its profiled duration includes that wait and the durations add up to more than the
    time they took."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


def step_profile(torch, ctx: BenchContext, res: SectionResult, model_dir: Path, weights: str = "none") -> None:
    """Where a decode token's time goes (fp16 activations, kernels + graphs; weights as ``weights`` says, the
    figures under ``step.fp16`` for fp16 weights and ``step.<weights>`` for quantized ones): the wall time
    of a token, overlapped and step by step (what overlapping the host with the device gains), and
    torch.profiler's kernels over 16 tokens by category, with their count per token (what the kernels do
    not cover of a token is gaps between kernels and host time). Launches are plain (:func:`launching` "off"):
    a dependent launch's profiled duration includes its wait for the kernel before it, so the kernels' times
    would not add up to the token."""
    from torch.profiler import ProfilerActivity, profile

    from orin_vlm_node.engine import Request, SamplingParams, Turn

    engine = make_engine(model_dir, "fp16", str(ctx.scratch / "kernel_cache"), weight_quant=weights, **PATHS["graphs"])
    if engine.parts.attention.kernels:
        launching(engine, "off")
    key = "fp16" if weights == "none" else weights
    ids = iter(range(10**6))

    def answer(n: int):
        sampling = SamplingParams(temperature=0.0, max_new_tokens=n, ignore_eos=True)
        return run_engine(engine, Request(Turn(PROMPT), sampling, request_id=f"gpu-prof-{next(ids)}"))

    answer(32)  # captures the step's graph

    def token_ms(overlap: bool) -> float:
        engine.parts.decode_step.overlap = overlap
        return 1e3 / answer(ctx.config.gpu_max_new_tokens).decode_tok_s

    pairs = [(token_ms(True), token_ms(False)) for _ in range(ctx.config.gpu_repeats)]
    engine.parts.decode_step.overlap = True
    res.add(f"step.{key}.token_ms", "ms", [a for a, _ in pairs], "wall time a decode token (no profiler)")
    res.add(f"step.{key}.token_ms_step_by_step", "ms", [b for _, b in pairs],
            "the same with overlap off: the host reads each token before it stages the next step")  # fmt: skip
    res.add(f"step.{key}.overlap_gain", "x", paired_ratio([b for _, b in pairs], [a for a, _ in pairs]),
            "token time step by step / overlapped (per pair)")  # fmt: skip
    tokens = 16
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        answer(tokens)
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    by_cat: dict[str, list[float]] = {}
    for e in kernels:
        by_cat.setdefault(kernel_category(e.name), []).append(e.device_time)
    res.add(
        f"step.{key}.kernels_per_token", "count", [len(kernels) / tokens], "CUDA kernels a token (prefill included)"
    )
    res.add(f"step.{key}.kernel_ms", "ms", [sum(e.device_time for e in kernels) / tokens / 1e3],
            "kernel durations a token, summed (plain launches: none includes a wait for another)")  # fmt: skip
    busy = busy_us([(e.time_range.start, e.time_range.end) for e in kernels])
    res.add(f"step.{key}.busy_ms", "ms", [busy / tokens / 1e3],
            "device time a token with a kernel running (the rest of token_ms: gaps between kernels, host)")  # fmt: skip
    for cat, times in sorted(by_cat.items()):
        res.add(f"step.{key}.{cat}_ms", "ms", [sum(times) / tokens / 1e3], f"device time a token in {cat} kernels")
        res.add(f"step.{key}.{cat}_kernels", "count", [len(times) / tokens], f"{cat} kernels a token")
    top = sorted(prof.key_averages(), key=lambda a: a.self_device_time_total, reverse=True)[:15]
    res.setup["step_profile_top" + ("" if weights == "none" else f"_{weights}")] = [
        {"kernel": a.key[:120], "calls_per_token": a.count / tokens, "us": a.self_device_time_total / a.count}
        for a in top
        if a.count
    ]
