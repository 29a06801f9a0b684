"""The CPU path of the decoder's float projections and LM head: the few-rows GEMM kernel for decode steps,
torch's GEMM on blocks of the weight for a prefill.

Why: on the CPU a decode step is the projections' products with one activation row per sequence of the
batch, bound by reading the weights. torch's ``F.linear`` (MKL's small-M GEMM) reads the weight once per row
on some x86 CPUs: on the AMD EPYC the benchmarks run on, one thread, a 2B-shape gate+up projection
(12288 x 2048, fp32) takes 4.6 ms for one row and 18.7 ms for four, and the tied 151936 x 2048 LM head
59 ms and 256 ms, so batching several requests gains nothing. The few-rows kernel (``kernels/
few_rows_gemm.cpp``, compiled on the machine at startup: ``orin_vlm_node.cpu``) reads each weight block
once for all rows: 4.2 ms and 5.9 ms, 54 ms and 73 ms; it also splits the weight over torch's threads.

Every output is summed in the same order whatever the row count, so a sequence's tokens are bit-identical
alone and in a batch: every decode step goes through the kernel (up to ``KERNEL_ROWS`` rows, the largest
``max_batch``, in pieces of the kernel's ``max_rows``). fp32 and bf16 models on the CPU take the kernel
(bf16 weights are widened in registers and accumulated in fp32, as torch's bf16 GEMM does: one 2B gate+up
row 4.2 ms against torch's 5.4, four rows 6.1 against 20.3). The module keeps the float weight itself
(shared, not copied: a tied head's is the embedding table). No C++ compiler, a compile error or a probe
that disagrees with ``F.linear`` keeps ``F.linear``, with the reason in the log and diagnostics.

More rows (a prefill) take torch's GEMM on blocks of ``BLOCK_ROWS`` weight rows in fp32 (:func:`blocked_linear`)
when the weight is large. Measured on the same CPU, one thread, 2B gate+up: fp32 ``F.linear`` on the whole
weight 46 / 89 / 238 ms for 24 / 64 / 256 rows, on 256-row blocks (2 MB each) 25 / 50 / 178 ms; bf16
``F.linear`` costs about 4.8 ms per row at every row count (1243 ms for 256 rows: this CPU has no bf16
arithmetic), the blocks widened to fp32 188 ms. In fp32 both ways cost the same from about 700 rows on.
A small weight (the default model's) stays one ``F.linear`` call: it fits the cache, and a prefill there is
bound by dispatch.
"""

from __future__ import annotations

import logging
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

log = logging.getLogger("orin_vlm_node.model")


KERNEL_ROWS = 16
"""Rows up to this many go through the kernel: every decode step (``max_batch`` is at most 16), so a batch's
tokens are those each sequence gets alone; measured even with the blocked GEMM at 16 rows (2B gate+up fp32:
26.5 against 21.5 ms at one thread, 20.0 against 21.8 at two; bf16 24.5 against 24.0)."""
BLOCK_ROWS = 256  # weight rows per torch GEMM call of a prefill (2B shapes: 256 beat 64, 128 and 1024)
ONE_CALL_ELEMENTS = 1 << 20  # a weight of at most this many elements (4 MB in fp32) is one F.linear call


def blocked_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``x (m, k) @ w (n, k).T`` in ``x``'s dtype through torch's GEMM, ``BLOCK_ROWS`` weight rows at a time,
    each block widened to fp32 (bf16) and multiplied in fp32: the product torch's bf16 GEMM computes, rounded
    once at the end. A weight of at most ``ONE_CALL_ELEMENTS`` is one ``F.linear`` call."""
    if w.numel() <= ONE_CALL_ELEMENTS:
        return F.linear(x, w)
    wide = x.float()  # (m, k); x itself when it is fp32
    out = torch.empty(x.shape[0], w.shape[0], dtype=torch.float32)  # (m, n)
    for start in range(0, w.shape[0], BLOCK_ROWS):
        block = w[start : start + BLOCK_ROWS]
        torch.matmul(wide, block.float().t(), out=out[:, start : start + block.shape[0]])
    return out.to(x.dtype)


class RowsGemm(Protocol):
    """``x (m, k) @ w (n, k).T`` for 1..``max_rows`` rows (``orin_vlm_node.cpu.FewRowsGemm``)."""

    max_rows: int
    origin: str

    def __call__(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor: ...


class FewRowsLinear(nn.Module):
    """A bias-free projection of a float weight: a decode step's rows through the few-rows GEMM, a prefill's
    through :func:`blocked_linear`."""

    weight = None  # callers use the module (``text.project``); the float weight is ``matrix``

    def __init__(self, weight: nn.Parameter, gemm: RowsGemm) -> None:
        super().__init__()
        self.matrix = weight  # the same Parameter (a tied head's is the embedding table)
        self.gemm = gemm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(L, in) -> (L, out)."""
        rows, step = x.shape[0], self.gemm.max_rows
        if 1 <= rows <= step:
            return self.gemm(x, self.matrix)
        if rows <= KERNEL_ROWS:
            return torch.cat([self.gemm(x[i : i + step], self.matrix) for i in range(0, rows, step)])
        return blocked_linear(x, self.matrix)

    def extra_repr(self) -> str:
        out_features, in_features = self.matrix.shape
        return (
            f"in_features={in_features}, out_features={out_features}, few_rows_gemm<={KERNEL_ROWS} "
            f"(pieces of {self.gemm.max_rows}), blocks of {BLOCK_ROWS} above"
        )


def use_few_rows_gemm(model: nn.Module, gemm: RowsGemm) -> str:
    """Route the decoder's float projections and the LM head through ``gemm``; what was done, for the log
    and diagnostics. The caller (the engine, through ``cpu.few_rows_gemm_for``) checked device and dtype."""
    routed = 0
    for layer in model.language_model.layers:
        for sub, attr in layer.PROJECTIONS:
            parent = getattr(layer, sub)
            module = getattr(parent, attr)
            if module.weight is None:  # a quantized projection has its own path
                continue
            setattr(parent, attr, FewRowsLinear(module.weight, gemm))
            routed += 1
    model.lm_head = FewRowsLinear(model.lm_head.weight, gemm)
    what = (
        f"few-rows GEMM for 1..{KERNEL_ROWS} rows ({routed} projections + LM head; library {gemm.origin}), "
        f"torch's GEMM on {BLOCK_ROWS}-row weight blocks for more"
    )
    log.info("CPU projections: %s", what)
    return what
