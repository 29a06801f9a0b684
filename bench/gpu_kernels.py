"""Decode-attention kernel benchmark: achieved memory bandwidth vs the device peak, paged vs contiguous.

For contexts 512..8192 (Qwen3-VL-2B attention shape by default: 16 q heads, 8 kv heads, head_dim 128,
fp16, page 16) it times, with CUDA events over many launches:
  * the paged decode kernel on a shuffled block table (what the cache produces after some churn),
  * the same kernel on an identity table (the pages physically contiguous),
  * torch's scaled_dot_product_attention on contiguous K/V (a non-paged baseline).
Bandwidth = bytes the kernel must read (K and V of the context, plus q and the output) / time.
Peak = 2 * memory clock * bus width (from the driver via PyCUDA). Prints one JSON document.

Usage: python bench/gpu_kernels.py [--heads 16 --kv-heads 8 --head-dim 128 --dtype fp16 --page 16]
Exits with status 2 and a message when there is no CUDA GPU or PyCUDA.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

CONTEXTS = (512, 1024, 2048, 4096, 8192)
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


def peak_bandwidth_gbs(device_index: int) -> float | None:
    import pycuda.driver as drv

    drv.init()
    dev = drv.Device(device_index)
    clock_khz = dev.get_attribute(drv.device_attribute.MEMORY_CLOCK_RATE)
    bus_bits = dev.get_attribute(drv.device_attribute.GLOBAL_MEMORY_BUS_WIDTH)
    if not clock_khz or not bus_bits:
        return None
    return 2.0 * clock_khz * 1e3 * bus_bits / 8 / 1e9


def time_ms(fn, iters: int = 200, warmup: int = 20) -> float:
    for _ in range(warmup):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="fp16")
    ap.add_argument("--page", type=int, default=16)
    ap.add_argument("--cache-dir", default="", help="kernel cache dir (default: a temporary one)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("gpu_kernels: no CUDA GPU visible to torch; nothing to measure", file=sys.stderr)
        return 2
    if importlib.util.find_spec("pycuda") is None:
        print("gpu_kernels: PyCUDA is not installed (pip install pycuda); the kernels need it", file=sys.stderr)
        return 2

    from orin_vlm_node.cuda import select_backend

    cache_dir = args.cache_dir or tempfile.mkdtemp(prefix="orin_vlm_kernels_")
    choice = select_backend("cuda", True, False, cache_dir, allow_fallback=False)
    impl = choice.attention_impl
    dtype, nq, nkv, hd, page = DTYPES[args.dtype], args.heads, args.kv_heads, args.head_dim, args.page
    elem = torch.empty((), dtype=dtype).element_size()
    dev = torch.device("cuda", torch.cuda.current_device())
    peak = peak_bandwidth_gbs(dev.index)
    rows = []
    for ctx in CONTEXTS:
        blocks = ctx // page
        k_pool = torch.randn(blocks, page, nkv, hd, device=dev).to(dtype)
        v_pool = torch.randn_like(k_pool)
        q = torch.randn(1, nq, hd, device=dev).to(dtype)
        kv_len = torch.tensor([ctx], dtype=torch.int32, device=dev)
        shuffled = torch.randperm(blocks, device=dev).to(torch.int32)
        identity = torch.arange(blocks, device=dev, dtype=torch.int32)
        paged_ms = time_ms(lambda t=shuffled: impl.attend_decode(q, k_pool, v_pool, t, kv_len))  # noqa: B023
        contig_ms = time_ms(lambda t=identity: impl.attend_decode(q, k_pool, v_pool, t, kv_len))  # noqa: B023
        kc = k_pool.reshape(ctx, nkv, hd).transpose(0, 1).repeat_interleave(nq // nkv, 0).unsqueeze(0)
        vc = v_pool.reshape(ctx, nkv, hd).transpose(0, 1).repeat_interleave(nq // nkv, 0).unsqueeze(0)
        qs = q.transpose(0, 1).unsqueeze(0)
        sdpa_ms = time_ms(lambda: torch.nn.functional.scaled_dot_product_attention(qs, kc, vc))  # noqa: B023
        bytes_read = 2 * ctx * nkv * hd * elem + 2 * nq * hd * elem
        gbs = bytes_read / (paged_ms * 1e-3) / 1e9
        rows.append(
            {
                "context": ctx,
                "splits": impl.decode_plan(ctx, nkv)[0],
                "paged_us": round(paged_ms * 1e3, 2),
                "contiguous_table_us": round(contig_ms * 1e3, 2),
                "torch_sdpa_contiguous_us": round(sdpa_ms * 1e3, 2),
                "paged_GBps": round(gbs, 1),
                "fraction_of_peak": round(gbs / peak, 3) if peak else None,
            }
        )
    report = {
        "device": torch.cuda.get_device_name(dev),
        "arch": choice.arch,
        "kernel_build_s": round(choice.build_seconds, 2),
        "shape": {"heads": nq, "kv_heads": nkv, "head_dim": hd, "dtype": args.dtype, "page": page},
        "peak_GBps": round(peak, 1) if peak else None,
        "results": rows,
    }
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
