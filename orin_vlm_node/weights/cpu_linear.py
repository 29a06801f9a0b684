"""The CPU path of the decoder's projections (float or quantized) and LM head: the CPU GEMM kernels, few rows
for a decode step, many rows for a prefill.

Why: on the CPU a decode step is the projections' products with one activation row per sequence of the
batch, bound by reading the weights. torch's ``F.linear`` (MKL's small-M GEMM) reads the weight once per row
on some x86 CPUs: on the AMD EPYC the benchmarks run on, one thread, a 2B-shape gate+up projection
(12288 x 2048, fp32) takes 4.6 ms for one row and 18.7 ms for four, and the tied 151936 x 2048 LM head
59 ms and 256 ms, so batching several requests gains nothing. The few-rows kernel (``kernels/cpu_gemm.cpp``,
compiled on the machine at startup: ``orin_vlm_node.cpu``) reads each weight block once for all rows:
4.2 ms and 5.9 ms, 54 ms and 73 ms; it also splits the weight over torch's threads.

More in docs/modules.md, ``orin_vlm_node/weights/cpu_linear.py``.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from .quant import QuantizedLinear

KERNEL_ROWS = 16
"""Rows up to this many go through the few-rows kernel: every decode step (``max_batch`` is at most 16), so a
batch's tokens are those each sequence gets alone."""
ONE_CALL_ELEMENTS = 1 << 20  # an fp32 weight of at most this many elements (4 MB) is one F.linear call


class RowsProduct(Protocol):
    """One weight bound to the kernels (``orin_vlm_node.cpu.gemm.BoundWeight``): ``x (m, k) @ w (n, k).T``,
    ``few_rows`` for 1..``max_rows`` rows, batch-invariant; ``many_rows`` for any row count."""

    max_rows: int

    def few_rows(self, x: torch.Tensor) -> torch.Tensor: ...

    def many_rows(self, x: torch.Tensor) -> torch.Tensor: ...


class RowsGemm(Protocol):
    """The CPU kernels (``orin_vlm_node.cpu.CpuGemm``): ``bind(w)`` checks a weight once and gives its
    :class:`RowsProduct`. ``w``: an fp32, bf16 or int8 tensor, or an int4 :class:`~.quant.QuantizedLinear` (its
    buffers are the layout the kernels read)."""

    origin: str
    int4_min_group: int  # the smallest int4 group the kernels take
    torch_bf16_prefill: bool  # the CPU multiplies bf16 natively: torch's GEMM for a prefill of bf16 weights

    def bind(self, w: Any) -> RowsProduct: ...


def kernel_product(product: RowsProduct, x: torch.Tensor) -> torch.Tensor:
    """(L, in) -> (L, out): up to ``KERNEL_ROWS`` rows (a decode step) through the few-rows kernel, in pieces
    of its ``max_rows``; more (a prefill) through the many-rows kernel."""
    rows, step = x.shape[0], product.max_rows
    if 1 <= rows <= step:
        return product.few_rows(x)
    if rows <= KERNEL_ROWS:
        return torch.cat([product.few_rows(x[i : i + step]) for i in range(0, rows, step)])
    return product.many_rows(x)


def bf16_on_torch(dtype: torch.dtype, gemm: RowsGemm) -> bool:
    """A bf16 weight on a CPU with bf16 arithmetic: its prefill rows take torch's GEMM."""
    return dtype == torch.bfloat16 and gemm.torch_bf16_prefill


class CpuLinear(nn.Module):
    """A bias-free projection of a float weight: a decode step's rows through the few-rows kernel, a
    prefill's through the many-rows kernel (or ``F.linear`` for a small fp32 weight, and for a bf16 weight
    on a CPU with bf16 arithmetic)."""

    weight = None  # callers use the module (``text.project``); the float weight is ``matrix``

    def __init__(self, stored: nn.Module, gemm: RowsGemm) -> None:
        super().__init__()
        self.stored = stored  # the module as loaded (nn.Linear or FusedLinear): its Parameter, not a copy
        self.matrix = stored.weight  # (N, K); a tied head's is the embedding table
        self.product = gemm.bind(self.matrix)  # checked once here, not on every decode step's call
        small = self.matrix.dtype == torch.float32 and self.matrix.numel() <= ONE_CALL_ELEMENTS
        self.torch_prefill = small or bf16_on_torch(self.matrix.dtype, gemm)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(L, in) -> (L, out)."""
        if self.torch_prefill and x.shape[0] > KERNEL_ROWS:
            return F.linear(x, self.matrix)
        return kernel_product(self.product, x)

    def extra_repr(self) -> str:
        out_features, in_features = self.matrix.shape
        above = "F.linear" if self.torch_prefill else "many_rows_gemm"
        return (
            f"in_features={in_features}, out_features={out_features}, few_rows_gemm<={KERNEL_ROWS} "
            f"(pieces of {self.product.max_rows}), {above} above"
        )


def quant_refusal(mode: str, group_size: int, gemm: RowsGemm) -> str:
    """Why the CPU kernels do not take projections quantized as ``mode`` with ``group_size`` ('' when they
    do): int4 groups smaller than the kernels widen at once stay on the torch path."""
    if mode == "int4" and group_size < gemm.int4_min_group:
        return f"the CPU GEMM kernels take groups of {gemm.int4_min_group} or more, not {group_size}"
    return ""


class CpuQuantLinear(nn.Module):
    """A quantized projection through the CPU kernels: the stored weight widened in registers (the torch path
    widens the whole weight to a float copy for every product: on a 2B-shape gate+up projection, one row and
    one thread, 49 ms in int8 and 304 ms in int4 against 3.6 ms for the fp32 weight in the kernel). INT8
    applies its per-row scale after the product, as the torch path does, with the scales widened once to
    the model's ``dtype`` and applied in place (scaling one row of the default model's 384 outputs: 3.4 us
    with the scales widened on every product, 1.0 us so)."""

    weight = None  # callers use the module (``text.project``); the stored weight is ``stored``

    def __init__(self, stored: QuantizedLinear, gemm: RowsGemm, dtype: torch.dtype) -> None:
        super().__init__()
        self.stored = stored  # a child module: its buffers stay the model's
        self.product = gemm.bind(stored.qweight if stored.mode == "int8" else stored)
        self.scales = stored.scales.to(dtype) if stored.mode == "int8" else None  # (N,)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(L, K) -> (L, N) in the model's dtype (x's)."""
        y = kernel_product(self.product, x)  # a new tensor: scaled in place
        return y.mul_(self.scales) if self.scales is not None else y
