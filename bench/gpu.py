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
from collections.abc import Callable
from pathlib import Path

from bench import batching, gpu_kernels, gpu_profile
from bench.config import REPO, part_names
from bench.context import BenchContext
from bench.gpu_engines import PATHS, PROMPT, decode_weight_bytes, launching, make_engine
from bench.section import SectionResult, skipped
from bench.stats import alternate, paired_ratio
from bench.timing import HFRunner, run_engine

QUANT = ("none", "int8", "int4")  # weight_quant of the quantized-decode comparison
MB = 2**20


def _decode(torch, ctx: BenchContext, res: SectionResult, model_dir: Path, dtype: str, bandwidth: float) -> None:
    from orin_vlm_node.engine import Request, SamplingParams, Turn

    cfg = ctx.config
    n = cfg.gpu_max_new_tokens
    cache_dir = str(ctx.scratch / "kernel_cache")
    engines = {name: make_engine(model_dir, dtype, cache_dir, **kw) for name, kw in PATHS.items()}
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


def _quantized_decode(torch, ctx: BenchContext, res: SectionResult, model_dir: Path, bandwidth: float) -> None:
    """Batch-1 decode (kernels + graphs, fp16 activations) with weights none / int8 / int4, alternating;
    each against its own bound (the bytes it reads per token) and against fp16 weights."""
    from orin_vlm_node.engine import Request, SamplingParams, Turn

    cfg = ctx.config
    n = cfg.gpu_max_new_tokens
    cache_dir = str(ctx.scratch / "kernel_cache")
    engines = {mode: make_engine(model_dir, "fp16", cache_dir, weight_quant=mode, **PATHS["graphs"]) for mode in QUANT}
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
            engine = make_engine(model_dir, "fp16", cache_dir, weight_quant=mode, **PATHS["graphs"], **settings,
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
    engine = make_engine(model_dir, "fp16", str(ctx.scratch / "kernel_cache"), max_batch=max(sizes), **PATHS["graphs"])
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
    bandwidth = gpu_kernels.copy_bandwidth_gbs(torch)
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
        "step_profile": functools.partial(gpu_profile.step_profile, torch, ctx, res, model_dir),
        "step_profile_int4": functools.partial(gpu_profile.step_profile, torch, ctx, res, model_dir, "int4"),
        "startup_memory": functools.partial(_startup_and_memory, torch, ctx, res, model_dir, default_dir),
        "kernels": functools.partial(gpu_kernels.paged_attention, torch, ctx, res),
        "gemv": functools.partial(gpu_kernels.gemv, torch, ctx, res, bandwidth),
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
