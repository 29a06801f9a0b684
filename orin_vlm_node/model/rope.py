"""Rotary position embeddings of Qwen3-VL: interleaved 3-D M-RoPE (text) and axial 2-D RoPE (vision).

The two differ in ways that are easy to mix up (docs/architecture.md, pitfalls 1 and 3):
- text: one frequency table of ``head_dim/2`` entries; each frequency ``j`` reads the T, H or W position
  stream chosen by ``j % 3`` (interleaved, *not* Qwen2-VL's chunked split); cos/sin are cast to the
  activation dtype and the rotation runs in that dtype;
- vision: ``head_dim/4`` frequencies per axis (row, col of the unmerged patch grid), theta 10000, the
  rotation runs in fp32 and is cast back afterwards.
The float expressions below are written in the same order as transformers' so fp32 results agree bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """[x1, x2] -> [-x2, x1] over the last dim (halves, not pairs)."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def text_inv_freq(head_dim: int, theta: float, device: torch.device | str | None = None) -> torch.Tensor:
    """(head_dim/2,) fp32 inverse frequencies ``theta^(-2j/head_dim)``."""
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim))


def mrope_streams(head_dim: int, mrope_section: tuple[int, int, int], device: torch.device | str | None = None):
    """(head_dim/2,) long: which position stream (0=T, 1=H, 2=W) frequency ``j`` reads.

    H if ``j % 3 == 1 and j < 3*s_h``, W if ``j % 3 == 2 and j < 3*s_w``, else T (so for [24,20,20] the
    tail 60..63 is T).
    """
    j = torch.arange(head_dim // 2, device=device)
    streams = torch.zeros_like(j)
    streams[(j % 3 == 1) & (j < 3 * mrope_section[1])] = 1
    streams[(j % 3 == 2) & (j < 3 * mrope_section[2])] = 2
    return streams


def mrope_cos_sin(
    positions: torch.Tensor, inv_freq: torch.Tensor, streams: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of shape (L, head_dim) in ``dtype`` for 3-D positions (3, L).

    Pure tensor ops on device (no host sync), so decode steps stay CUDA-graph capturable.
    """
    per_freq = positions.to(torch.float32).index_select(0, streams)  # (hd/2, L): the stream of each frequency
    angles = per_freq.transpose(0, 1) * inv_freq  # (L, hd/2), same product as HF's pos.float() * inv_freq
    angles = torch.cat((angles, angles), dim=-1)  # dims d and d + hd/2 share frequency d
    return angles.cos().to(dtype), angles.sin().to(dtype)


@dataclass(frozen=True)
class TextRopeTables:
    """The rotation of one step's tokens, built once per step and shared by every layer.

    ``rotate_half(x) * sin`` equals ``swap_halves(x) * sin_signed`` bit for bit (negating a float is
    exact), and swapping the halves is one op where ``rotate_half`` takes four: on a decode step, where
    every op costs its dispatch, that matters.
    """

    cos: torch.Tensor  # (L, 1, hd) in the activation dtype
    sin_signed: torch.Tensor  # (L, 1, hd): [-sin, sin] of the halves

    @classmethod
    def build(cls, cos: torch.Tensor, sin: torch.Tensor) -> TextRopeTables:
        """From :func:`mrope_cos_sin`'s (L, hd) tables."""
        half = sin.shape[-1] // 2
        return cls(cos.unsqueeze(1), torch.cat((-sin[:, :half], sin[:, half:]), dim=-1).unsqueeze(1))


def swap_halves(x: torch.Tensor) -> torch.Tensor:
    """[x1, x2] -> [x2, x1] over the last dim."""
    return x.unflatten(-1, (2, -1)).flip(-2).flatten(-2)


def apply_text_rope(x: torch.Tensor, tables: TextRopeTables) -> torch.Tensor:
    """Rotate (L, heads, hd) in x's dtype: ``x * cos + rotate_half(x) * sin`` as transformers writes it."""
    return (x * tables.cos) + (swap_halves(x) * tables.sin_signed)


def vision_inv_freq(head_dim: int, theta: float, device: torch.device | str | None = None) -> torch.Tensor:
    """(head_dim/4,) fp32 inverse frequencies of one spatial axis."""
    spatial = head_dim // 2
    return 1.0 / (theta ** (torch.arange(0, spatial, 2, dtype=torch.float32, device=device) / spatial))


def vision_cos_sin(rows_cols: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 cos, sin (N, head_dim) for patch coordinates (N, 2) = (row, col) in the unmerged grid."""
    freqs = rows_cols[..., None].to(torch.float32) * inv_freq  # (N, 2, hd/4)
    cos, sin = freqs.cos(), freqs.sin()
    cos = torch.cat((cos[:, 0], cos[:, 1]), dim=-1)  # (N, hd/2): rows then cols
    sin = torch.cat((sin[:, 0], sin[:, 1]), dim=-1)
    return torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1)


def apply_vision_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate (N, ..., heads, hd) in fp32 with fp32 (N, ..., hd) tables, cast back to x's dtype."""
    xf = x.to(torch.float32)
    cos = cos.unsqueeze(-2)
    sin = sin.unsqueeze(-2)
    return ((xf * cos) + (rotate_half(xf) * sin)).to(x.dtype)
