"""Weight-only quantization of the text decoder's projections: INT8 per output channel, INT4 per group.

Why: a decode step at batch 1 reads every weight once per token, so on a Jetson its speed is weight
bytes / memory bandwidth, and the weights are most of what the model takes of the robot's memory. The
activations stay in the model's dtype; only the stored weights shrink (and are widened again in the
product). Embeddings, norms and the vision tower keep the checkpoint dtype.

More in docs/modules.md, ``orin_vlm_node/weights/quant.py``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .pieces import rows_per_piece

WEIGHT_QUANT_MODES = ("none", "int8", "int4")


@dataclass(frozen=True)
class WeightQuant:
    """How the decoder's projection weights are stored."""

    mode: str = "none"  # one of WEIGHT_QUANT_MODES
    group_size: int = 128  # int4: weights per (scale, offset) along the input dimension
    lm_head: bool = True  # with a mode other than none: the LM head stored as LM_HEAD_QUANT

    @property
    def head(self) -> WeightQuant | None:
        """How the LM head is stored when quantized, or None (it keeps the checkpoint dtype)."""
        return LM_HEAD_QUANT if self.mode != "none" and self.lm_head else None

    def check(self, in_features: tuple[int, ...] = ()) -> None:
        """ValueError for an unknown mode or a group size that is not a power of two or is larger than one
        of the projections' input sizes ``in_features``."""
        if self.mode not in WEIGHT_QUANT_MODES:
            raise ValueError(f"weight_quant must be one of {', '.join(WEIGHT_QUANT_MODES)}, got {self.mode!r}")
        if self.mode != "int4":
            return
        g = self.group_size
        if g < 2 or g & (g - 1):
            raise ValueError(f"weight_quant_group_size must be a power of two >= 2, got {g}")
        if in_features and g > min(in_features):
            raise ValueError(
                f"weight_quant_group_size {g} is larger than the smallest projection input ({min(in_features)}): "
                "use a group size that fits every projection"
            )


def unpack_nibbles(data: torch.Tensor) -> torch.Tensor:
    """(..., B) uint8 holding two 4-bit values a byte, the first in the low nibble (the node's INT4 bytes, and the
    bytes of the little-endian int32 words the 4-bit checkpoint formats pack) -> (..., 2 B) uint8, in order."""
    return torch.stack((data & 0xF, data >> 4), dim=-1).flatten(-2)


LM_HEAD_QUANT = WeightQuant("int8")


class QuantizedLinear(nn.Module):
    """A bias-free projection whose weight is stored quantized (module docstring for the formats)."""

    weight = None  # not a plain weight: callers use the module (see ``text.project``)

    def __init__(self, out_features: int, in_features: int, mode: str, group_size: int, device=None) -> None:
        super().__init__()
        self.out_features, self.in_features, self.mode, self.group_size = out_features, in_features, mode, group_size
        # The CUDA GEMV kernels that multiply the stored weight when the engine loaded them
        # (``cuda.gemv.CudaGemv``, set when ``projections.ProjectionBuilder`` builds it); None = torch. On the CPU the
        # builder wraps the module instead (``cpu_linear.CpuQuantLinear``).
        self.kernels = None
        n, k = out_features, in_features
        if mode == "int8":
            self.register_buffer("qweight", torch.empty((n, k), dtype=torch.int8, device=device))
            self.register_buffer("scales", torch.empty(n, dtype=torch.float16, device=device))
            self.offsets = None
        elif mode == "int4":
            groups = -(-k // group_size)
            self.register_buffer("qweight", torch.empty((n, -(-k // 2)), dtype=torch.uint8, device=device))
            self.register_buffer("scales", torch.empty((n, groups), dtype=torch.float16, device=device))
            self.register_buffer("offsets", torch.empty((n, groups), dtype=torch.float16, device=device))
        else:
            raise ValueError(f"cannot store weights as {mode!r}")

    @classmethod
    def from_weight(cls, weight: torch.Tensor, quant: WeightQuant) -> QuantizedLinear:
        """A float (N, K) weight quantized on its device (:meth:`quantize_rows`)."""
        n, k = weight.shape
        module = cls(n, k, quant.mode, quant.group_size, device=weight.device)
        module.quantize_rows(slice(0, n), weight)
        return module

    def quantize_rows(self, rows: slice, weight: torch.Tensor, dtype: torch.dtype | None = None) -> None:
        """Rows ``rows`` of the stored weight from their float values ``weight`` (rows, K), on any device: moved
        to this module's, rounded to ``dtype`` first where given (the values a float model of that dtype holds)
        and quantized, a piece of rows at a time (:mod:`.pieces`). Rows are quantized independently, so pieces
        store what one pass would."""
        device = self.qweight.device
        step = rows_per_piece(device, self.in_features)
        first_row = rows.start or 0
        for first in range(0, weight.shape[0], step):
            piece = weight[first : first + step]
            piece = piece.to(device).to(dtype or piece.dtype)
            self._quantize_piece(piece, slice(first_row + first, first_row + first + piece.shape[0]))

    def _quantize_piece(self, weight: torch.Tensor, rows: slice) -> None:
        """Rows ``rows`` from their float values ``weight`` (rows, K) on this module's device, worked on in
        place in one fp32 copy (a pass over the piece per step, no temporaries of its size besides the result)."""
        n, k = weight.shape
        w = weight.detach().to(torch.float32, copy=True)  # never the caller's tensor (a tied embedding table)
        if self.mode == "int8":
            scale = (w.abs().amax(dim=1) / 127.0).to(torch.float16)  # (n,)
            safe = torch.where(scale > 0, scale.float(), 1.0)
            self.qweight[rows].copy_(w.div_(safe[:, None]).round_().clamp_(-127, 127))  # integral: exact
            self.scales[rows].copy_(scale)
            return
        g, groups = self.group_size, -(-k // self.group_size)
        if groups * g != k:  # the last group's missing weights repeat its last one: its min and max unchanged
            w = torch.cat((w, w[:, -1:].expand(n, groups * g - k)), dim=1)
        grouped = w.view(n, groups, g)
        lo, hi = grouped.amin(dim=2), grouped.amax(dim=2)  # (n, groups); torch.aminmax is 5x slower on the CPU
        offset = lo.to(torch.float16)
        scale = ((hi - offset.float()).clamp_min(0) / 15.0).to(torch.float16)  # fp16 may round lo above hi
        safe = torch.where(scale > 0, scale.float(), 1.0)
        q = grouped.sub_(offset.float()[..., None]).div_(safe[..., None]).round_().clamp_(0, 15)
        q = q.view(n, groups * g)[:, :k].to(torch.uint8)
        if k % 2:
            q = F.pad(q, (0, 1))
        self.qweight[rows].copy_(q[:, 0::2] | (q[:, 1::2] << 4))
        self.scales[rows].copy_(scale)
        self.offsets[rows].copy_(offset)

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        """The (N, K) weight the stored values stand for, in ``dtype``."""
        k = self.in_features
        if self.mode == "int8":
            return self.qweight.to(dtype) * self.scales.to(dtype)[:, None]
        q = unpack_nibbles(self.qweight)[:, :k]  # (N, K) 0..15
        scales = self.scales.repeat_interleave(self.group_size, dim=1)[:, :k]
        offsets = self.offsets.repeat_interleave(self.group_size, dim=1)[:, :k]
        return (q.to(torch.float32) * scales.float() + offsets.float()).to(dtype)

    def kernel_takes(self, x: torch.Tensor) -> bool:
        """Whether the CUDA kernels are attached and multiply ``x`` (L, K) (every format and shape; few rows)."""
        return self.kernels is not None and self.kernels.fits(self, x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(L, K) -> (L, N) in x's dtype: the CUDA kernels when they are loaded and take the call (a decode
        step's few rows); else the torch path, the reference of the CUDA and the CPU kernels: widen the weight,
        one product (INT8 applies its per-row scale after the product, where it factors out). With the kernels
        loaded an INT4 weight is widened by one of them (the same values, one launch)."""
        if self.kernel_takes(x):
            return self.kernels(self, x)
        if self.mode == "int8":
            return F.linear(x, self.qweight.to(x.dtype)) * self.scales.to(x.dtype)
        widened = self.kernels.widen(self, x.dtype) if self.kernels is not None else self.dequantize(x.dtype)
        return F.linear(x, widened)

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers())

    def extra_repr(self) -> str:
        group = f", group_size={self.group_size}" if self.mode == "int4" else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, mode={self.mode}{group}"


def weight_bytes(model: nn.Module) -> int:
    """Bytes of the model's weights as stored: parameters (tied ones once) and the weights modules keep
    outside parameters (quantized: every such module has ``nbytes``)."""
    params = {id(p): p.numel() * p.element_size() for p in model.parameters()}
    stored = sum(m.nbytes for m in model.modules() if getattr(m, "weight", 0) is None and hasattr(m, "nbytes"))
    return sum(params.values()) + stored


def quantized_summary(projections: int, head_mode: str | None) -> list[str]:
    """The quantized part of a weight path's description, as the log and diagnostics show it for the CPU
    and the CUDA paths alike: "N quantized projections" and "<mode> LM head", each when there is one."""
    parts = [f"{projections} quantized projections"] if projections else []
    return parts + ([f"{head_mode} LM head"] if head_mode else [])
