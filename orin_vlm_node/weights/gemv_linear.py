"""The GPU path of the decoder's projections and LM head: a decode step's few rows through the GEMV kernels
(``kernels/gemv.cuh``, launched by ``cuda.gemv.CudaGemv``), everything else through torch.

More in docs/modules.md, ``orin_vlm_node/weights/gemv_linear.py``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn


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

    def __init__(self, stored: nn.Module, kernels: GemvKernels, rows: int) -> None:
        super().__init__()
        self.stored = stored  # the module as loaded (nn.Linear or FusedLinear): its Parameter, not a copy
        self.kernels = kernels
        self.rows = rows

    @property
    def matrix(self) -> torch.Tensor:
        """The (N, K) weight."""
        return self.stored.weight

    @property
    def out_features(self) -> int:
        return self.stored.weight.shape[0]

    @property
    def in_features(self) -> int:
        return self.stored.weight.shape[1]

    def kernel_takes(self, x: torch.Tensor) -> bool:
        """Whether the kernel multiplies ``x`` (L, K): rows it was measured faster for, in a layout it reads."""
        return x.shape[0] <= self.rows and self.kernels.fits(self, x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(L, K) -> (L, N)."""
        if self.kernel_takes(x):
            return self.kernels(self, x)
        return F.linear(x, self.stored.weight)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, gemv_kernel<={self.rows} rows"
