"""The GPU section's kernel figures, apart from the engine: the copy bandwidth every bound is measured against,
the paged decode kernel against contiguous SDPA, and one row through each projection of the 2B decoder."""

from __future__ import annotations

import functools
import json
import tempfile
from pathlib import Path

from bench.context import BenchContext
from bench.section import SectionResult


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


def paged_attention(torch, ctx: BenchContext, res: SectionResult) -> None:
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


def gemv(torch, ctx: BenchContext, res: SectionResult, bandwidth: float) -> None:
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
