"""Projections through ``kernels/gemv.cuh``: the decode-time product of 1..8 rows, for float and quantized weights.

:class:`CudaGemv` is what a :class:`~orin_vlm_node.weights.quant.QuantizedLinear` and a
:class:`~orin_vlm_node.weights.gemv_linear.GemvLinear` call (their ``kernels``, see ``weights.projections``)
when the kernels are loaded: it checks that the call fits a kernel (rows, dtype, layout), allocates the output
and launches on the ``launcher`` (the PyCUDA runtime on torch's stream, so CUDA graphs capture it; or the CPU
harness in the tests). A call that does not fit (a prefill of many rows) goes back to the module's torch path:
with hundreds of rows the product is compute-bound, the weights are read once either way, and torch's tiled
GEMM is the faster one.

More in docs/modules.md, ``orin_vlm_node/cuda/gemv.py``.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from . import launch as L
from .fused import CudaFusedOps

TIMING_BYTES = 64 << 20  # weight bytes read per timed graph: enough calls of a small weight to time it
MAX_TIMED = 16  # products in one timed graph at most (and distinct weights walked through)


class CudaGemv:
    """Float, INT8 and INT4 weights x activation rows through the GEMV kernels (see module docstring).

    ``time_us(fn, calls)``: device microseconds of one ``fn()`` (``graph.device_us`` bound to the process's
    capture stream: in a CUDA graph), what :meth:`faster_rows` measures with; None for products only."""

    max_rows = L.GEMV_ROW_BUCKETS[-1]  # rows one launch takes
    # Rows a quantized weight takes, in launches of up to max_rows: every decode batch (max_batch is at most
    # 16). Reading the stored weight once a launch costs less than widening all of it for torch's product,
    # which in a CUDA graph would also keep the widened copy in the graph's memory pool (622 MB for the 2B's
    # LM head).
    max_quantized_rows = 2 * max_rows

    def __init__(self, launcher, time_us: Callable[..., float] | None = None) -> None:
        self.launcher = launcher
        self.time_us = time_us
        self._fused = CudaFusedOps(launcher)  # the silu_mul kernel, after a product without the SwiGLU launch
        # Rows up to which a quantized gate/up weight of a shape runs its product, then the silu_mul kernel, instead
        # of its SwiGLU kernel (measured faster by swiglu_rows); (mode, stored shape, group) -> rows, absent: 0.
        self._swiglu_apart: dict[tuple, int] = {}

    def fits(self, module, x: torch.Tensor) -> bool:
        """Whether the kernels take ``module``'s product of ``x`` (L, K): 1..max_rows rows (max_quantized_rows for
        a quantized weight) of a supported dtype, 16-byte aligned, and for a float weight one in x's dtype
        (every quantized format and shape is taken)."""
        return (
            x.dim() == 2
            and 1 <= x.shape[0] <= (self.max_rows if module.mode == "float" else self.max_quantized_rows)
            and str(x.dtype).removeprefix("torch.") in L.DTYPE_TAGS
            and x.data_ptr() % 16 == 0
            and (module.mode != "float" or _takes_weight(module.matrix, x))
        )

    def __call__(self, module, x: torch.Tensor, swiglu: bool = False) -> torch.Tensor:
        """(L, K) -> (L, N) in x's dtype, for a QuantizedLinear or GemvLinear ``module`` (on x's device); with
        ``swiglu`` (a fused gate/up weight, N even) -> (L, N / 2): silu(gate) * up, in the product's launch or,
        for the rows :meth:`swiglu_rows` measured faster so, the product then the ``silu_mul`` kernel (the same
        roundings: the same bits)."""
        mode, stored, group = _stored(module)
        if swiglu:
            apart = x.shape[0] <= self._swiglu_apart.get(_signature(mode, stored, group), 0)
            return self._swiglu(x, mode, stored, group, apart)
        return self._product(x, mode, stored, group, False)

    def widen(self, module, dtype: torch.dtype) -> torch.Tensor:
        """The (N, K) weight an INT4 QuantizedLinear ``module`` stands for, in ``dtype``, in one launch
        (``kernels/widen_int4.cu``): what ``module.dequantize(dtype)`` gives, to the bit, for the products the
        kernels do not take (a prefill's many rows, torch's GEMM)."""
        if module.mode != "int4":
            raise ValueError(f"widen takes an int4 weight, got {module.mode}")
        n, k = module.out_features, module.in_features
        out = torch.empty((n, k), dtype=dtype, device=module.qweight.device)
        args = [out, module.qweight, module.scales, module.offsets, n, k, module.group_size]
        self.launcher.launch(L.widen_int4_launch(n, k, dtype), args)
        return out

    def _swiglu(self, x: torch.Tensor, mode: str, stored: tuple, group: int, apart: bool) -> torch.Tensor:
        """silu(gate) * up of a fused gate/up weight as stored: in the product's launch, or ``apart``: its plain
        product, then the ``silu_mul`` kernel (the same bits)."""
        if apart:
            return self._fused.silu_mul(self._product(x, mode, stored, group, False))
        return self._product(x, mode, stored, group, True)

    def faster_rows(self, weights: Sequence[torch.Tensor], swiglu: bool = False) -> tuple[int, str]:
        """The largest rows bucket up to which the kernel multiplied float weights of one shape (N, K) faster
        than ``F.linear`` (0: not even one row, or the weights are not ones the kernel reads), each bucket timed
        on both until the kernel loses one; and those timings, for the log. With ``swiglu`` (fused gate/up
        weights) the kernel's SwiGLU launch against ``F.linear`` followed by the ``silu_mul`` kernel.

        Each timed graph walks through ``weights`` (the model's layers of that shape, up to MAX_TIMED), one
        product each, as a decode step does: a weight is not in the GPU's L2 cache when its product starts,
        as in the step (a product timed on one weight again and again would time the L2 cache on a GPU whose
        L2 holds it)."""
        weights = list(weights)[:MAX_TIMED]
        k = weights[0].shape[1]
        x = torch.zeros((self.max_rows, k), dtype=weights[0].dtype, device=weights[0].device)
        if not all(_takes_weight(w, x) for w in weights):
            return 0, f"F.linear ({weights[0].dtype} weights not contiguous and 16-byte aligned)"
        nbytes = weights[0].numel() * weights[0].element_size()

        def contest(rows_x: torch.Tensor) -> tuple[Callable, Callable]:
            turn = itertools.cycle(weights)
            return (
                lambda: self._product(rows_x, "float", (next(turn), None, None), 0, swiglu),
                lambda: self._torch_product(rows_x, next(turn), swiglu),
            )

        rows, timings = self._won_rows(x, _timed_calls(len(weights), nbytes), contest)
        chosen = f"kernel for 1..{rows} rows" if rows else "F.linear"
        return rows, f"{chosen} (kernel vs F.linear: {timings})"

    def swiglu_rows(self, modules: Sequence, dtype: torch.dtype) -> tuple[int, str]:
        """For quantized fused gate/up weights of one shape (``modules``: QuantizedLinear, the model's layers of
        it), activations of ``dtype``: the largest rows bucket up to which their product in a plain launch followed
        by the ``silu_mul`` kernel took less device time than the product with the SwiGLU in its launch (0: never),
        kept for the products that follow (:meth:`__call__`); and the timings, for the log.

        Why both: the SwiGLU launch saves a launch and the 2I-wide product's round trip to memory, but its warps
        read gate and up rows together, and ptxas gives the two kernels different registers (sm_90: 80 against
        72 for INT4, 92 against 72 for INT8; sm_87 the other way round: 72 against 96 and 88), so which holds
        more blocks an SM depends on the GPU (on an H200 the SwiGLU launch won: INT4 8.6 against 10.2 us for the
        2B's gate/up, INT8 11.2 against 11.5). Which one wins is measured, as for the float weights
        (:meth:`faster_rows`, same method: the graph walks through the layers' weights)."""
        modules = list(modules)[:MAX_TIMED]
        mode, stored, group = _stored(modules[0])
        x = torch.zeros((self.max_rows, modules[0].in_features), dtype=dtype, device=stored[0].device)

        def contest(rows_x: torch.Tensor) -> tuple[Callable, Callable]:
            turn = itertools.cycle([_stored(m) for m in modules])
            return lambda: self._swiglu(rows_x, *next(turn), True), lambda: self._swiglu(rows_x, *next(turn), False)

        rows, timings = self._won_rows(x, _timed_calls(len(modules), modules[0].nbytes), contest)
        self._swiglu_apart[_signature(mode, stored, group)] = rows
        chosen = f"product then silu_mul for 1..{rows} rows" if rows else "SwiGLU in the product's launch"
        return rows, f"{chosen} (then silu_mul vs in the launch: {timings})"

    def _won_rows(
        self, x: torch.Tensor, calls: int, contest: Callable[[torch.Tensor], tuple[Callable, Callable]]
    ) -> tuple[int, str]:
        """The largest rows bucket up to which the first of ``contest(rows of x)``'s two ways took less device time
        than the second, each bucket timed on both (``calls`` calls a graph) until the first loses one (0: it lost
        the first); and the timings, for the log."""
        if self.time_us is None:
            raise ValueError("this CudaGemv was built without a timer (time_us): it cannot time weights")
        rows, timings = 0, []
        for bucket in L.GEMV_ROW_BUCKETS:
            first, second = contest(x[:bucket])
            try:
                ours, theirs = self.time_us(first, calls=calls), self.time_us(second, calls=calls)
            except Exception as exc:  # noqa: BLE001 - a product that cannot be timed keeps what was measured
                timings.append(f"{bucket} rows not timed: {type(exc).__name__}: {exc}")
                break
            timings.append(f"{bucket} row{'s' * (bucket > 1)} {ours:.1f} vs {theirs:.1f} us")
            if ours >= theirs:
                break
            rows = bucket
        return rows, ", ".join(timings)

    def _product(self, x: torch.Tensor, mode: str, stored: tuple, group: int, swiglu: bool) -> torch.Tensor:
        """Launch ``gemv_<mode>[_swiglu]`` on x (L, K) and the stored weight (weight or qweight, scales, offsets),
        once for every max_rows rows."""
        x = x.contiguous()
        rows, k = x.shape
        n = stored[0].shape[0]
        expected = k if mode != "int4" else -(-k // 2)
        if stored[0].shape[1] != expected:
            raise ValueError(f"x has {k} columns, the weight is {tuple(stored[0].shape)} ({mode})")
        if swiglu and n % 2:
            raise ValueError(f"a SwiGLU product needs gate and up rows alike, the weight has {n} rows")
        n //= 1 + swiglu
        y = torch.empty((rows, n), dtype=x.dtype, device=x.device)
        for first in range(0, rows, self.max_rows):
            piece = min(self.max_rows, rows - first)
            cfg = L.gemv_launch(mode, piece, n, k, x.dtype, swiglu)
            self.launcher.launch(cfg, [y[first:], x[first:], *stored, piece, n, k, group])
        return y

    def _torch_product(self, x: torch.Tensor, weight: torch.Tensor, swiglu: bool) -> torch.Tensor:
        """What a float product takes without the kernel: ``F.linear``, then the ``silu_mul`` kernel for SwiGLU."""
        y = F.linear(x, weight)
        return self._fused.silu_mul(y) if swiglu else y


def _timed_calls(weights: int, nbytes: int) -> int:
    """Products in one timed graph of ``weights`` distinct weights of ``nbytes`` each: every weight, and enough
    calls of a small one to time it."""
    return max(weights, min(MAX_TIMED, TIMING_BYTES // nbytes))


def _signature(mode: str, stored: tuple, group: int) -> tuple:
    """What a weight's timed decisions are kept by: its format, stored shape and group size."""
    return mode, tuple(stored[0].shape), group


def _stored(module) -> tuple[str, tuple, int]:
    """How a QuantizedLinear or GemvLinear ``module`` stores its weight, as the kernels take it: (mode, (weight or
    qweight, scales, offsets), group size)."""
    if module.mode == "float":
        return "float", (module.matrix, None, None), 0
    offsets = module.offsets if module.mode == "int4" else None
    return module.mode, (module.qweight, module.scales, offsets), module.group_size


def _takes_weight(weight: torch.Tensor, x: torch.Tensor) -> bool:
    """A float weight the kernel reads in place: x's dtype and device, contiguous rows, 16-byte aligned."""
    return (
        weight.dtype == x.dtype and weight.device == x.device and weight.is_contiguous() and weight.data_ptr() % 16 == 0
    )
