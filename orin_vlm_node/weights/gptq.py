"""Checkpoints saved in GPTQ's own format (``quant_method: gptq``, as AutoGPTQ, GPTQModel and optimum write
them): 4-bit weights with a scale and a zero point per group of inputs, kept as the node's INT4 where
``weight_quant=int4`` asks for it and the groups map onto its groups, widened to the model's dtype otherwise.

Why: GPTQ (error-feedback quantization with calibration data) is, with AWQ, the 4-bit format model hubs
publish most, and the one transformers loads through optimum. Widening such a checkpoint and quantizing it again
would lose the calibration and hold four times the bytes the robot downloaded.

Layout of a converted linear ``<module>`` whose weight is (N, K) (N outputs, K inputs), groups of G inputs:

More in docs/modules.md, ``orin_vlm_node/weights/gptq.py``.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from ..model.errors import CheckpointError
from .fp8 import positive_int
from .integer import companion_problem, dequantize_groups_
from .pieces import rows_per_piece
from .quant import QuantizedLinear, WeightQuant, unpack_nibbles

FORMATS = ("gptq", "gptq_v2")  # checkpoint_format values read: v1 (zero points stored minus one) and v2
VALUES_PER_WORD = 8
V1_ZERO_OFFSET = 0x11111111  # what a v1 qzeros word lacks: one in each of its eight 4-bit fields
SCALE_DTYPES = ("F16", "BF16", "F32")


@dataclass(frozen=True)
class GptqWeights:
    """How a GPTQ checkpoint's 4-bit weights are stored: ``group_size`` inputs per scale and zero (None: one group
    a row), whether groups follow an activation order (``desc_act``), whether it is ``symmetric``, and whether its
    zero points are stored minus one (``v1``)."""

    group_size: int | None
    desc_act: bool
    symmetric: bool
    v1: bool

    @classmethod
    def from_gptq_spec(cls, spec: dict[str, Any]) -> GptqWeights:
        """From a ``quant_method: gptq`` quantization_config; CheckpointError naming a variant not read."""
        fmt = spec.get("checkpoint_format") or spec.get("format") or "gptq"
        if fmt not in FORMATS:
            raise CheckpointError(
                f"GPTQ checkpoint in the {fmt!r} format: this node reads checkpoint_format {' and '.join(FORMATS)}"
            )
        bits = spec.get("bits")
        if bits != 4:
            raise CheckpointError(f"GPTQ checkpoint with {bits!r}-bit weights: 4-bit GPTQ weights are read")
        size = spec.get("group_size", 128)
        if size != -1 and not positive_int(size):
            raise CheckpointError(f"GPTQ quantization_config.group_size must be a positive integer or -1, got {size!r}")
        return cls(None if size == -1 else size, bool(spec.get("desc_act", False)), bool(spec.get("sym", True)),
                   fmt == "gptq")  # fmt: skip

    # ---- what the loader reads (the interface integer.IntWeights shares) ---------------------------------

    weight_suffix = ".qweight"
    stored_dtype = "I32"
    ignored_suffixes = ()
    mode = "int4"  # the node's format with as many bits

    @property
    def companions(self) -> dict[str, str]:
        """What :meth:`widen_into` and :meth:`store_into` take beside the weight, by keyword: key suffix."""
        return {"scale": ".scales", "zero_point": ".qzeros", "g_idx": ".g_idx"}

    def widener(self, device: torch.device) -> GptqWeights:
        """What widens this checkpoint's weights: the format itself (no work buffers to keep)."""
        return self

    def describe(self) -> str:
        """For logs and diagnostics, e.g. ``int4 (GPTQ, symmetric), a scale per group of 128``."""
        kind = ("symmetric" if self.symmetric else "with zero points") + (", activation order" if self.desc_act else "")
        per = f"group of {self.group_size}" if self.group_size else "output channel"
        return f"int4 (GPTQ, {kind}), a scale per {per}"

    def stored_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The stored ``qweight``'s shape for a weight of ``shape`` (N, K): (K / 8, N)."""
        n, k = shape
        return (-(-k // VALUES_PER_WORD), n)

    def problem(
        self, key: str, dtype: str, shape: tuple[int, int], companions: dict[str, tuple[str, tuple[int, ...]] | None]
    ) -> str | None:
        """What is wrong with the stored ``qweight`` ``key`` (safetensors ``dtype``) of a weight of ``shape`` (N, K)
        and its ``companions`` (keyword -> (dtype, shape), None when absent), or None when it can be read."""
        if dtype != self.stored_dtype:
            return f"{key} is {dtype}; GPTQ weights are stored as {self.stored_dtype}"
        n, k = shape
        if n % VALUES_PER_WORD or k % VALUES_PER_WORD:
            return f"{key} packs a weight of {n} x {k}; GPTQ packs 8 values a word, so N and K must be multiples of 8"
        groups = self._groups(k)
        expected = {
            "scale": ((groups, n), SCALE_DTYPES),
            "zero_point": ((groups, n // VALUES_PER_WORD), ("I32",)),
            "g_idx": ((k,), ("I32", "I64")),
        }
        # Consecutive groups need no index (some exporters leave it out).
        optional = frozenset() if self.desc_act else frozenset({"g_idx"})
        suffixes = (self.weight_suffix, self.companions)
        return companion_problem(key, "GPTQ integers", suffixes, expected, companions, optional)

    # ---- widening and keeping --------------------------------------------------------------------------------

    def keeps(self, quant: WeightQuant | None) -> WeightQuant | None:
        """How a projection to be stored as ``quant`` holds this checkpoint's values unchanged (module docstring),
        or None when they are widened."""
        if quant is None or quant.mode != "int4" or self.desc_act:
            return None
        g = self.group_size
        if g is None:
            return quant  # one scale a row, repeated over the node's groups
        return WeightQuant("int4", g, quant.lm_head) if g >= 2 and not g & (g - 1) else None

    def widen_into(
        self,
        out: torch.Tensor,
        weight: torch.Tensor,
        scale: torch.Tensor,
        zero_point: torch.Tensor,
        g_idx: torch.Tensor | None = None,
    ) -> None:
        """``out`` (N, K), in its own dtype, = ``(u - z) * s`` of the stored ``weight`` (module docstring), computed
        in fp32 a few outputs at a time on ``out``'s device; without ``g_idx``, groups of consecutive inputs."""
        k = out.shape[1]
        groups = self._consecutive(k, out.device) if g_idx is None else g_idx.to(out.device, torch.long)
        consecutive = g_idx is None or torch.equal(groups, self._consecutive(k, out.device))
        if not consecutive and (int(groups.min()) < 0 or int(groups.max()) >= scale.shape[0]):
            raise CheckpointError(
                f"a GPTQ g_idx names groups {int(groups.min())}..{int(groups.max())}; its scales have "
                f"{scale.shape[0]} groups"
            )
        for rows, words, z, s in self._pieces(out.shape[0], weight, scale, zero_point, out.device):
            wide = unpack_gptq_weight(words, k).to(torch.float32)  # (rows, K)
            z, s = z.to(torch.float32), s.to(torch.float32)
            if consecutive:
                width = self.group_size or k
                dequantize_groups_(wide, z, s, width)
            else:  # activation order: each input's group looked up
                wide.sub_(z[:, groups]).mul_(s[:, groups])
            out[rows].copy_(wide)

    def store_into(
        self,
        module: QuantizedLinear,
        rows: slice,
        weight: torch.Tensor,
        scale: torch.Tensor,
        zero_point: torch.Tensor,
        g_idx: torch.Tensor | None = None,
    ) -> None:
        """Rows ``rows`` of ``module`` (stored as :meth:`keeps` said) from the stored ``weight`` as they are;
        CheckpointError when ``g_idx`` is not the consecutive groups that ``desc_act: false`` promises."""
        device, k = module.qweight.device, module.in_features
        if g_idx is not None and not torch.equal(g_idx.to(device, torch.long), self._consecutive(k, device)):
            raise CheckpointError(
                "a GPTQ g_idx does not hold consecutive groups of group_size inputs although quantization_config "
                "says desc_act false: the checkpoint contradicts its config"
            )
        n = rows.stop - rows.start
        for piece, words, z, s in self._pieces(n, weight, scale, zero_point, device):
            at = slice(rows.start + piece.start, rows.start + piece.stop)
            module.qweight[at].copy_(words.contiguous().view(torch.uint8))  # (rows, K / 2): the words' bytes
            if self.group_size is None:  # one scale a row, repeated over the node's groups
                z, s = z.expand(-1, module.scales.shape[1]), s.expand(-1, module.scales.shape[1])
            module.scales[at].copy_(s)
            module.offsets[at].copy_(-(z.to(torch.float32) * s.to(torch.float32)))  # w = u * s + offset

    def _pieces(
        self, n: int, weight: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor, device: torch.device
    ) -> Iterator[tuple[slice, torch.Tensor, torch.Tensor, torch.Tensor]]:
        """(output rows, their qweight words (rows, K / 8) int32, z (rows, groups) int16, s (rows, groups)) of the
        weight's N outputs, a piece of a whole number of qzeros words (8 outputs) at a time (:mod:`.pieces`), on
        ``device``."""
        k = weight.shape[0] * VALUES_PER_WORD
        step = rows_per_piece(device, k, VALUES_PER_WORD)
        for first in range(0, n, step):
            last = min(n, first + step)
            words = weight[:, first:last].to(device).t()  # (rows, K / 8)
            z = unpack_gptq_zeros(zero_point[:, first // VALUES_PER_WORD : last // VALUES_PER_WORD].to(device), self.v1)
            yield slice(first, last), words, z.t(), scale[:, first:last].to(device).t()

    def _groups(self, k: int) -> int:
        return -(-k // self.group_size) if self.group_size else 1

    def _consecutive(self, k: int, device: torch.device) -> torch.Tensor:
        """The g_idx of groups of consecutive inputs: k // group_size (0 everywhere for one group a row)."""
        return torch.arange(k, device=device) // (self.group_size or k)


def unpack_gptq_weight(words: torch.Tensor, k: int) -> torch.Tensor:
    """qweight words (rows, K / 8) int32, one output's inputs 8r .. 8r + 7 a word -> u (rows, K) uint8. Words are
    read as little-endian bytes (x86, Arm): byte b of a word holds inputs 2b (low half) and 2b + 1 (high)."""
    data = words.contiguous().view(torch.uint8)  # (rows, K / 2)
    return unpack_nibbles(data)[:, :k]


def unpack_gptq_zeros(words: torch.Tensor, v1: bool) -> torch.Tensor:
    """qzeros words (groups, N / 8) int32 -> z (groups, N) int16, outputs in order; ``v1`` words get the one in
    every field back that the original format subtracted from the whole word (module docstring)."""
    if v1:  # modulo 2^32, as the int32 the words are
        wide = (words.to(torch.int64) + V1_ZERO_OFFSET) & 0xFFFFFFFF
        words = torch.where(wide >= 1 << 31, wide - (1 << 32), wide).to(torch.int32)
    data = words.contiguous().view(torch.uint8)  # (groups, N / 2): byte b holds outputs 2b and 2b + 1
    return unpack_nibbles(data).to(torch.int16)
