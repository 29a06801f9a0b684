"""The kernels that multiply the decoder's projections and the LM head, chosen for each as it is built.

The loader builds a projection as soon as its checkpoint matrices are in (float, quantized, or kept as stored)
and :meth:`ProjectionBuilder.build` puts the module that multiplies it on this device in its place: the CPU
GEMM kernels (:mod:`.cpu_linear`), the CUDA GEMV kernels for a decode step's rows (:mod:`.gemv_linear`), or
torch. Up to which row count the GEMV kernels beat torch is measured per weight shape over every weight of
that shape, as a decode step walks through them, so it is settled once the last projection is built
(:meth:`ProjectionBuilder.settle`), which also says what was built. When the kernel settings change at
runtime, :func:`rebuild_projections` builds every projection again from its stored weights (no new read).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import nn

from ..model.qwen3_vl import Qwen3VLModel
from .cpu_linear import KERNEL_ROWS, CpuLinear, CpuQuantLinear, RowsGemm, bf16_on_torch, quant_refusal
from .gemv_linear import GemvKernels, GemvLinear
from .quant import QuantizedLinear, quantized_summary
from .sites import projection_sites

log = logging.getLogger("orin_vlm_node.weights")


@dataclass(frozen=True)
class ProjectionKernels:
    """What may multiply projections on this device, chosen once per assembly: the CPU GEMM kernels, the CUDA
    GEMV kernels (float weights only with ``use_cuda_graph``: they are timed as a graph runs them, and a decode
    launched from Python pays the PyCUDA launch on every product, several times torch's), or neither."""

    cpu_gemm: RowsGemm | None = None
    gemv: GemvKernels | None = None
    use_cuda_graph: bool = True
    without_cpu_gemm: str = "no CPU GEMM kernels"  # why float weights take F.linear where no kernel takes them


class ProjectionBuilder:
    """Builds one model's projections with ``kernels``; ``dtype`` is the activations'. :attr:`path` (after
    :meth:`settle`) says how they multiply, for the node's diagnostics."""

    def __init__(self, kernels: ProjectionKernels, dtype: torch.dtype) -> None:
        self.kernels, self.dtype = kernels, dtype
        self._built: list[tuple[nn.Module, nn.Module, bool, bool]] = []  # (stored, built, swiglu, head)
        self.path = ""

    def build(self, stored: nn.Module, swiglu: bool = False, head: bool = False) -> nn.Module:
        """The module that multiplies ``stored`` (the projection as loaded: nn.Linear, FusedLinear or
        QuantizedLinear) on this device; ``swiglu``: the SwiGLU follows its product."""
        gemm, gemv = self.kernels.cpu_gemm, self.kernels.gemv
        quantized = isinstance(stored, QuantizedLinear)
        if quantized:
            stored.kernels = gemv  # the GEMV kernels multiply it in its own forward (None: torch's)
        if gemm is not None and not (quantized and quant_refusal(stored.mode, stored.group_size, gemm)):
            built = CpuQuantLinear(stored, gemm, self.dtype) if quantized else CpuLinear(stored, gemm)
        elif gemv is not None and not quantized and self.kernels.use_cuda_graph:
            built = GemvLinear(stored, gemv, rows=0)  # the rows it takes: measured in settle()
        else:
            built = stored
        self._built.append((stored, built, swiglu, head))
        return built

    def settle(self) -> str:
        """After the last projection: the GEMV kernels timed per weight shape, :attr:`path` said; what the
        kernels took, as logged ('' without kernels)."""
        what = ""
        if self.kernels.gemv is not None:
            what = self._settle_gemv(self.kernels.gemv)
            log.info("CUDA projections: %s", what)
        elif self.kernels.cpu_gemm is not None:
            what = self._cpu_summary(self.kernels.cpu_gemm)
            log.info("CPU projections: %s", what)
        mode = next((s.mode for s, _, _, head in self._built if isinstance(s, QuantizedLinear) and not head), None)
        self.path = f"{mode or 'float weights'}: {what if self.kernels.gemv else self._without_gemv(mode)}"
        return what

    def _without_gemv(self, mode: str | None) -> str:
        """How the projections multiply without the GEMV kernels: the CPU kernels, or torch and why."""
        gemm = self.kernels.cpu_gemm
        if mode is None:
            return self._cpu_summary(gemm) if gemm else f"F.linear ({self.kernels.without_cpu_gemm})"
        refused = quant_refusal(mode, self._group(), gemm) if gemm else ""
        if gemm is None or refused:
            return "torch (weights widened for each product" + (f"; {refused})" if refused else ")")
        return f"CPU GEMM kernels on the stored weights, few rows for 1..{KERNEL_ROWS}, many rows above"

    def _group(self) -> int:
        return next(s.group_size for s, _, _, head in self._built if isinstance(s, QuantizedLinear) and not head)

    def _cpu_summary(self, gemm: RowsGemm) -> str:
        float_count = sum(isinstance(b, CpuLinear) for _, b, _, head in self._built if not head)
        quantized = sum(isinstance(b, CpuQuantLinear) for _, b, _, head in self._built if not head)
        head = next(b for _, b, _, head in self._built if head)
        counts = [f"{float_count} projections"] if float_count else []
        counts += quantized_summary(quantized, head.stored.mode if isinstance(head, CpuQuantLinear) else None)
        counts += [] if isinstance(head, CpuQuantLinear) else ["LM head"]
        above = "torch's GEMM above (this CPU has bf16 arithmetic)" if bf16_on_torch(self.dtype, gemm) else None
        return (
            f"CPU GEMM kernels, few rows for 1..{KERNEL_ROWS}, {above or 'many rows above'} "
            f"({' + '.join(counts)}; library {gemm.origin})"
        )

    def _settle_gemv(self, gemv: GemvKernels) -> str:
        """The float weights' rows timed per shape, the quantized SwiGLUs' per shape; what that gave."""
        by_shape: dict[tuple, list[GemvLinear]] = {}  # (shape, dtype, swiglu) -> the modules: one timing each
        swiglus: dict[tuple[str, str], list[QuantizedLinear]] = {}  # (mode, "NxK + SwiGLU") -> the modules
        for stored, built, swiglu, _ in self._built:
            if isinstance(built, GemvLinear):
                by_shape.setdefault((tuple(built.matrix.shape), built.matrix.dtype, swiglu), []).append(built)
            elif isinstance(stored, QuantizedLinear) and swiglu and self.kernels.use_cuda_graph:
                shape = f"{stored.out_features}x{stored.in_features} + SwiGLU"
                swiglus.setdefault((stored.mode, shape), []).append(stored)
        decided = {key: gemv.faster_rows([m.matrix for m in ms], key[2]) for key, ms in by_shape.items()}
        for key, modules in by_shape.items():
            for module in modules:
                module.rows = decided[key][0]
        quantized = [(s, head) for s, _, _, head in self._built if isinstance(s, QuantizedLinear)]
        head_mode = next((s.mode for s, head in quantized if head), None)
        parts = quantized_summary(sum(not head for _, head in quantized), head_mode)
        parts = [" + ".join(parts)] if parts else []
        parts += [f"{m} {shape}: {gemv.swiglu_rows(ms, self.dtype)[1]}" for (m, shape), ms in swiglus.items()]
        floats = sum(not isinstance(s, QuantizedLinear) for s, _, _, _ in self._built)
        if floats and not self.kernels.use_cuda_graph:
            parts.append(f"float ones: F.linear ({floats}; decode not in CUDA graphs)")
        elif floats:
            routed = sum(len(ms) for key, ms in by_shape.items() if decided[key][0])
            parts.append(f"{routed} of {floats} float ones")
            parts += [f"{n}x{k}{' + SwiGLU' if sw else ''}: {t}" for ((n, k), _, sw), (_, t) in decided.items()]
        return "GEMV kernels for decode rows: " + "; ".join(parts)


def stored_weights(module: nn.Module) -> nn.Module:
    """The projection as loaded behind the module that multiplies it."""
    return module.stored if isinstance(module, (CpuLinear, CpuQuantLinear, GemvLinear)) else module


def rebuild_projections(model: Qwen3VLModel, builder: ProjectionBuilder) -> str:
    """Every projection of ``model`` built again by ``builder`` from its stored weights, then settled; what
    the kernels took (:meth:`ProjectionBuilder.settle`)."""
    for site in projection_sites(model).values():
        built = builder.build(stored_weights(site.module), site.swiglu, site.is_head)
        setattr(site.parent, site.attr, built)
    return builder.settle()
