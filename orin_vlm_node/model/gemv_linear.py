"""The GPU path of the decoder's projections and LM head: a decode step's few rows through the GEMV kernels
(``kernels/gemv.cuh``, launched by ``cuda.gemv.CudaGemv``), everything else through torch.

More in docs/modules.md, ``orin_vlm_node/model/gemv_linear.py``.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from .quant import QuantizedLinear, quantized_summary
from .text import takes_swiglu

log = logging.getLogger("orin_vlm_node.model")


class GemvKernels(Protocol):
    """The GEMV kernels (``cuda.gemv.CudaGemv``): the product of a module's weight with a few rows of x."""

    def fits(self, module: nn.Module, x: torch.Tensor) -> bool: ...

    def __call__(self, module: nn.Module, x: torch.Tensor, swiglu: bool = False) -> torch.Tensor:
        """The product (L, N); with ``swiglu`` (a fused gate/up weight) silu(gate) * up, (L, N / 2)."""
        ...

    def widen(self, module: nn.Module, dtype: torch.dtype) -> torch.Tensor:
        """An INT4 QuantizedLinear's weight widened to ``dtype`` (N, K), for the products of more rows than
        :meth:`fits` takes (``QuantizedLinear.forward``): ``module.dequantize(dtype)``'s values, one launch."""
        ...

    def faster_rows(self, weights: Sequence[torch.Tensor], swiglu: bool = False) -> tuple[int, str]:
        """The largest rows bucket up to which the kernel beat torch on ``weights`` (of one shape; 0: never),
        with ``swiglu`` each side followed by the SwiGLU (``text.takes_swiglu``), and the timings that decided
        it, for the log."""
        ...

    def swiglu_rows(self, modules: Sequence[nn.Module], dtype: torch.dtype) -> tuple[int, str]:
        """For quantized fused gate/up projections of one shape: the largest rows bucket up to which the product
        then the ``silu_mul`` kernel beat the SwiGLU in the product's launch (0: never), kept by the kernels for
        the products that follow, and the timings that decided it, for the log."""
        ...


class GemvLinear(nn.Module):
    """A bias-free float projection whose products of 1..``rows`` rows the GEMV kernel computes; more rows
    (a prefill, or a batch the kernel measured slower for) go through ``F.linear``."""

    weight = None  # callers use the module (``text.project``); the float weight is ``matrix``
    mode = "float"  # how the kernels read the weight: stored in the activations' dtype

    def __init__(self, inner: nn.Module, kernels: GemvKernels, rows: int) -> None:
        super().__init__()
        self.inner = inner  # the module as loaded (nn.Linear or FusedLinear): its Parameter, not a copy
        self.kernels = kernels
        self.rows = rows

    @property
    def matrix(self) -> torch.Tensor:
        """The (N, K) weight."""
        return self.inner.weight

    @property
    def out_features(self) -> int:
        return self.inner.weight.shape[0]

    @property
    def in_features(self) -> int:
        return self.inner.weight.shape[1]

    def kernel_takes(self, x: torch.Tensor) -> bool:
        """Whether the kernel multiplies ``x`` (L, K): rows it was measured faster for, in a layout it reads."""
        return x.shape[0] <= self.rows and self.kernels.fits(self, x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(L, K) -> (L, N)."""
        if self.kernel_takes(x):
            return self.kernels(self, x)
        return F.linear(x, self.inner.weight)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, gemv_kernel<={self.rows} rows"


def _timing_key(parent: nn.Module, attr: str) -> tuple:
    """Projections timed together: one weight shape and dtype, and whether the SwiGLU follows the product."""
    weight = getattr(parent, attr).weight
    return tuple(weight.shape), weight.dtype, takes_swiglu(parent, attr)


def _quantized_swiglus(model: nn.Module) -> dict[tuple[str, str], list[QuantizedLinear]]:
    """The quantized gate/up projections (the SwiGLU follows their product) by (mode, "<N>x<K> + SwiGLU"), for
    ``CudaGemv.swiglu_rows``: one timing a shape."""
    found: dict[tuple[str, str], list[QuantizedLinear]] = {}
    for parent, attr in _sites(model):
        module = getattr(parent, attr)
        if isinstance(module, QuantizedLinear) and takes_swiglu(parent, attr):
            shape = f"{module.out_features}x{module.in_features} + SwiGLU"
            found.setdefault((module.mode, shape), []).append(module)
    return found


def _sites(model: nn.Module) -> list[tuple[nn.Module, str]]:
    """(parent, attribute) of every decoder projection and of the LM head."""
    return [*model.language_model.projection_sites(), (model, "lm_head")]


def attach_gemv(model: nn.Module, kernels: GemvKernels | None, use_cuda_graph: bool = True) -> str:
    """Route ``model``'s decoder projections and LM head through ``kernels`` (module docstring), or back to
    torch when None; what was done, for the log and diagnostics ('' when None). Without ``use_cuda_graph`` the
    float weights stay on torch: the kernels are timed as a CUDA graph runs them, and a decode launched from
    Python pays the PyCUDA launch on every product, several times torch's."""
    for parent, attr in _sites(model):
        module = getattr(parent, attr)
        if isinstance(module, GemvLinear):
            setattr(parent, attr, module.inner)
    quantized = [m for m in model.modules() if isinstance(m, QuantizedLinear)]
    for m in quantized:
        m.kernels = kernels
    if kernels is None:
        return ""
    floating = [
        (parent, attr)
        for parent, attr in _sites(model)
        if isinstance(getattr(getattr(parent, attr), "weight", None), torch.Tensor)  # not quantized, not the CPU's
    ]
    targets = floating if use_cuda_graph else []
    by_shape: dict[tuple, list[torch.Tensor]] = {}  # (shape, dtype, swiglu) -> the weights: one timing each
    for parent, attr in targets:
        weight = getattr(parent, attr).weight
        by_shape.setdefault(_timing_key(parent, attr), []).append(weight)
    decided = {key: kernels.faster_rows(weights, key[2]) for key, weights in by_shape.items()}  # -> (rows, timings)
    swiglus = _quantized_swiglus(model) if use_cuda_graph else {}  # timed as a graph runs them, as the float weights
    dtype = model.language_model.embed_tokens.weight.dtype  # the activations' (the embedding keeps the checkpoint's)
    swiglu_timings = [f"{m} {shape}: {kernels.swiglu_rows(ms, dtype)[1]}" for (m, shape), ms in swiglus.items()]
    routed = 0
    for parent, attr in targets:
        module = getattr(parent, attr)
        rows = decided[_timing_key(parent, attr)][0]
        if rows:
            setattr(parent, attr, GemvLinear(module, kernels, rows))
            routed += 1
    head_mode = model.lm_head.mode if isinstance(model.lm_head, QuantizedLinear) else None
    counts = quantized_summary(sum(m is not model.lm_head for m in quantized), head_mode)
    parts = [" + ".join(counts)] if counts else []
    parts += swiglu_timings
    if floating and not use_cuda_graph:
        parts.append(f"float ones: F.linear ({len(floating)}; decode not in CUDA graphs)")
    elif floating:
        parts.append(f"{routed} of {len(floating)} float ones")
        parts += [
            f"{n}x{k}{' + SwiGLU' if swiglu else ''}: {timings}"
            for ((n, k), _, swiglu), (_, timings) in decided.items()
        ]
    what = "GEMV kernels for decode rows: " + "; ".join(parts)
    log.info("CUDA projections: %s", what)
    return what
