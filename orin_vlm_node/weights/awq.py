"""Checkpoints saved by AutoAWQ in its GEMM layout (``quant_method: awq``, ``version: gemm``): 4-bit weights with
a scale and a zero point per group of inputs, kept as the node's INT4 where ``weight_quant=int4`` asks for it
and the group size is a power of two, widened to the model's dtype otherwise.

Why: AWQ (activation-aware weight quantization) is the 4-bit format most community Qwen-VL releases on the model
hubs use, and what vLLM and llama.cpp's converters read. Its scales were chosen offline with calibration data,
which gives better answers than the round-to-nearest INT4 this node computes at load, and a robot fetches a
quarter of the fp16 bytes. Widening such a checkpoint and quantizing it again would lose both.

Layout of a converted linear ``<module>`` whose weight is (N, K) (N outputs, K inputs), groups of G inputs:

More in docs/modules.md, ``orin_vlm_node/weights/awq.py``.
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

VERSIONS = ("gemm",)  # AutoAWQ's layouts read here
AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of a word holds output 8c + AWQ_PACK_ORDER[i]
# The nibble holding output 8c + j, for j = 0..7: the inverse permutation.
AWQ_NIBBLE_OF = tuple(AWQ_PACK_ORDER.index(j) for j in range(8))
OUTPUTS_PER_WORD = 8
SCALE_DTYPES = ("F16", "BF16", "F32")


@dataclass(frozen=True)
class AwqWeights:
    """How an AutoAWQ GEMM checkpoint's 4-bit weights are stored: ``group_size`` inputs per scale and zero."""

    group_size: int

    @classmethod
    def from_awq_spec(cls, spec: dict[str, Any]) -> AwqWeights:
        """From a ``quant_method: awq`` quantization_config; CheckpointError naming a variant not read."""
        version = str(spec.get("version") or spec.get("format") or "gemm").lower()  # GPTQModel writes "format"
        if version not in VERSIONS:
            raise CheckpointError(
                f"AWQ checkpoint in AutoAWQ's {version!r} layout: this node reads the {', '.join(VERSIONS)} layout "
                "(version gemm, what AutoAWQ saves by default and vLLM serves)"
            )
        bits = spec.get("bits", spec.get("w_bit"))
        if bits != 4:
            raise CheckpointError(f"AWQ checkpoint with {bits!r}-bit weights: 4-bit AWQ weights are read")
        if not spec.get("zero_point", True):
            raise CheckpointError("AWQ checkpoint without zero points (zero_point false): not read")
        size = spec.get("group_size", spec.get("q_group_size"))
        if not positive_int(size):
            raise CheckpointError(f"AWQ quantization_config.group_size must be a positive integer, got {size!r}")
        return cls(size)

    # ---- what the loader reads (the interface integer.IntWeights shares) ---------------------------------

    weight_suffix = ".qweight"
    stored_dtype = "I32"
    ignored_suffixes = ()
    mode = "int4"  # the node's format with as many bits

    @property
    def companions(self) -> dict[str, str]:
        """What :meth:`widen_into` and :meth:`store_into` take beside the weight, by keyword: key suffix."""
        return {"scale": ".scales", "zero_point": ".qzeros"}

    def widener(self, device: torch.device) -> AwqWeights:
        """What widens this checkpoint's weights: the format itself (no work buffers to keep)."""
        return self

    def describe(self) -> str:
        """For logs and diagnostics, e.g. ``int4 (AWQ gemm, with zero points), a scale per group of 128``."""
        return f"int4 (AWQ gemm, with zero points), a scale per group of {self.group_size}"

    def stored_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The stored ``qweight``'s shape for a weight of ``shape`` (N, K): (K, N / 8)."""
        n, k = shape
        return (k, -(-n // OUTPUTS_PER_WORD))

    def problem(
        self, key: str, dtype: str, shape: tuple[int, int], companions: dict[str, tuple[str, tuple[int, ...]] | None]
    ) -> str | None:
        """What is wrong with the stored ``qweight`` ``key`` (safetensors ``dtype``) of a weight of ``shape`` (N, K)
        and its ``companions`` (keyword -> (dtype, shape), None when absent), or None when it can be read."""
        if dtype != self.stored_dtype:
            return f"{key} is {dtype}; AWQ weights are stored as {self.stored_dtype}"
        n, k = shape
        if n % OUTPUTS_PER_WORD or k % 2:
            return f"{key} packs a weight of {n} x {k}; AWQ packs 8 outputs a word (N a multiple of 8), K is even"
        groups = -(-k // self.group_size)
        expected = {"scale": ((groups, n), SCALE_DTYPES), "zero_point": ((groups, n // OUTPUTS_PER_WORD), ("I32",))}
        return companion_problem(key, "AWQ integers", (self.weight_suffix, self.companions), expected, companions)

    # ---- widening and keeping --------------------------------------------------------------------------------

    def keeps(self, quant: WeightQuant | None) -> WeightQuant | None:
        """How a projection to be stored as ``quant`` holds this checkpoint's values unchanged (module docstring),
        or None when they are widened."""
        g = self.group_size
        if quant is None or quant.mode != "int4" or g < 2 or g & (g - 1):
            return None
        return WeightQuant("int4", g, quant.lm_head)

    def widen_into(
        self, out: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor
    ) -> None:
        """``out`` (N, K), in its own dtype, = ``(u - z) * s`` of the stored ``weight`` (module docstring), computed
        in fp32 a few outputs at a time on ``out``'s device."""
        for rows, pairs, z, s in self._pieces(out.shape[0], weight, scale, zero_point, out.device):
            wide = unpack_nibbles(pairs).to(torch.float32)  # (n, K): u
            dequantize_groups_(wide, z.to(torch.float32), s.to(torch.float32), self.group_size)
            out[rows].copy_(wide)

    def store_into(
        self, module: QuantizedLinear, rows: slice, weight: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor
    ) -> None:
        """Rows ``rows`` of ``module`` (stored as :meth:`keeps` said: int4 in groups of ``group_size``) from the
        stored ``weight`` as they are."""
        n = rows.stop - rows.start
        for piece, pairs, z, s in self._pieces(n, weight, scale, zero_point, module.qweight.device):
            at = slice(rows.start + piece.start, rows.start + piece.stop)
            module.qweight[at].copy_(pairs)
            module.scales[at].copy_(s)
            module.offsets[at].copy_(-(z.to(torch.float32) * s.to(torch.float32)))  # w = u * s + offset

    def _pieces(
        self, n: int, weight: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor, device: torch.device
    ) -> Iterator[tuple[slice, torch.Tensor, torch.Tensor, torch.Tensor]]:
        """(output rows, their nibble pairs (rows, K / 2) uint8 in the node's layout (:func:`awq_pairs`),
        z (rows, groups) uint8, s (rows, groups)) of the weight's N outputs, a piece of whole words (8 outputs) and
        about :func:`.pieces.rows_per_piece` weights at a time, on ``device``."""
        k = weight.shape[0]
        step = rows_per_piece(device, k, OUTPUTS_PER_WORD)
        for first in range(0, n, step):
            words = slice(first // OUTPUTS_PER_WORD, (first + step) // OUTPUTS_PER_WORD)  # N is whole words
            pairs = awq_pairs(weight[:, words].to(device))
            z = unpack_awq(zero_point[:, words].to(device)).t()  # (groups, rows) -> (rows, groups)
            s = scale[:, first : first + step].to(device).t()
            yield slice(first, first + pairs.shape[0]), pairs, z, s


LOW_NIBBLES = 0x0F0F0F0F  # the low nibble of each byte of an int32 word
HIGH_NIBBLES = 0xF0F0F0F0 - (1 << 32)  # the high ones, as the int32 they are
# awq_pairs makes two words: byte b of the first pairs nibble position 2b, of the second 2b + 1 (by AWQ_PACK_ORDER:
# outputs 0, 4, 1, 5 and 2, 6, 3, 7). (word, byte) of output j for j = 0..7:
PAIR_BYTE_OF = tuple((p % 2, p // 2) for p in AWQ_NIBBLE_OF)


def awq_pairs(words: torch.Tensor) -> torch.Tensor:
    """AutoAWQ GEMM words (K, W) int32, K even -> the node's INT4 bytes of their 8 W outputs, (8 W, K / 2) uint8:
    byte i of output n holds its input 2i in the low nibble and 2i + 1 in the high one.

    Why not unpack every nibble and pack them again: for the 2B shape that took 7 s of a 10 s load (one thread).
    Here the words are transposed as words (output-major, a quarter of the elements a byte transpose moves), the
    two inputs of a byte come from adjacent words at the same nibble position, so masks and shifts on whole words
    pair them four bytes at a time, and each output's bytes are then gathered once: 65 -> 7.5 ms for a
    6144 x 2048 matrix."""
    w = words.shape[1]
    rows = words.t().contiguous()  # (W, K): word c of every input
    lo, hi = rows[:, 0::2], rows[:, 1::2]  # (W, K / 2): inputs 2i and 2i + 1
    even = (lo & LOW_NIBBLES) | ((hi & LOW_NIBBLES) << 4)  # byte b: nibble position 2b of both
    odd = ((lo >> 4) & LOW_NIBBLES) | (hi & HIGH_NIBBLES)  # byte b: position 2b + 1
    pieces = [t.view(torch.uint8).view(w, -1, 4) for t in (even, odd)]  # (W, K / 2, 4 bytes)
    planes = [pieces[word][..., byte] for word, byte in PAIR_BYTE_OF]  # output 8c + j of every word c: (W, K / 2)
    return torch.stack(planes, dim=1).view(w * OUTPUTS_PER_WORD, -1)  # (W, 8, K / 2) -> (N, K / 2)


def unpack_awq(words: torch.Tensor) -> torch.Tensor:
    """AutoAWQ GEMM words (R, W) int32 -> their values (R, 8 W) uint8 in output order (module docstring). Words are
    read as little-endian bytes (x86, Arm): byte b of a word holds nibbles 2b (low half) and 2b + 1 (high)."""
    r, w = words.shape
    data = words.contiguous().view(torch.uint8).view(r, w, 4)
    nibbles = unpack_nibbles(data)  # (R, W, 8): nibble i at index i
    return nibbles[..., list(AWQ_NIBBLE_OF)].reshape(r, w * OUTPUTS_PER_WORD)
