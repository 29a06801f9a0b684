"""The CPU path of the decoder's float projections and LM head: the few-rows GEMM kernel for decode steps.

Why: on the CPU a decode step is the projections' products with one activation row per sequence of the
batch, bound by reading the weights. torch's ``F.linear`` (MKL's small-M GEMM) reads the weight once per row
on some x86 CPUs: on the AMD EPYC the benchmarks run on, one thread, a 2B-shape gate+up projection
(12288 x 2048, fp32) takes 4.6 ms for one row and 18.7 ms for four, and the tied 151936 x 2048 LM head
59 ms and 256 ms, so batching several requests gains nothing. The few-rows kernel (``kernels/
few_rows_gemm.cpp``, compiled on the machine at startup: ``orin_vlm_node.cpu``) reads each weight block
once for all rows: 4.2 ms and 5.9 ms, 54 ms and 73 ms; it also splits the weight over torch's threads.

Every output is summed in the same order whatever the row count, so a sequence's tokens are bit-identical
alone and in a batch. fp32 and bf16 models on the CPU take the kernel (bf16 weights are widened in
registers and accumulated in fp32, as torch's bf16 GEMM does: one 2B gate+up row 4.2 ms against torch's
5.4, four rows 6.1 against 20.3), for 1..8 rows (a prefill keeps ``F.linear``: compute-bound, where BLAS
is good). The module keeps the float weight itself (shared, not copied: a tied head's is the embedding
table). No C++ compiler, a compile error or a probe that disagrees with ``F.linear`` keeps ``F.linear``,
with the reason in the log and diagnostics.
"""

from __future__ import annotations

import logging
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

log = logging.getLogger("orin_vlm_node.model")


class RowsGemm(Protocol):
    """``x (m, k) @ w (n, k).T`` for 1..``max_rows`` rows (``orin_vlm_node.cpu.FewRowsGemm``)."""

    max_rows: int
    origin: str

    def __call__(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor: ...


class FewRowsLinear(nn.Module):
    """A bias-free projection of a float weight, through the few-rows GEMM for a decode step's rows."""

    weight = None  # callers use the module (``text.project``); the float weight is ``matrix``

    def __init__(self, weight: nn.Parameter, gemm: RowsGemm) -> None:
        super().__init__()
        self.matrix = weight  # the same Parameter (a tied head's is the embedding table)
        self.gemm = gemm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(L, in) -> (L, out)."""
        if 1 <= x.shape[0] <= self.gemm.max_rows:
            return self.gemm(x, self.matrix)
        return F.linear(x, self.matrix)

    def extra_repr(self) -> str:
        out_features, in_features = self.matrix.shape
        return f"in_features={in_features}, out_features={out_features}, few_rows_gemm<={self.gemm.max_rows}"


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
    what = f"few-rows GEMM for 1..{gemm.max_rows} rows ({routed} projections + LM head; library {gemm.origin})"
    log.info("CPU projections: %s", what)
    return what
