"""The CPU GEMM kernels (``kernels/cpu_gemm.cpp``) bound with ctypes: ``x @ w.T`` with fp32, bf16, int8 or int4
weights widened in registers, fp32 sums.

* ``few_rows``: the 1..8 rows of a decode step, the weight read once for all rows and every output summed in
  one order whatever the row count (a sequence's logits do not depend on what it is batched with).
* ``many_rows``: any row count, for a prefill: the weight widened and packed into panels in the kernel and
  multiplied by broadcast activations (the GEMM micro-kernel), so a bf16 or quantized weight is never
  copied to fp32 in memory and the arithmetic runs near the FMA units' peak.

More in docs/modules.md, ``orin_vlm_node/cpu/gemm.py``.
"""

from __future__ import annotations

import ctypes
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple, Protocol

import torch
import torch.nn.functional as F

from ..artifact_cache import default_cache_dir
from ..cuda.sources import KernelSourcesNotFound, find_kernel_sources
from .build import CpuKernelUnavailable, build_library, load_library

_log = logging.getLogger(__name__)

SOURCE = "cpu_gemm.cpp"
# Below this many weight elements one thread is faster than handing chunks to torch's OpenMP workers.
PARALLEL_MIN_WEIGHTS = 1 << 20
INT4_MIN_GROUP = 16  # the few-rows kernel reads 16 consecutive values of a group at once: groups of 16, 32, ...


class Int4Weight(Protocol):
    """An (n, k) weight of 4-bit values as the kernels read it (``weights.quant.QuantizedLinear`` in int4 mode is
    one): ``qweight`` (n, ceil(k / 2)) uint8, two values a byte along k, even k in the low nibble; ``scales``
    and ``offsets`` (n, ceil(k / group_size)) fp16, one pair per group of ``group_size`` consecutive k (a
    power of two >= ``INT4_MIN_GROUP``); a weight is ``q * scale + offset`` of its group."""

    qweight: torch.Tensor
    scales: torch.Tensor
    offsets: torch.Tensor
    in_features: int
    group_size: int


Weight = torch.Tensor | Int4Weight  # an fp32, bf16 or int8 tensor (n, k), or 4-bit values with their groups


class CpuGemm:
    """The loaded library: ``few_rows`` and ``many_rows``, each ``(x (m, k), w (n, k)) -> (m, n)`` in ``x``'s
    dtype, ``w`` a contiguous tensor of one of ``DTYPES`` or an :class:`Int4Weight`, accumulation in fp32; the
    weight rows split over torch's intra-op threads (its OpenMP runtime, which the library shares)."""

    DTYPES = (torch.float32, torch.bfloat16, torch.int8)
    int4_min_group = INT4_MIN_GROUP
    _TAGS = {torch.float32: "f32", torch.bfloat16: "bf16", torch.int8: "int8", "int4": "int4"}

    def __init__(self, lib: ctypes.CDLL, origin: str, torch_bf16_prefill: bool = False) -> None:
        ptr, num = ctypes.c_void_p, ctypes.c_int
        self._few: dict[object, Callable[..., int]] = {}
        self._many: dict[object, Callable[..., int]] = {}
        for key, tag in self._TAGS.items():
            weight = [ptr, ptr, ptr, num] if key == "int4" else [ptr]  # int4: values, scales, offsets, group
            for fns, kernel, scratch in ((self._few, "few_rows_gemm", []), (self._many, "many_rows_gemm", [ptr])):
                fn = getattr(lib, f"{kernel}_{tag}")
                fn.argtypes = [ptr, ptr, *scratch, num, num, num, num, *weight]
                fn.restype = ctypes.c_int
                fns[key] = fn
        lib.few_rows_gemm_max_rows.restype = ctypes.c_int
        self.max_rows: int = lib.few_rows_gemm_max_rows()  # the most rows ``few_rows`` takes
        self.origin = origin  # "compiled in 1.2 s" / "from the cache", for the log and diagnostics
        # The CPU multiplies bf16 natively (:func:`native_bf16`): torch's GEMM is the faster one for a prefill
        # of bf16 weights there, and the callers route those rows to it (``weights.cpu_linear``).
        self.torch_bf16_prefill = torch_bf16_prefill

    def bind(self, w: Weight) -> BoundWeight:
        """``w`` checked once for the kernels (a weight they cannot read raw raises ``ValueError``)."""
        return BoundWeight(self, w)

    def few_rows(self, x: torch.Tensor, w: Weight) -> torch.Tensor:
        """(m, k) x (n, k) -> (m, n) for 1 <= m <= ``max_rows``; CPU tensors."""
        return self.bind(w).few_rows(x)

    def many_rows(self, x: torch.Tensor, w: Weight) -> torch.Tensor:
        """(m, k) x (n, k) -> (m, n) for any m >= 1; CPU tensors."""
        return self.bind(w).many_rows(x)


class BoundWeight:
    """One weight with its kernels, checked once: a projection binds its weight when it is routed to the
    kernels, and every product after that only converts ``x`` and calls.

    Why: on the default model a decode token is 17 products of small weights, and the check of the weight's
    dtype, shape, layout and int4 groups on every call cost as much as the kernel call itself (9.7 us a call
    against 4.4 for the ctypes call alone, 384 x 128 fp32, one thread). The weight's pointers are read on
    every call, so a weight whose storage is replaced in place is never read at its old address."""

    def __init__(self, gemm: CpuGemm, w: Weight) -> None:
        if isinstance(w, torch.Tensor):
            key = w.dtype
            if key not in gemm._few or w.dim() != 2 or not w.is_contiguous():  # the kernel reads w's memory raw
                raise ValueError(f"the CPU kernels take a contiguous fp32/bf16/int8 (n, k) weight, got "
                                 f"{w.dtype} {tuple(w.shape)} strides {w.stride()}")  # fmt: skip
            self.n, self.k = w.shape
        else:
            key = "int4"
            _check_int4(w)
            self.n, self.k = w.qweight.shape[0], w.in_features
        self.weight = w
        self.max_rows = gemm.max_rows
        self._few, self._many = gemm._few[key], gemm._many[key]
        self._threaded = self.n * self.k >= PARALLEL_MIN_WEIGHTS

    def _pointers(self) -> tuple[int, ...]:
        w = self.weight
        if isinstance(w, torch.Tensor):
            return (w.data_ptr(),)
        return w.qweight.data_ptr(), w.scales.data_ptr(), w.offsets.data_ptr(), w.group_size

    def _operands(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
        """``x`` as contiguous fp32, the output ``y (m, n)`` and the thread count."""
        if x.dim() != 2 or x.shape[1] != self.k:
            raise ValueError(f"the weight takes (m, {self.k}) rows, got {tuple(x.shape)}")
        x32 = x if x.dtype == torch.float32 and x.is_contiguous() else x.to(torch.float32).contiguous()
        threads = torch.get_num_threads() if self._threaded else 1
        return x32, torch.empty(x32.shape[0], self.n), threads

    def few_rows(self, x: torch.Tensor) -> torch.Tensor:
        """(m, k) -> (m, n) for 1 <= m <= ``max_rows``. Every decode step's call."""
        x32, y, threads = self._operands(x)
        if self._few(x32.data_ptr(), y.data_ptr(), y.shape[0], self.n, self.k, threads, *self._pointers()):
            raise ValueError(f"few_rows_gemm takes 1..{self.max_rows} rows, got {y.shape[0]}")
        return y if x.dtype == torch.float32 else y.to(x.dtype)

    def many_rows(self, x: torch.Tensor) -> torch.Tensor:
        """(m, k) -> (m, n) for any m >= 1."""
        x32, y, threads = self._operands(x)
        scratch = torch.empty(x32.numel())  # the rows packed k-major, in groups
        ptrs = self._pointers()
        if self._many(x32.data_ptr(), y.data_ptr(), scratch.data_ptr(), y.shape[0], self.n, self.k, threads, *ptrs):
            raise ValueError(f"many_rows_gemm takes 1 or more rows, got {y.shape[0]}")
        return y if x.dtype == torch.float32 else y.to(x.dtype)


def _check_int4(w: Int4Weight) -> None:
    """Raises unless the int4 weight's buffers have the layout :class:`Int4Weight` describes (the kernels
    read them raw)."""
    k, g = w.in_features, w.group_size
    n, groups = w.qweight.shape[0], -(-k // g) if g > 0 else 0
    buffers = ((w.qweight, (n, -(-k // 2)), torch.uint8), (w.scales, (n, groups), torch.float16),
               (w.offsets, (n, groups), torch.float16))  # fmt: skip
    problems = [] if g >= INT4_MIN_GROUP and not g & (g - 1) else [f"{k} inputs in groups of {g}"]
    problems += [
        f"{name} is {t.dtype} {tuple(t.shape)}, not contiguous {dtype} {shape}"
        for name, (t, shape, dtype) in zip(("qweight", "scales", "offsets"), buffers, strict=True)
        if t.dtype != dtype or t.shape != shape or not t.is_contiguous()
    ]
    if problems:
        raise ValueError(
            f"the CPU kernels take int4 weights in groups of a power of two >= {INT4_MIN_GROUP}: " + "; ".join(problems)
        )


class _Int4Probe(NamedTuple):
    qweight: torch.Tensor
    scales: torch.Tensor
    offsets: torch.Tensor
    in_features: int
    group_size: int


def _probe_weights(w: torch.Tensor, gen: torch.Generator) -> list[tuple[str, Weight, torch.Tensor]]:
    """(name, weight as the kernel takes it, the fp32 values it stands for) for every weight format: ``w``'s
    values in fp32, bf16 and int8, and 4-bit values with groups of 32 (two blocks of 16 a group; k not a
    multiple of the group, nor of 16, and odd: the last byte's high nibble is padding) widened as
    :class:`Int4Weight` says."""
    weights: list[tuple[str, Weight, torch.Tensor]] = []
    for dtype in (torch.float32, torch.bfloat16, torch.int8):
        stored = w.to(dtype)
        weights.append((str(dtype), stored, stored.float()))
    n, k, group = w.shape[0], w.shape[1], 32
    values = torch.randint(0, 16, (n, k + k % 2), generator=gen, dtype=torch.uint8)
    values[:, k:] = 0
    scales = (torch.rand(n, -(-k // group), generator=gen) / 8).half()
    offsets = (torch.randn(n, -(-k // group), generator=gen) / 4).half()
    widened = values[:, :k].float() * scales.float().repeat_interleave(group, 1)[:, :k]
    widened = widened + offsets.float().repeat_interleave(group, 1)[:, :k]
    packed = _Int4Probe((values[:, 0::2] | (values[:, 1::2] << 4)).contiguous(), scales, offsets, k, group)
    weights.append(("int4 (group 32)", packed, widened))
    return weights


def _probe(gemm: CpuGemm) -> str | None:
    """Why a kernel disagrees with ``F.linear`` in fp32 on every row count it serves differently and every
    weight format (odd sizes: the K and N tails, several threads, more than one panel of k), or None."""
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(1000, 1051, generator=gen)  # 1000 x 1051 > PARALLEL_MIN_WEIGHTS: the threaded split too
    checks = [("few_rows", gemm.few_rows, m) for m in range(1, gemm.max_rows + 1)]
    checks += [("many_rows", gemm.many_rows, m) for m in (1, 5, 6, 7, 13)]  # groups of 6 and their tails
    for what, stored, values in _probe_weights(w, gen):
        for name, kernel, m in checks:
            x = torch.randn(m, 1051, generator=gen)
            got, want = kernel(x, stored), F.linear(x, values)
            if not torch.allclose(got, want, rtol=1e-4, atol=1e-3):
                error = (got - want).abs().max().item()
                return f"{name} disagrees with F.linear for {m} rows of {what} weights (max error {error:.3g})"
    return None


def native_bf16(cpuinfo: str | None = None) -> bool:
    """Whether this CPU has bf16 arithmetic (x86 ``avx512_bf16`` or ``amx_bf16``, Arm ``bf16``), from
    ``/proc/cpuinfo`` (or the given text; False where it cannot be read). There torch's bf16 GEMM (oneDNN on
    those units) beats the many-rows kernel, which widens bf16 to fp32: 2B gate+up, one thread, on an AMD
    EPYC with ``avx512_bf16``: 24 rows 9.1 ms against 15.9, 256 rows 60 against 130; on one without, torch's
    bf16 GEMM cost about 4.8 ms a row at every row count (256 rows 1243 ms against the kernel's 151).
    A decode step's few rows stay on the few-rows kernel either way (one row 3.5 ms against 4.4)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return False
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return bool({"avx512_bf16", "amx_bf16", "bf16"} & set(value.split()))
    return False


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
    gemm = CpuGemm(load_library(payload, cache), origin, torch_bf16_prefill=native_bf16())
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
    if dtype not in (torch.float32, torch.bfloat16):
        return None, f"{str(dtype).removeprefix('torch.')} weights; the CPU GEMM kernels take fp32 and bf16"
    try:
        return load_cpu_gemm(kernel_dir, cache_dir), ""
    except CpuKernelUnavailable as exc:
        _log.warning("CPU GEMM kernels unavailable, projections use F.linear: %s", exc)
        return None, f"CPU GEMM kernels unavailable: {str(exc).splitlines()[0]}"
