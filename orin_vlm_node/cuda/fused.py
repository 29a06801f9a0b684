"""The text decoder's elementwise work through fused kernels: ``kernels/rms_norm.cu`` (each RMSNorm with the
residual add before it, and the q/k norms with RoPE, one launch) and ``kernels/silu_mul.cu`` (the SwiGLU
activation, one launch).

At batch 1 on a fast GPU a decode step is bound by its small kernels, not by its weights (measured on an
H200: about 1000 of the 1150 kernels of a 2B token were 1-2 us elementwise ops, about 40 a layer, where
these kernels leave 5). :class:`CudaFusedOps` is what the decoder's modules call (their ``fused``, see
``model.text.attach_fused_ops``) when the kernels are loaded; it launches on the ``launcher`` (the PyCUDA
runtime on torch's stream, so CUDA graphs capture it; the CPU harness in the tests). Each kernel rounds
where torch's separate ops round, so the results are torch's but for the order of one sum.
"""

from __future__ import annotations

import torch

from ..model.rope import TextRopeTables
from . import launch as L


class CudaFusedOps:
    """RMSNorm of rows of heads (optionally with RoPE, or after the residual add), and silu(gate) * up (see
    module docstring)."""

    def __init__(self, launcher) -> None:
        self.launcher = launcher

    def rms_norm(
        self,
        x: torch.Tensor,
        weight_a: torch.Tensor,
        weight_b: torch.Tensor,
        split: int,
        eps: float,
        rope: TextRopeTables | None = None,
    ) -> torch.Tensor:
        """x (L, H, D), heads adjacent (a slice of a projection's heads is fine) -> (L, H, D) contiguous:
        heads below ``split`` normalised with ``weight_a``, the rest with ``weight_b`` (both (D,), x's dtype),
        then rotated by ``rope``'s rows (its (L, 1, D) tables) when given. A plain norm passes (L, 1, D)
        and the same weight twice."""
        if x.dim() != 3 or x.shape[0] < 1:
            raise ValueError(f"rms_norm takes (L, H, D) rows, got {tuple(x.shape)}")
        tokens, heads, dim = x.shape
        if x.stride(2) != 1 or x.stride(1) != dim:
            x = x.contiguous()
        weight_a = self._fit(weight_a, (dim,), x, "weight")
        weights = (weight_a, weight_a if weight_b is weight_a else self._fit(weight_b, (dim,), x, "weight"))
        tables = (
            ()
            if rope is None
            else tuple(self._fit(t, (tokens, 1, dim), x, "rope table") for t in (rope.cos, rope.sin_signed))
        )
        if tables and (dim > L.MAX_ROPE_DIM or dim % 2):
            raise ValueError(f"rms_norm with RoPE takes even rows of at most {L.MAX_ROPE_DIM}, got {dim}")
        out = torch.empty((tokens, heads, dim), dtype=x.dtype, device=x.device)
        cfg = L.rms_norm_launch(tokens * heads, x.dtype, "rms_norm_rope" if tables else "rms_norm")
        self.launcher.launch(cfg, [out, x, *weights, *tables, heads, split, dim, x.stride(0), eps])
        return out

    def add_rms_norm(
        self, x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual add and the norm after it: (x + delta, weight * cast(sum / rms(sum))), both (L, D)."""
        if x.dim() != 2 or delta.shape != x.shape or delta.dtype != x.dtype or x.shape[0] < 1:
            raise ValueError(f"add_rms_norm takes two (L, D) rows alike, got {tuple(x.shape)} and {tuple(delta.shape)}")
        x, delta = x.contiguous(), delta.contiguous()
        weight = self._fit(weight, (x.shape[1],), x, "weight")
        total, out = torch.empty_like(x), torch.empty_like(x)
        cfg = L.rms_norm_launch(x.shape[0], x.dtype, "add_rms_norm")
        self.launcher.launch(cfg, [total, out, x, delta, weight, x.shape[1], eps])
        return total, out

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """(L, 2I) gate columns then up columns -> (L, I) silu(gate) * up."""
        if gate_up.dim() != 2 or gate_up.shape[1] % 2:
            raise ValueError(f"silu_mul takes (L, 2I) rows, got {tuple(gate_up.shape)}")
        gate_up = gate_up.contiguous()
        rows, inter = gate_up.shape[0], gate_up.shape[1] // 2
        out = torch.empty((rows, inter), dtype=gate_up.dtype, device=gate_up.device)
        if rows:
            self.launcher.launch(L.silu_mul_launch(rows, inter, gate_up.dtype), [out, gate_up, rows, inter])
        return out

    @staticmethod
    def _fit(t: torch.Tensor, shape: tuple[int, ...], x: torch.Tensor, what: str) -> torch.Tensor:
        """``t`` as the kernel reads it (contiguous), or ValueError when it does not belong to rows ``x``."""
        if t.shape != shape or t.dtype != x.dtype or t.device != x.device:
            raise ValueError(f"rms_norm {what} {tuple(t.shape)} {t.dtype} does not fit rows {tuple(x.shape)} {x.dtype}")
        return t.contiguous()
