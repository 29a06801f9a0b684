"""Quantized projections through ``kernels/quant_gemv.cu``: the decode-time product of 1..8 rows.

:class:`CudaQuantGemv` is what a :class:`~orin_vlm_node.model.quant.QuantizedLinear` calls (its ``kernels``)
when the kernels are loaded: it checks that the call fits a kernel (rows, dtype, layout), allocates the
output and launches on the ``launcher`` (the PyCUDA runtime on torch's stream, so CUDA graphs capture it;
or the CPU harness in the tests). A call that does not fit (a prefill of many rows) goes back to the
module's torch path, which widens the weights for torch's GEMM: with hundreds of rows the product is
compute-bound, the weights are read once either way, and torch's tiled GEMM is the faster one.
"""

from __future__ import annotations

import torch

from . import launch as L


class CudaQuantGemv:
    """INT8 / INT4 weight x activation rows through the GEMV kernels (see module docstring)."""

    max_rows = L.GEMV_ROW_BUCKETS[-1]

    def __init__(self, launcher) -> None:
        self.launcher = launcher

    def fits(self, module, x: torch.Tensor) -> bool:
        """Whether the kernels take ``module``'s product of ``x`` (L, K): 1..max_rows rows of a supported dtype,
        16-byte aligned (every stored format and shape is taken)."""
        return (
            x.dim() == 2
            and 1 <= x.shape[0] <= self.max_rows
            and str(x.dtype).removeprefix("torch.") in L.DTYPE_TAGS
            and x.data_ptr() % 16 == 0
        )

    def __call__(self, module, x: torch.Tensor) -> torch.Tensor:
        """(L, K) -> (L, N) in x's dtype, for a QuantizedLinear ``module`` (its buffers on x's device)."""
        x = x.contiguous()
        rows, n, k = x.shape[0], module.out_features, module.in_features
        if x.shape[1] != k:
            raise ValueError(f"x has {x.shape[1]} columns, the projection takes {k}")
        y = torch.empty((rows, n), dtype=x.dtype, device=x.device)
        cfg = L.gemv_launch(module.mode, rows, n, x.dtype)
        offsets = module.offsets if module.mode == "int4" else None
        self.launcher.launch(cfg, [y, x, module.qweight, module.scales, offsets, rows, n, k, module.group_size])
        return y
