"""The ``few_rows_gemm`` kernel (``kernels/few_rows_gemm.cpp``) bound with ctypes: ``x @ w.T`` for the
1..8 rows of a CPU decode step, fp32 or bf16 weights, the weight read once for all rows and every output
summed in one order whatever the row count (a sequence's logits do not depend on what it is batched with)."""

from __future__ import annotations

import ctypes
import logging
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from ..artifact_cache import default_cache_dir
from ..cuda.sources import KernelSourcesNotFound, find_kernel_sources
from .build import CpuKernelUnavailable, build_library, load_library

_log = logging.getLogger(__name__)

SOURCE = "few_rows_gemm.cpp"
# Below this many weight elements one thread is faster than handing chunks to torch's OpenMP workers.
PARALLEL_MIN_WEIGHTS = 1 << 20


class FewRowsGemm:
    """The loaded library: ``gemm(x (m, k), w (n, k)) -> (m, n)`` in ``x``'s dtype, 1 <= m <= ``max_rows``,
    ``w`` contiguous in one of ``DTYPES``, accumulation in fp32; the weight rows split over torch's
    intra-op threads (its OpenMP runtime, which the library shares)."""

    DTYPES = (torch.float32, torch.bfloat16)

    def __init__(self, lib: ctypes.CDLL, origin: str) -> None:
        ptr, num = ctypes.c_void_p, ctypes.c_int
        self._fns = {torch.float32: lib.few_rows_gemm_f32, torch.bfloat16: lib.few_rows_gemm_bf16}
        for fn in self._fns.values():
            fn.argtypes = [ptr, ptr, ptr, num, num, num, num]
            fn.restype = ctypes.c_int
        lib.few_rows_gemm_max_rows.restype = ctypes.c_int
        self.max_rows: int = lib.few_rows_gemm_max_rows()
        self.origin = origin  # "compiled in 1.2 s" / "from the cache", for the log and diagnostics

    def __call__(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """(m, k) x (n, k) -> (m, n); CPU tensors."""
        fn = self._fns.get(w.dtype)
        if fn is None or not w.is_contiguous() or w.shape[1] != x.shape[1]:  # the kernel reads w's memory raw
            raise ValueError(f"few_rows_gemm takes a contiguous fp32/bf16 (n, {x.shape[1]}) weight, got "
                             f"{w.dtype} {tuple(w.shape)} strides {w.stride()}")  # fmt: skip
        x32 = x.to(torch.float32).contiguous()  # no copy for a contiguous fp32 x
        (m, k), n = x32.shape, w.shape[0]
        y = torch.empty(m, n)
        threads = torch.get_num_threads() if n * k >= PARALLEL_MIN_WEIGHTS else 1
        if fn(x32.data_ptr(), w.data_ptr(), y.data_ptr(), m, n, k, threads):
            raise ValueError(f"few_rows_gemm takes 1..{self.max_rows} rows, got {m}")
        return y.to(x.dtype)


def _probe(gemm: FewRowsGemm) -> str | None:
    """Why the kernel disagrees with ``F.linear`` in fp32 on every row count and weight dtype (odd sizes:
    the K and N tails, several threads), or None when it agrees."""
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(1000, 1051, generator=gen)  # 1000 x 1051 > PARALLEL_MIN_WEIGHTS: the threaded split too
    for dtype in gemm.DTYPES:
        stored = w.to(dtype)
        for m in range(1, gemm.max_rows + 1):
            x = torch.randn(m, 1051, generator=gen)
            got, want = gemm(x, stored), F.linear(x, stored.float())
            if not torch.allclose(got, want, rtol=1e-4, atol=1e-3):
                error = (got - want).abs().max().item()
                return f"disagrees with F.linear for {m} rows of {dtype} weights (max error {error:.3g})"
    return None


def load_few_rows_gemm(kernel_dir: str = "", cache_dir: str = "") -> FewRowsGemm:
    """The kernel built (or taken from the cache) and probed; ``CpuKernelUnavailable`` says why not."""
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
    gemm = FewRowsGemm(load_library(payload, cache), origin)
    problem = _probe(gemm)
    if problem:
        raise CpuKernelUnavailable(f"{SOURCE} {problem}")
    return gemm


def few_rows_gemm_for(
    device: torch.device, dtype: torch.dtype, kernel_dir: str = "", cache_dir: str = ""
) -> tuple[FewRowsGemm | None, str]:
    """(the kernel, "") for an fp32 or bf16 model on the CPU, else (None, why not); a kernel that cannot be
    built or loaded is also logged as a warning with the whole reason (compiler output included)."""
    if device.type != "cpu":
        return None, f"not a CPU: {device.type}"
    if dtype not in FewRowsGemm.DTYPES:
        return None, f"{str(dtype).removeprefix('torch.')} weights; the few-rows kernel takes fp32 and bf16"
    try:
        return load_few_rows_gemm(kernel_dir, cache_dir), ""
    except CpuKernelUnavailable as exc:
        _log.warning("CPU few-rows GEMM unavailable, projections use F.linear: %s", exc)
        return None, f"few-rows GEMM unavailable: {str(exc).splitlines()[0]}"
