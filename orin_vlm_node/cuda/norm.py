"""RMSNorm through ``kernels/rms_norm.cu``: one launch per norm where torch runs about eight small kernels.

At batch 1 on a fast GPU a decode step is bound by its small kernels, not by its weights (measured on an
H200: about 1000 of the 1150 kernels of a 2B token were 1-2 us elementwise ops, a third of them the norms).
:class:`CudaRmsNorm` is what the text decoder's :class:`~orin_vlm_node.model.text.RMSNorm` modules call (their
``kernel``) when the kernels are loaded; it launches on the ``launcher`` (the PyCUDA runtime on torch's
stream, so CUDA graphs capture it; the CPU harness in the tests).
"""

from __future__ import annotations

import torch

from . import launch as L


class CudaRmsNorm:
    """``weight * cast(x / rms(x))`` over the last dim of rows of heads (see ``kernels/rms_norm.cu``)."""

    def __init__(self, launcher) -> None:
        self.launcher = launcher

    def __call__(
        self, x: torch.Tensor, weight_a: torch.Tensor, weight_b: torch.Tensor, split: int, eps: float
    ) -> torch.Tensor:
        """x (L, H, D), heads adjacent (a slice of a projection's heads is fine) -> (L, H, D) contiguous:
        heads below ``split`` normalised with ``weight_a``, the rest with ``weight_b`` (both (D,), x's dtype).
        A plain norm passes (L, 1, D) and the same weight twice."""
        if x.dim() != 3 or x.shape[0] < 1:
            raise ValueError(f"rms_norm takes (L, H, D) rows, got {tuple(x.shape)}")
        tokens, heads, dim = x.shape
        if x.stride(2) != 1 or x.stride(1) != dim:
            x = x.contiguous()
        for w in (weight_a, weight_b):
            if w.shape != (dim,) or w.dtype != x.dtype or w.device != x.device or not w.is_contiguous():
                raise ValueError(f"rms_norm weight {tuple(w.shape)} {w.dtype} does not fit rows of {dim} {x.dtype}")
        out = torch.empty((tokens, heads, dim), dtype=x.dtype, device=x.device)
        cfg = L.rms_norm_launch(tokens * heads, x.dtype)
        self.launcher.launch(cfg, [out, x, weight_a, weight_b, heads, split, dim, x.stride(0), eps])
        return out
