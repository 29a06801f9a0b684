"""The CPU GEMM kernels (``kernels/cpu_gemm.cpp``) bound with ctypes: ``x @ w.T`` with fp32 or bf16 weights,
fp32 sums.

* ``few_rows``: the 1..8 rows of a decode step, the weight read once for all rows and every output summed in
  one order whatever the row count (a sequence's logits do not depend on what it is batched with).
* ``many_rows``: any row count, for a prefill: the weight widened and packed into panels in the kernel and
  multiplied by broadcast activations (the GEMM micro-kernel), so a bf16 weight is never copied to fp32 in
  memory and the arithmetic runs near the FMA units' peak.
"""

from __future__ import annotations

import ctypes
import logging
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from ..artifact_cache import default_cache_dir
from ..cuda.sources import KernelSourcesNotFound, find_kernel_sources
from .build import CpuKernelUnavailable, build_library, load_library

_log = logging.getLogger(__name__)

SOURCE = "cpu_gemm.cpp"
# Below this many weight elements one thread is faster than handing chunks to torch's OpenMP workers.
PARALLEL_MIN_WEIGHTS = 1 << 20


class CpuGemm:
    """The loaded library: ``few_rows`` and ``many_rows``, each ``(x (m, k), w (n, k)) -> (m, n)`` in ``x``'s
    dtype, ``w`` contiguous in one of ``DTYPES``, accumulation in fp32; the weight rows split over torch's
    intra-op threads (its OpenMP runtime, which the library shares)."""

    DTYPES = (torch.float32, torch.bfloat16)

    def __init__(self, lib: ctypes.CDLL, origin: str) -> None:
        ptr, num = ctypes.c_void_p, ctypes.c_int
        self._few = {torch.float32: lib.few_rows_gemm_f32, torch.bfloat16: lib.few_rows_gemm_bf16}
        self._many = {torch.float32: lib.many_rows_gemm_f32, torch.bfloat16: lib.many_rows_gemm_bf16}
        for fns, scratch in ((self._few, []), (self._many, [ptr])):
            for fn in fns.values():
                fn.argtypes = [ptr, ptr, ptr, *scratch, num, num, num, num]
                fn.restype = ctypes.c_int
        lib.few_rows_gemm_max_rows.restype = ctypes.c_int
        self.max_rows: int = lib.few_rows_gemm_max_rows()  # the most rows ``few_rows`` takes
        self.origin = origin  # "compiled in 1.2 s" / "from the cache", for the log and diagnostics

    def few_rows(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """(m, k) x (n, k) -> (m, n) for 1 <= m <= ``max_rows``; CPU tensors. Every decode step's call."""
        fn, x32, y, threads = _operands(self._few, "few_rows_gemm", x, w)
        if fn(x32.data_ptr(), w.data_ptr(), y.data_ptr(), *y.shape, x32.shape[1], threads):
            raise ValueError(f"few_rows_gemm takes 1..{self.max_rows} rows, got {y.shape[0]}")
        return y.to(x.dtype)

    def many_rows(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """(m, k) x (n, k) -> (m, n) for any m >= 1; CPU tensors."""
        fn, x32, y, threads = _operands(self._many, "many_rows_gemm", x, w)
        scratch = torch.empty(x32.numel())  # the rows packed k-major, in groups
        if fn(x32.data_ptr(), w.data_ptr(), y.data_ptr(), scratch.data_ptr(), *y.shape, x32.shape[1], threads):
            raise ValueError(f"many_rows_gemm takes 1 or more rows, got {y.shape[0]}")
        return y.to(x.dtype)


def _operands(
    fns: dict[torch.dtype, Callable[..., int]], kernel: str, x: torch.Tensor, w: torch.Tensor
) -> tuple[Callable[..., int], torch.Tensor, torch.Tensor, int]:
    """The kernel for ``w``'s dtype, ``x`` as contiguous fp32, the output ``y (m, n)`` and the thread count;
    a weight the kernel cannot read raw raises."""
    fn = fns.get(w.dtype)
    if fn is None or not w.is_contiguous() or w.shape[1] != x.shape[1]:  # the kernel reads w's memory raw
        raise ValueError(f"{kernel} takes a contiguous fp32/bf16 (n, {x.shape[1]}) weight, got "
                         f"{w.dtype} {tuple(w.shape)} strides {w.stride()}")  # fmt: skip
    x32 = x.to(torch.float32).contiguous()  # no copy for a contiguous fp32 x
    n, k = w.shape
    threads = torch.get_num_threads() if n * k >= PARALLEL_MIN_WEIGHTS else 1
    return fn, x32, torch.empty(x32.shape[0], n), threads


def _probe(gemm: CpuGemm) -> str | None:
    """Why a kernel disagrees with ``F.linear`` in fp32 on every row count it serves differently and every
    weight dtype (odd sizes: the K and N tails, several threads, more than one panel of k), or None."""
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(1000, 1051, generator=gen)  # 1000 x 1051 > PARALLEL_MIN_WEIGHTS: the threaded split too
    checks = [("few_rows", gemm.few_rows, m) for m in range(1, gemm.max_rows + 1)]
    checks += [("many_rows", gemm.many_rows, m) for m in (1, 5, 6, 7, 13)]  # groups of 6 and their tails
    for dtype in gemm.DTYPES:
        stored = w.to(dtype)
        for name, kernel, m in checks:
            x = torch.randn(m, 1051, generator=gen)
            got, want = kernel(x, stored), F.linear(x, stored.float())
            if not torch.allclose(got, want, rtol=1e-4, atol=1e-3):
                error = (got - want).abs().max().item()
                return f"{name} disagrees with F.linear for {m} rows of {dtype} weights (max error {error:.3g})"
    return None


def load_cpu_gemm(kernel_dir: str = "", cache_dir: str = "") -> CpuGemm:
    """The kernels built (or taken from the cache) and probed; ``CpuKernelUnavailable`` says why not."""
    try:
        source = find_kernel_sources(kernel_dir).directory / SOURCE
    except KernelSourcesNotFound as exc:
        raise CpuKernelUnavailable(str(exc)) from exc
    if not source.is_file():
        raise CpuKernelUnavailable(f"{source} not found (the kernel sources lack {SOURCE})")
    cache = Path(cache_dir).expanduser() if cache_dir else default_cache_dir()
    t0 = time.perf_counter()
    payload, hit = build_library(source, cache)
    origin = "from the cache" if hit else f"compiled in {time.perf_counter() - t0:.1f} s"
    gemm = CpuGemm(load_library(payload, cache), origin)
    problem = _probe(gemm)
    if problem:
        raise CpuKernelUnavailable(f"{SOURCE} {problem}")
    return gemm


def cpu_gemm_for(
    device: torch.device, dtype: torch.dtype, kernel_dir: str = "", cache_dir: str = ""
) -> tuple[CpuGemm | None, str]:
    """(the kernels, "") for an fp32 or bf16 model on the CPU, else (None, why not); kernels that cannot be
    built or loaded are also logged as a warning with the whole reason (compiler output included)."""
    if device.type != "cpu":
        return None, f"not a CPU: {device.type}"
    if dtype not in CpuGemm.DTYPES:
        return None, f"{str(dtype).removeprefix('torch.')} weights; the CPU GEMM kernels take fp32 and bf16"
    try:
        return load_cpu_gemm(kernel_dir, cache_dir), ""
    except CpuKernelUnavailable as exc:
        _log.warning("CPU GEMM kernels unavailable, projections use F.linear: %s", exc)
        return None, f"CPU GEMM kernels unavailable: {str(exc).splitlines()[0]}"
