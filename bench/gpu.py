"""GPU: decode speed against the memory-bandwidth bound, the paged kernel against contiguous attention,
TTFT with an image, startup to ready, and GPU memory -- all side by side in one run on one device.

Only with CUDA (else the section is ``skipped``: "no CUDA device"). Model: a random checkpoint with
every dimension of Qwen3-VL-2B (built on the device from the shared 2B config; the default model when
that config is absent), batch 1, greedy, answers of a fixed length (``ignore_eos`` / ``min_new_tokens``).

* ``bandwidth``: a device-to-device copy of 1 GiB, bytes read + written per second: the speed the memory
  system really delivers, measured in this run (not the datasheet).
* ``decode.<dtype>.<path>``: tokens/s for the engine with kernels + CUDA graphs (``graphs``), kernels
  without graphs (``kernels_eager``), the torch attention with graphs (``torch``: what a model the kernels
  do not cover gets) and transformers ``generate`` with SDPA (``hf``); alternating repeats. Each also as
  a fraction of its bound: copy bandwidth / bytes read per token (every text-decoder weight once, the
  tied LM head included, plus the KV of the context).
* ``kernels.ctx<N>.page<P>``: the paged decode kernel on a shuffled block table (a pool after churn)
  against torch SDPA over contiguous K/V (GQA without copies), one layer of the 2B's attention shape;
  device time of each in CUDA graphs, as the engine's decode runs them.
* ``quant.<none|int8|int4>``: batch-1 decode with kernels + graphs and fp16 activations, the decoder's
  projections stored as ``weight_quant`` says (the INT8/INT4 GEMV kernels); tokens/s, the fraction of each
  model's own bound (the bytes it really reads), the speedup over fp16 weights, and the TTFT (a prefill:
  quantized weights widened for torch's GEMM); each engine's graphs' launch choice in ``setup``.
* ``gemv.<projection>.<fp16|fp16_kernel|int8|int4>``: one row through each projection shape of the 2B
  decoder, torch's fp16 product against the GEMV kernels (fp16, INT8 and INT4 weights): device time in graphs
  and the weight bytes read per second as a fraction of the copy bandwidth. For gate/up also the MLP's
  activation on both sides, as the engine times it: ``fp16_then_silu_mul`` (cuBLAS, then the ``silu_mul``
  kernel) and ``fp16_kernel_swiglu`` (the kernel's SwiGLU epilogue), and ``int8_swiglu`` / ``int4_swiglu``
  (the quantized products the decode step runs there).
* ``batching.fp16.batch<N>``: 1, 2, 4 and 8 requests decoding together with kernels + graphs (one graph
  per batch bucket), the figures of the ``batching`` section: aggregate tokens/s over one request's, and
  each member's per-token latency over one request's alone.
* ``step.fp16.*`` (part ``step_profile``) and ``step.int4.*`` (``step_profile_int4``: INT4 weights): where a
  decode token's time goes: its wall time (overlapped, and step by step with overlap off: what queuing step
  N+1 before reading token N gains), and torch.profiler's kernels over 16 tokens by category (GEMMs,
  attention, fused elementwise, other elementwise) with their count per token, and the time with any
  kernel running (``busy_ms``); the 15 costliest kernels in ``setup``. Launched plainly, so that each
  kernel's duration is its own.
* ``pdl.<none|int4>.<on|off>``: batch-1 decode with programmatic dependent launch forced on and off (sm_90 and
  later; the engine captures each graph both ways and keeps the faster), fp16 and INT4 weights, alternating;
  ``gain`` = on / off per pair.
* ``l2_prefetch.<none|int4>.<on|off>``: the same with every launch dependent and the GEMV kernels' L2
  prefetch of their weights (between the prologue's halves) as built, against kernels built without it (a
  copy of the sources whose ``prefetch_l2`` is empty, the bench's own: the product has no switch for it).
* ``ttft_448.<dtype>``: an image of 448x448 and a short question: vision tower + prefill + first token.
* ``startup.cold_s`` / ``warm_s``: a fresh process from start to a ready engine (fp16), with an empty
  kernel cache and again with the cache it filled; its GPU memory at 8192 context (``memory.*``) and the
  default model's.
"""

from __future__ import annotations

import functools
import gc
import json
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path

from bench import batching
from bench.config import REPO, part_names
from bench.context import BenchContext
from bench.section import SectionResult, skipped
from bench.stats import alternate, paired_ratio
from bench.timing import HFRunner, run_engine

PROMPT = "Describe what a robot arm does when it picks up the red cube and places it on the table."
PATHS = {  # engine settings of each decode path
    "graphs": dict(use_cuda_kernels=True, use_cuda_graph=True),
    "kernels_eager": dict(use_cuda_kernels=True, use_cuda_graph=False),
    "torch": dict(use_cuda_kernels=False, use_cuda_graph=True),
}
QUANT = ("none", "int8", "int4")  # weight_quant of the quantized-decode comparison
MB = 2**20


def copy_bandwidth_gbs(torch, size_bytes: int = 2**30, iters: int = 20) -> float:
    """Bytes read + written per second by a device-to-device copy (GB/s)."""
    src = torch.empty(size_bytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = _cuda_ms(torch, lambda: dst.copy_(src), iters=iters, warmup=3)
    return 2 * size_bytes / (ms * 1e-3) / 1e9


def _cuda_ms(torch, fn, iters: int = 200, warmup: int = 20) -> float:
    for _ in range(warmup):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def decode_weight_bytes(model) -> int:
    """Bytes one decode step reads from weights: every text-decoder parameter except the embedding table
    (one row is read), plus the LM head (the embedding matrix itself when tied), and the quantized
    projections and LM head as stored (``weight_quant``)."""
    from orin_vlm_node.weights.quant import QuantizedLinear

    quantized = {name: m for name, m in model.named_modules() if isinstance(m, QuantizedLinear)}
    total = sum(m.nbytes for name, m in quantized.items() if not name.startswith("visual."))
    embed, head = None, quantized.get("lm_head")
    for name, p in model.named_parameters():
        if name.startswith("visual."):
            continue
        if "embed_tokens" in name:
            embed = p
            continue
        if name.startswith("lm_head"):
            head = p
        total += p.numel() * p.element_size()
    if head is None and embed is not None:
        total += embed.numel() * embed.element_size()
    return total


def _kernels(torch, ctx: BenchContext, res: SectionResult) -> None:
    """Paged decode kernel (shuffled table) vs contiguous SDPA, 2B attention shape, fp16, device time of each
    in CUDA graphs as the engine's decode runs them (timed launch by launch, the host's Python launch cost of
    about 65 us a call hid both kernels' time below 16k of context)."""
    import torch.nn.functional as F

    from orin_vlm_node.cuda import AttentionShape, select_backend
    from orin_vlm_node.cuda.attention import CudaPagedAttention
    from orin_vlm_node.cuda.graph import device_us

    cfg = ctx.config
    nq, nkv, hd, dtype = 16, 8, 128, torch.float16
    cache_dir = tempfile.mkdtemp(prefix="bench_kernels_", dir=ctx.scratch)
    choice = select_backend("cuda", True, AttentionShape(dtype, hd, nq, nkv), kernel_cache_dir=cache_dir)
    if not choice.kernels:
        res.skip_part("kernels", choice.status)
        return
    impl = choice.attention_impl
    stream = torch.cuda.Stream()  # every timing graph's capture stream (cuda.graph: one per process's captures)
    res.setup["kernels"] = {"status": choice.status, "shape": dict(heads=nq, kv_heads=nkv, head_dim=hd, dtype="fp16")}
    gen = torch.Generator(device="cuda").manual_seed(0)
    for context in cfg.gpu_kernel_contexts:
        q = torch.randn(1, nq, hd, device="cuda", generator=gen).to(dtype)
        kc = torch.randn(1, nkv, context, hd, device="cuda", generator=gen).to(dtype)  # contiguous K/V
        vc = torch.randn_like(kc)
        qs = q.transpose(0, 1).unsqueeze(0)  # (1, nq, 1, hd)
        kv_bytes = 2 * context * nkv * hd * 2
        sdpa = [
            device_us(lambda k=kc, v=vc, q=qs: F.scaled_dot_product_attention(q, k, v, enable_gqa=True), stream=stream)
            for _ in range(cfg.gpu_repeats)
        ]
        res.add(f"kernels.ctx{context}.sdpa_us", "us", sdpa, "torch SDPA over contiguous K/V (GQA)", context=context)
        kv_len = torch.tensor([context], dtype=torch.int32, device="cuda")
        for page in cfg.gpu_kernel_pages:
            blocks = context // page
            k_pool = kc[0].transpose(0, 1).reshape(blocks, page, nkv, hd).contiguous()
            v_pool = vc[0].transpose(0, 1).reshape(blocks, page, nkv, hd).contiguous()
            order = torch.randperm(blocks, device="cuda", generator=gen)
            table = torch.empty(1, blocks, dtype=torch.int32, device="cuda")  # one sequence's row
            table[0, order] = torch.arange(blocks, dtype=torch.int32, device="cuda")
            k_pool, v_pool = k_pool[order].contiguous(), v_pool[order].contiguous()  # scattered, same content
            decode = functools.partial(impl.attend_decode, q, k_pool, v_pool, table, kv_len, blocks)
            paged = [device_us(decode, stream=stream) for _ in range(cfg.gpu_repeats)]
            key = f"kernels.ctx{context}.page{page}"
            res.add(f"{key}.paged_us", "us", paged, "paged decode kernel, shuffled block table", context=context)
            res.add(f"{key}.overhead", "fraction", [p / s - 1 for p, s in zip(paged, sdpa, strict=True)],
                    "paged kernel time / contiguous SDPA time - 1", context=context, page=page)  # fmt: skip
            res.add(f"{key}.gbs", "GB/s", [kv_bytes / (p * 1e-6) / 1e9 for p in paged], "paged kernel K/V read rate")
            if page != cfg.gpu_kernel_pages[0]:
                continue
            planned = impl.decode_plan(context, nq, nkv)[1]
            res.setup["kernels"][f"ctx{context}_split_tokens"] = planned
            for tokens in (t for t in cfg.gpu_kernel_split_tokens if planned < t < context):
                longer = CudaPagedAttention(impl.launcher, impl.sm_count, min_tokens_per_split=tokens)
                decode = functools.partial(longer.attend_decode, q, k_pool, v_pool, table, kv_len, blocks)
                us = [device_us(decode, stream=stream) for _ in range(cfg.gpu_repeats)]
                what = f"the same with splits of {tokens} tokens (the plan's: {planned})"
                res.add(f"{key}.split{tokens}_us", "us", us, what, context=context)


def _gemv(torch, ctx: BenchContext, res: SectionResult, bandwidth: float) -> None:
    """One row through each projection shape of the 2B decoder (fused q/k/v, o, fused gate/up, down, and the down
    product's bytes laid out as twice the columns over half of K): torch's
    fp16 product (cuBLAS) and the GEMV kernels on fp16, INT8 and INT4 weights, device time in CUDA graphs,
    and the rate at which each reads its weight bytes as a fraction of the copy bandwidth: how close each
    product comes to the bound, and which of cuBLAS and the kernel the engine should pick (it times the
    same pair at startup, ``CudaGemv.faster_rows``)."""
    import itertools

    import torch.nn.functional as F

    from orin_vlm_node.cuda.fused import CudaFusedOps
    from orin_vlm_node.cuda.gemv import CudaGemv
    from orin_vlm_node.cuda.graph import device_us
    from orin_vlm_node.weights.gemv_linear import GemvLinear
    from orin_vlm_node.weights.quant import QuantizedLinear, WeightQuant

    found = _projections_and_kernels(torch, ctx, res, "gemv")
    if found is None:
        return
    shapes, _, launcher = found
    # The down product's bytes as twice the columns over half of K: twice the warps, each with half the steps
    # along its rows. Faster than "down" means the down product waits on its warps' serial steps (too few warps
    # an SM: 2048 columns are 128 blocks of INT4 warps), the case for splitting K among a block's warps.
    n_down, k_down = shapes["down"]
    shapes = {**shapes, "down_wide": (2 * n_down, k_down // 2)}
    gemv, silu_mul = CudaGemv(launcher), CudaFusedOps(launcher).silu_mul
    stream = torch.cuda.Stream()  # every timing graph's capture stream
    copies = 8  # distinct weights called in turn: no call finds its weight in L2 after the one before
    for name, (n, k) in shapes.items():
        x = torch.randn(1, k, device="cuda").to(torch.float16)
        weights = [(torch.randn(n, k, device="cuda") * 0.02).to(torch.float16) for _ in range(copies)]
        sides = {"fp16": (lambda w, x=x: F.linear(x, w), weights, n * k * 2)}
        linears = [torch.nn.Linear(k, n, bias=False, device="meta") for _ in weights]
        for linear, w in zip(linears, weights, strict=True):
            linear.weight = torch.nn.Parameter(w, requires_grad=False)
        wrapped = [GemvLinear(linear, gemv, rows=gemv.max_rows) for linear in linears]
        sides["fp16_kernel"] = (lambda m, x=x: m(x), wrapped, n * k * 2)
        if name == "gate_up":
            sides["fp16_then_silu_mul"] = (lambda w, x=x: silu_mul(F.linear(x, w)), weights, n * k * 2)
            sides["fp16_kernel_swiglu"] = (lambda m, x=x: gemv(m, x, swiglu=True), wrapped, n * k * 2)
        for mode in ("int8", "int4"):
            modules = [QuantizedLinear.from_weight(w, WeightQuant(mode)) for w in weights]
            sides[mode] = (lambda m, x=x: gemv(m, x), modules, modules[0].nbytes)
            if name == "gate_up":  # the product the decode step runs: its SwiGLU in the launch
                sides[f"{mode}_swiglu"] = (lambda m, x=x: gemv(m, x, swiglu=True), modules, modules[0].nbytes)
        for mode, (fn, items, nbytes) in sides.items():
            turn = itertools.cycle(items)
            us = [
                device_us(lambda f=fn, t=turn: f(next(t)), stream=stream, calls=copies)
                for _ in range(ctx.config.gpu_repeats)
            ]
            res.add(f"gemv.{name}.{mode}.us", "us", us, f"{n}x{k} weight, one fp16 row, device time", mode=mode)
            res.add(f"gemv.{name}.{mode}.bandwidth_fraction", "fraction",
                    [nbytes / (u * 1e-6) / 1e9 / bandwidth for u in us],
                    "weight bytes read per second / copy bandwidth", mode=mode)  # fmt: skip
        del weights, sides
        torch.cuda.empty_cache()


def _engine(model_dir: Path, dtype: str, cache_dir: str, **overrides):
    from orin_vlm_node.engine import Engine, EngineConfig

    config = dict(
        model_path=str(model_dir), device="cuda", dtype=dtype, prefix_caching=False, max_sessions=0, max_batch=1,
        kernel_cache_dir=cache_dir, max_context_tokens=4096,
    )  # fmt: skip
    return Engine(EngineConfig(**(config | overrides)))


def _decode(torch, ctx: BenchContext, res: SectionResult, model_dir: Path, dtype: str, bandwidth: float) -> None:
    from orin_vlm_node.engine import Request, SamplingParams, Turn

    cfg = ctx.config
    n = cfg.gpu_max_new_tokens
    cache_dir = str(ctx.scratch / "kernel_cache")
    engines = {name: _engine(model_dir, dtype, cache_dir, **kw) for name, kw in PATHS.items()}
    res.setup.setdefault("decode_paths", {})[dtype] = {k: e.describe()["decode_path"] for k, e in engines.items()}
    # which projections took the GEMV kernel, with the startup timings that decided it
    res.setup.setdefault("float_weight_paths", {})[dtype] = {k: e.describe()["weight_path"] for k, e in engines.items()}
    hf = HFRunner(str(model_dir), {"fp16": torch.float16, "bf16": torch.bfloat16}[dtype], device="cuda")
    res.setup.setdefault("hf_attn_implementation", hf.attn_implementation)
    ids = iter(range(10**6))
    sampling = SamplingParams(temperature=0.0, max_new_tokens=n, ignore_eos=True)

    def eng(name):
        return lambda: run_engine(engines[name], Request(Turn(PROMPT), sampling, request_id=f"gpu-{next(ids)}"))

    sides = {name: eng(name) for name in engines} | {"hf": lambda: hf.run(PROMPT, (), None, n, ignore_eos=True)}
    ctx.log(f"gpu decode {dtype}: {cfg.gpu_repeats} alternating repeats of {n} tokens over {list(sides)}")
    runs = alternate(sides, repeats=cfg.gpu_repeats, warmup=1)
    model = engines["graphs"].parts.model
    prompt_tokens = runs["graphs"][-1].prompt_tokens
    kv_per_token = engines["graphs"].parts.cache.config.bytes_per_token
    kv_read = kv_per_token * (prompt_tokens + n / 2)  # the context grows over the answer: its mean
    weight_bytes = decode_weight_bytes(model)
    bound = bandwidth * 1e9 / (weight_bytes + kv_read)
    res.setup.setdefault("bound", {})[dtype] = {
        "weight_bytes_per_token": weight_bytes,
        "kv_bytes_per_token": kv_read,
        "bound_tok_s": bound,
    }
    for name, timings in runs.items():
        rates = [t.decode_tok_s for t in timings]
        lengths = {len(t.token_ids) for t in timings}
        if lengths != {n}:
            res.notes.append(f"decode.{dtype}.{name}: answers of {sorted(lengths)} tokens, expected {n}")
        res.add(f"decode.{dtype}.{name}.tok_s", "tok/s", rates, f"batch-1 decode, {n}-token answers", path=name)
        res.add(f"decode.{dtype}.{name}.bound_fraction", "fraction", [r / bound for r in rates],
                "decode tok/s / (copy bandwidth / bytes read per token)", path=name)  # fmt: skip
    graphs = [t.decode_tok_s for t in runs["graphs"]]
    res.add(f"decode.{dtype}.graphs_vs_hf", "x", paired_ratio(graphs, [t.decode_tok_s for t in runs["hf"]]),
            "kernels + graphs tok/s / transformers generate tok/s (per pair)")  # fmt: skip
    res.add(f"decode.{dtype}.graphs_vs_torch", "x", paired_ratio(graphs, [t.decode_tok_s for t in runs["torch"]]),
            "kernels + graphs tok/s / torch attention + graphs tok/s (per pair)")  # fmt: skip
    if dtype == cfg.gpu_dtypes[0]:
        image = ctx.image(448, 448, seed=3)
        engine = engines["graphs"]
        ttft = []
        for i in range(cfg.gpu_repeats):
            req = Request(Turn("What is in this picture?", (image,)), SamplingParams(temperature=0.0, max_new_tokens=1),
                          request_id=f"gpu-ttft-{i}")  # fmt: skip
            ttft.append(run_engine(engine, req).ttft_s)
        res.add(f"ttft_448.{dtype}.s", "s", ttft, "448x448 image + question: vision tower, prefill, first token")


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


def _step_profile(torch, ctx: BenchContext, res: SectionResult, model_dir: Path, weights: str = "none") -> None:
    """Where a decode token's time goes (fp16 activations, kernels + graphs; weights as ``weights`` says, the
    figures under ``step.fp16`` for fp16 weights and ``step.<weights>`` for quantized ones): the wall time
    of a token, overlapped and step by step (what overlapping the host with the device gains), and
    torch.profiler's kernels over 16 tokens by category, with their count per token (what the kernels do
    not cover of a token is gaps between kernels and host time). Launches are plain (:func:`launching` "off"):
    a dependent launch's profiled duration includes its wait for the kernel before it, so the kernels' times
    would not add up to the token."""
    from torch.profiler import ProfilerActivity, profile

    from orin_vlm_node.engine import Request, SamplingParams, Turn

    engine = _engine(model_dir, "fp16", str(ctx.scratch / "kernel_cache"), weight_quant=weights, **PATHS["graphs"])
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


def _quantized_decode(torch, ctx: BenchContext, res: SectionResult, model_dir: Path, bandwidth: float) -> None:
    """Batch-1 decode (kernels + graphs, fp16 activations) with weights none / int8 / int4, alternating;
    each against its own bound (the bytes it reads per token) and against fp16 weights."""
    from orin_vlm_node.engine import Request, SamplingParams, Turn

    cfg = ctx.config
    n = cfg.gpu_max_new_tokens
    cache_dir = str(ctx.scratch / "kernel_cache")
    engines = {mode: _engine(model_dir, "fp16", cache_dir, weight_quant=mode, **PATHS["graphs"]) for mode in QUANT}
    res.setup["weight_paths"] = {mode: e.describe()["weight_path"] for mode, e in engines.items()}
    ids = iter(range(10**6))
    sampling = SamplingParams(temperature=0.0, max_new_tokens=n, ignore_eos=True)

    def eng(mode):
        return lambda: run_engine(engines[mode], Request(Turn(PROMPT), sampling, request_id=f"gpu-q-{next(ids)}"))

    ctx.log(f"gpu quantized decode: {cfg.gpu_repeats} alternating repeats of {n} tokens, weights {QUANT}")
    runs = alternate({mode: eng(mode) for mode in QUANT}, repeats=cfg.gpu_repeats, warmup=1)
    # how each engine's graphs launch (dependent_launch auto: timed both ways at capture)
    res.setup["dependent_launch"] = {mode: e.describe()["decode"]["dependent_launch"] for mode, e in engines.items()}
    plain = [t.decode_tok_s for t in runs["none"]]
    for mode, timings in runs.items():
        engine = engines[mode]
        kv_read = engine.parts.cache.config.bytes_per_token * (timings[-1].prompt_tokens + n / 2)
        bound = bandwidth * 1e9 / (decode_weight_bytes(engine.parts.model) + kv_read)
        rates = [t.decode_tok_s for t in timings]
        res.add(f"quant.{mode}.tok_s", "tok/s", rates, f"batch-1 decode, fp16 activations, weights {mode}", mode=mode)
        res.add(f"quant.{mode}.bound_fraction", "fraction", [r / bound for r in rates],
                "decode tok/s / (copy bandwidth / bytes this model reads per token)", mode=mode)  # fmt: skip
        res.add(f"quant.{mode}.ttft_s", "s", [t.ttft_s for t in timings],
                "time to the first token (a prefill: quantized weights widened for torch GEMM)", mode=mode)  # fmt: skip
        if mode != "none":
            res.add(f"quant.{mode}.speedup", "x", paired_ratio(rates, plain), f"{mode} tok/s / fp16 weights tok/s",
                    mode=mode)  # fmt: skip


def _projections_and_kernels(torch, ctx: BenchContext, res: SectionResult, part: str):
    """The 2B decoder's projection shapes (name: (N, K): fused q/k/v, o, fused gate/up, down), its attention
    heads (q heads, kv heads, head_dim) and a launcher of freshly built kernels; None (the part skipped, with
    why) without the 2B config or the kernels."""
    from orin_vlm_node.cuda import AttentionShape, select_backend

    if not Path(ctx.config.big_config_path).is_file():
        res.skip_part(part, f"{ctx.config.big_config_path} not found")
        return None
    text = json.loads(Path(ctx.config.big_config_path).read_text())["text_config"]
    hidden, inter, heads = text["hidden_size"], text["intermediate_size"], text["num_attention_heads"]
    head_dim, kv_heads = text["head_dim"], text["num_key_value_heads"]
    shapes = {
        "qkv": ((heads + 2 * kv_heads) * head_dim, hidden),
        "o": (hidden, heads * head_dim),
        "gate_up": (2 * inter, hidden),
        "down": (hidden, inter),
    }
    cache_dir = tempfile.mkdtemp(prefix=f"bench_{part}_", dir=ctx.scratch)
    choice = select_backend("cuda", True, AttentionShape(torch.float16, 128, 16, 8), kernel_cache_dir=cache_dir)
    if not choice.kernels:
        res.skip_part(part, choice.status)
        return None
    return shapes, (heads, kv_heads, head_dim), choice.launcher


def _on_and_off(
    ctx: BenchContext,
    res: SectionResult,
    model_dir: Path,
    part: str,
    what: str,
    toggle,
    states: dict[str, dict] | None = None,
    **settings,
) -> None:
    """Batch-1 decode (kernels + graphs, fp16 activations) with one feature of the GPU path on and off, for fp16
    and INT4 weights (every product one of our kernels), alternating: ``<part>.<none|int4>.<on|off>.tok_s``
    and ``gain`` = on / off per pair. ``toggle(engine, on)`` sets the feature of a fresh engine (of the engine
    ``settings`` given, and ``states[on|off]``'s) before its first request, so its decode graphs are captured
    with it, or returns why it cannot (the part is skipped)."""
    from orin_vlm_node.engine import Request, SamplingParams, Turn

    cfg = ctx.config
    cache_dir = str(ctx.scratch / "kernel_cache")
    engines = {}
    for mode in ("none", "int4"):
        for state in ("on", "off"):
            state_settings = (states or {}).get(state, {})
            engine = _engine(model_dir, "fp16", cache_dir, weight_quant=mode, **PATHS["graphs"], **settings,
                             **state_settings)  # fmt: skip
            refused = toggle(engine, state == "on")
            if refused:
                res.skip_part(part, refused)
                return
            engines[f"{mode}.{state}"] = engine
    ids = iter(range(10**6))
    sampling = SamplingParams(temperature=0.0, max_new_tokens=cfg.gpu_max_new_tokens, ignore_eos=True)

    def eng(name):
        return lambda: run_engine(engines[name], Request(Turn(PROMPT), sampling, request_id=f"gpu-{part}-{next(ids)}"))

    ctx.log(f"gpu {what}: {cfg.gpu_repeats} alternating repeats over {list(engines)}")
    runs = alternate({name: eng(name) for name in engines}, repeats=cfg.gpu_repeats, warmup=1)
    for mode in ("none", "int4"):
        on, off = ([t.decode_tok_s for t in runs[f"{mode}.{state}"]] for state in ("on", "off"))
        res.add(f"{part}.{mode}.on.tok_s", "tok/s", on, f"batch-1 decode, weights {mode}, {what} on", mode=mode)
        res.add(f"{part}.{mode}.off.tok_s", "tok/s", off, f"batch-1 decode, weights {mode}, {what} off", mode=mode)
        res.add(f"{part}.{mode}.gain", "x", paired_ratio(on, off), f"tok/s with {what} / without (per pair)",
                mode=mode)  # fmt: skip


def launching(engine, setting: str) -> None:
    """A benchmark's choice of how ``engine``'s decode graphs launch their kernels: its decode step built again
    with ``setting`` "on" (every launch programmatic dependent) or "off" (every launch plain), before its first
    request. The engine itself captures each graph both ways and keeps the faster replay."""
    import torch

    from orin_vlm_node.cuda import LaunchModes
    from orin_vlm_node.engine.assemble import MAX_BATCH
    from orin_vlm_node.engine.decode_step import build_decode_step

    parts = engine.parts
    modes = LaunchModes(parts.attention.launcher, setting)
    stream = torch.cuda.Stream(parts.device)
    parts.decode_step = build_decode_step(parts.model, parts.cache, parts.device, True, MAX_BATCH, stream, modes)


def _dependent_launches(setting: str | None):
    """``_on_and_off``'s toggle: the engine's graphs launched ``setting`` (:func:`launching`; None: "on" for the
    feature's on side, "off" for its off side) where its kernels can launch dependently (sm_90 and later); else
    why not."""

    def toggle(engine, on: bool) -> str | None:
        status = engine.parts.attention.launcher.programmatic_status
        if status != "on":
            return f"programmatic dependent launch {status}"
        launching(engine, setting or ("on" if on else "off"))
        return None

    return toggle


def _dependent_launch(ctx: BenchContext, res: SectionResult, model_dir: Path) -> None:
    """What overlapping each kernel's start with its predecessor's end gains a token: the decode graphs'
    launches all programmatic dependent or all plain (the engine's own choice, both captured and the faster
    kept, is what the ``quant`` part measures)."""
    _on_and_off(ctx, res, model_dir, "pdl", "dependent launches", _dependent_launches(None))


# compat.cuh's sm_90 L2 prefetch, and what the l2_prefetch part's copy of the sources has in its place.
L2_PREFETCH = (
    '__device__ __forceinline__ void prefetch_l2(const void* p) { asm volatile("prefetch.global.L2 [%0];" ::"l"(p)); }'  # noqa: E501
)
NO_L2_PREFETCH = "__device__ __forceinline__ void prefetch_l2(const void*) {}"


def _l2_prefetch(ctx: BenchContext, res: SectionResult, model_dir: Path) -> None:
    """What the GEMV kernels' L2 prefetch of their weights gains a token where it is meant to: every launch
    dependent, so a GEMV's blocks start, and ask for their weights, while the kernel before it runs. With
    INT4 weights dependent launch turned from a gain (at 4cc2443, before the prefetch) into a loss; this
    separates the prefetch from the other changes since. The kernels without it are built from a copy of the
    sources (``kernel_dir``) whose ``prefetch_l2`` is empty."""
    from orin_vlm_node.cuda.sources import find_kernel_sources

    copy = ctx.scratch / "kernels_without_l2_prefetch"
    shutil.copytree(find_kernel_sources().directory, copy, dirs_exist_ok=True)
    compat = (copy / "compat.cuh").read_text()
    if compat.count(L2_PREFETCH) != 1:
        res.skip_part("l2_prefetch", "compat.cuh's prefetch_l2 is not the one this part empties")
        return
    (copy / "compat.cuh").write_text(compat.replace(L2_PREFETCH, NO_L2_PREFETCH))
    states = {"on": {}, "off": {"kernel_dir": str(copy)}}
    _on_and_off(ctx, res, model_dir, "l2_prefetch", "the L2 prefetch", _dependent_launches("on"), states)


def _batching(ctx: BenchContext, res: SectionResult, model_dir: Path) -> None:
    """Continuous batching on the GPU path (kernels + graphs, fp16): the ``batching`` section's figures."""
    cfg = ctx.config
    sizes = tuple(cfg.batch_sizes)
    engine = _engine(model_dir, "fp16", str(ctx.scratch / "kernel_cache"), max_batch=max(sizes), **PATHS["graphs"])
    ctx.log(f"gpu batching: batches of {sizes}, {cfg.gpu_max_new_tokens} tokens each")
    batching.measure(res, "batching.fp16.", engine, sizes, cfg.gpu_max_new_tokens, cfg.gpu_repeats, 1)
    res.setup["batching_decode"] = engine.describe()["decode"]


def _probe(torch, model_dir: Path, dtype: str, cache_dir: Path, max_context: int) -> dict:
    """bench.startup_probe's record; what the device has in use before it starts (this process's CUDA
    context and cache, other processes) is passed along and left out of its memory figures."""
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    cmd = [sys.executable, "-m", "bench.startup_probe", str(model_dir), dtype, str(cache_dir),
           str(max_context), repr(time.time()), repr((total - free) / 2**20)]  # fmt: skip
    out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    if out.returncode != 0:
        raise RuntimeError(f"startup_probe failed ({out.returncode}): {out.stderr[-1500:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _startup_and_memory(torch, ctx: BenchContext, res: SectionResult, model_dir: Path, default_dir: Path) -> None:
    cache = Path(tempfile.mkdtemp(prefix="bench_startup_cache_", dir=ctx.scratch))
    context = ctx.config.gpu_startup_context
    cold = _probe(torch, model_dir, "fp16", cache, context)
    warm = _probe(torch, model_dir, "fp16", cache, context)
    res.setup["startup"] = {"cold": cold, "warm": warm}
    res.add("startup.cold_s", "s", [cold["ready_s"]], "process start to ready engine, empty kernel cache (fp16)")
    res.add("startup.warm_s", "s", [warm["ready_s"]], "process start to ready engine, kernels cached (fp16)")
    limit_mb = warm["weight_mb"] + 1.25 * warm["kv_context_mb"] + 1024
    res.add("memory.2b_fp16.used_mb", "MB", [warm["used_mb"]],
            f"engine process's GPU memory after an image request, {context} context (CUDA context in)")  # fmt: skip
    res.add("memory.2b_fp16.used_vs_limit", "x", [warm["used_mb"] / limit_mb],
            "used / (weights + 1.25 x one context of KV + 1 GB)")  # fmt: skip
    small = _probe(torch, default_dir, "fp32", cache, 4096)
    res.setup["default_model_probe"] = small
    res.add("memory.default_model.used_mb", "MB", [small["used_mb"]],
            "default model: engine process's GPU memory after an image request (CUDA context included)")  # fmt: skip


def _run_parts(
    ctx: BenchContext, res: SectionResult, started: float, parts: list[tuple[str, Callable[[], None]]]
) -> None:
    """Run the parts in order; one that raises is recorded (``skip_part`` with the error, traceback in the
    log) and the rest still run. Once ``gpu_budget_s`` has passed since ``started`` (the section's start,
    ``time.monotonic()``) the remaining parts are skipped with that reason, so a lease of fixed length still
    ends with the figures measured so far written out; the first part to run always starts (a budget spent
    by the section's setup alone would otherwise measure nothing: the caller's timeout allows a part). With
    ``gpu_parts`` set, the others are skipped as not selected."""
    import torch

    budget = ctx.config.gpu_budget_s
    started_any = False
    for name, part in parts:
        if ctx.config.gpu_parts and name not in ctx.config.gpu_parts:
            res.skip_part(name, "not selected (--gpu-parts)")
            continue
        spent = time.monotonic() - started
        if budget and spent > budget and started_any:
            res.skip_part(name, f"time budget of {budget:.0f} s spent ({spent:.0f} s)")
            continue
        started_any = True
        ctx.log(f"gpu part {name} ({spent:.0f} s into the section)")
        try:
            part()
        except Exception as exc:  # noqa: BLE001 - one broken part must not lose the others' figures
            ctx.log(f"gpu part {name} failed:\n{traceback.format_exc()}")
            res.skip_part(name, f"error: {type(exc).__name__}: {exc}")
        gc.collect()  # the part's engines and transformers model go before the next ones load
        torch.cuda.empty_cache()


def run(ctx: BenchContext) -> SectionResult:
    import torch

    if not torch.cuda.is_available():
        return skipped("gpu", "no CUDA device")
    started = time.monotonic()
    cfg = ctx.config
    res = SectionResult("gpu")
    props = torch.cuda.get_device_properties(0)
    res.setup.update(device=props.name, sm_count=props.multi_processor_count, memory_gib=props.total_memory / 2**30)
    bandwidth = copy_bandwidth_gbs(torch)
    res.add("bandwidth.copy_gbs", "GB/s", [bandwidth], "device-to-device copy, bytes read + written per second")
    default_dir, _ = ctx.default_model()
    if Path(cfg.big_config_path).is_file():
        model_dir, what = ctx.big_checkpoint(), "2B-shape random checkpoint"
    else:
        model_dir, what = default_dir, "default model (the 2B config was not found)"
        res.notes.append(f"{cfg.big_config_path} not found: decode figures are for the default model")
    res.setup["model"] = what
    first = cfg.gpu_dtypes[0]
    steps = {
        "step_profile": functools.partial(_step_profile, torch, ctx, res, model_dir),
        "step_profile_int4": functools.partial(_step_profile, torch, ctx, res, model_dir, "int4"),
        "startup_memory": functools.partial(_startup_and_memory, torch, ctx, res, model_dir, default_dir),
        "kernels": functools.partial(_kernels, torch, ctx, res),
        "gemv": functools.partial(_gemv, torch, ctx, res, bandwidth),
        "quant": functools.partial(_quantized_decode, torch, ctx, res, model_dir, bandwidth),
        "pdl": functools.partial(_dependent_launch, ctx, res, model_dir),
        "l2_prefetch": functools.partial(_l2_prefetch, ctx, res, model_dir),
        "batching": functools.partial(_batching, ctx, res, model_dir),
    }
    for d in cfg.gpu_dtypes:
        steps[f"decode.{d}"] = functools.partial(_decode, torch, ctx, res, model_dir, d, bandwidth)
    _run_parts(ctx, res, started, [(name, steps[name]) for name in part_names(cfg.gpu_dtypes, cfg.gpu_parts)])
    summary = f"{props.name}; {what}; batch 1, greedy, {cfg.gpu_max_new_tokens}-token answers; copy bandwidth "
    summary += f"{bandwidth:.0f} GB/s"
    if f"decode.{first}.graphs.tok_s" in res.figures:
        bound = res.setup["bound"][first]["bound_tok_s"]
        rate = res.figures[f"decode.{first}.graphs.tok_s"].as_dict()["median"]
        summary += f"; {first} kernels+graphs {rate:.0f} tok/s = {rate / bound:.0%} of the {bound:.0f} tok/s bound"
    res.setup["summary"] = summary + "."
    return res
