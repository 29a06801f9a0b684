"""The CPU path of the decoder's float projections: weights packed once for oneDNN's GEMM.

Why: on the CPU a decode step is the projections' products, and torch's default ``F.linear`` (MKL's
small-M GEMM) is slow on some x86 CPUs: on the AMD EPYC the benchmarks run on, one thread, a 2B-shape
gate+up projection (12288 x 2048, fp32) takes 5.0 ms for one row and 21 ms for four, i.e. four rows cost
four times one and batching several requests gains nothing. The same product with the weight reordered
once into oneDNN's blocked layout takes 5.2 ms for one row and 12.5 ms for four, and a whole 2B-shape
decode step runs 14% faster alone and 1.5x faster for four requests together (bench/README.md).

Only fp32 models on the CPU are packed (bf16/fp16 GEMMs on CPUs without native support are not faster
this way), only the decoder's projections and an untied LM head, and only weights of at least
``MIN_PACKED_WEIGHTS`` elements: oneDNN's call costs about 20 us more than ``F.linear``'s, which a small
model's projections (the embedded default model: 128 x 384) would pay on every token for nothing. The
packed weight replaces the float one, so memory does not grow. A CPU or torch build where the oneDNN op is
missing, fails or disagrees with ``F.linear`` on a probe keeps the float weights, with the reason.

A tied LM head is also the embedding table, which must stay indexable, and packing a copy would double
the largest matrix: it stays a float weight, multiplied as ``W @ x.T`` when a batch brings several rows
(:class:`FewRowsLinear`; a head smaller than ``MIN_PACKED_WEIGHTS`` keeps ``F.linear``, whose one call is
cheaper). MKL's small-M GEMM reads the weight once per row from 2 to 8 rows, and the same
product with the roles swapped (many output rows, few columns) does not: on the 2B's 151936 x 2048 head,
one thread, four rows take 121 ms this way against 256 ms with ``F.linear`` (one row: 57 ms either way).
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

log = logging.getLogger("orin_vlm_node.model")

# Smallest weight packed: 2048 x 2048 (the 2B's o_proj, 0.36 ms a row) gains; 1024 x 1024 (85 us) loses.
MIN_PACKED_WEIGHTS = 2048 * 2048


class PackedLinear(nn.Module):
    """A bias-free projection whose fp32 weight is stored in oneDNN's packed layout (CPU only)."""

    weight = None  # not a plain weight: callers use the module (see ``text.project``)

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        # An opaque oneDNN tensor, not a parameter or buffer: it cannot be indexed, saved or moved, and the
        # engine builds the model again for another device or dtype anyway.
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(L, in) -> (L, out)."""
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, None, "none", [], "")

    @property
    def nbytes(self) -> int:
        return self.in_features * self.out_features * 4

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, packed=onednn"


class FewRowsLinear(nn.Module):
    """A bias-free fp32 projection of a float weight (shared, not copied) computed as ``W @ x.T`` for 2..8
    rows, where MKL's ``x @ W.T`` reads the weight once per row (module docstring)."""

    MAX_ROWS = 8  # beyond it F.linear is as fast or faster (16 rows on a narrow head)

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.weight = weight  # the same Parameter (a tied head's is the embedding table)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(L, in) -> (L, out)."""
        if 2 <= x.shape[0] <= self.MAX_ROWS:
            return torch.mm(self.weight, x.t()).t().contiguous()
        return F.linear(x, self.weight)


def packing_unavailable(device: torch.device, dtype: torch.dtype) -> str | None:
    """Why float projections are not packed here (None: they are): device, dtype, or the op itself."""
    if device.type != "cpu":
        return f"not a CPU ({device.type})"
    if dtype != torch.float32:
        return f"{str(dtype).removeprefix('torch.')} weights (packing pays for fp32)"
    if not torch.backends.mkldnn.is_available():
        return "this torch build has no oneDNN"
    try:
        gen = torch.Generator().manual_seed(0)
        w, x = torch.randn(24, 40, generator=gen), torch.randn(3, 40, generator=gen)
        got = PackedLinear(w)(x)
    except (RuntimeError, AttributeError) as exc:
        return f"oneDNN linear unavailable ({type(exc).__name__}: {exc})"
    if not torch.allclose(got, F.linear(x, w), rtol=1e-4, atol=1e-5):
        return "oneDNN linear disagrees with F.linear on a probe"
    return None


def pack_projections(model: nn.Module, min_weights: int = MIN_PACKED_WEIGHTS) -> str:
    """Replace the decoder's float projections (and an untied LM head) of at least ``min_weights``
    elements by :class:`PackedLinear`, one at a time; what was done, for the log and diagnostics. The
    caller checked :func:`packing_unavailable`."""
    packed = small = 0
    for layer in model.language_model.layers:
        for sub, attr in layer.PROJECTIONS:
            parent = getattr(layer, sub)
            module = getattr(parent, attr)
            if module.weight is None:  # a quantized projection has its own path
                continue
            if module.weight.numel() < min_weights:
                small += 1
                continue
            setattr(parent, attr, PackedLinear(module.weight))
            packed += 1
    head = model.lm_head
    tied = head.weight is model.language_model.embed_tokens.weight
    big_head = head.weight.numel() >= min_weights
    if big_head and tied:
        model.lm_head = FewRowsLinear(head.weight)
    elif big_head:
        model.lm_head = PackedLinear(head.weight)
        packed += 1
    notes = [f"{small} too small to gain"] if small else []
    notes += ["tied LM head as W @ x.T for a batch"] if big_head and tied else []
    what = f"oneDNN-packed fp32 ({packed} projections{''.join('; ' + n for n in notes)})"
    if not packed:
        what = f"F.linear ({'; '.join(notes) or 'nothing to pack'})"
    log.info("CPU projections: %s", what)
    return what
