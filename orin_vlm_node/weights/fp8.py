"""Checkpoints whose linear weights are stored in FP8 with scales, widened to the model's dtype on load.

Why: Qwen publishes Qwen3-VL in FP8 beside bf16 (the ``-FP8`` model repositories), and llm-compressor's
``FP8_DYNAMIC`` checkpoints (e.g. RedHatAI's) are the other common FP8 release, at about half the download
and disk size -- what a robot with a small eMMC and a slow uplink wants to fetch. A Jetson Orin (sm_87) has
no FP8 arithmetic, so each weight is widened to the model's dtype as it streams in; with ``weight_quant``
the decoder projections are then stored as INT8/INT4 from the widened values, as from any float checkpoint.

More in docs/modules.md, ``orin_vlm_node/weights/fp8.py``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ..model.errors import CheckpointError
from .pieces import rows_per_piece

ACTIVATION_SCALE_SUFFIXES = (".input_scale", ".activation_scale")
WEIGHT_DTYPE = "F8_E4M3"  # safetensors' name for float8_e4m3fn
SCALE_DTYPES = ("F32", "BF16", "F16", "F8_E8M0")
STRATEGIES = ("tensor", "channel", "group", "block")


@dataclass(frozen=True)
class Fp8Weights:
    """How a checkpoint's FP8 weights are scaled: which ``strategy`` (one of STRATEGIES), the block a scale
    covers where that is fixed (``block``: (rows, columns); group: (1, group size)), and the key suffix of a
    weight's scale (``"_scale_inv"``: ``<module>.weight_scale_inv``)."""

    strategy: str
    block: tuple[int, int] | None
    scale_suffix: str

    @classmethod
    def from_fp8_spec(cls, spec: dict[str, Any]) -> Fp8Weights:
        """From a ``quant_method: fp8`` quantization_config; CheckpointError for a variant not read here."""
        fmt = spec.get("fmt", "e4m3")
        if fmt != "e4m3":
            raise CheckpointError(f"FP8 checkpoint with fmt {fmt!r}: only e4m3 weights are read")
        block = spec.get("weight_block_size")
        if block is None:
            return cls("tensor", None, "_scale_inv")
        return cls("block", _block(block, "quantization_config.weight_block_size"), "_scale_inv")

    @classmethod
    def from_compressed_tensors(cls, weights: dict[str, Any]) -> Fp8Weights:
        """From a compressed-tensors config group's ``weights`` (8-bit float, saved float-quantized);
        CheckpointError naming what is not read."""
        if not weights.get("symmetric", True):
            raise CheckpointError("compressed-tensors FP8 weights with zero points (asymmetric): not read")
        strategy = weights.get("strategy")
        if strategy == "block":
            return cls("block", _block(weights.get("block_structure"), "weights.block_structure"), "_scale")
        if strategy == "group":
            size = weights.get("group_size")
            if not positive_int(size):
                raise CheckpointError(f"weights.group_size must be a positive integer, got {size!r}")
            return cls("group", (1, size), "_scale")
        if strategy in ("tensor", "channel"):
            return cls(strategy, None, "_scale")
        raise CheckpointError(f"compressed-tensors FP8 weights with strategy {strategy!r}: {', '.join(STRATEGIES)}")

    # ---- what the loader reads (the interface integer.IntWeights shares) ---------------------------------

    weight_suffix = ".weight"  # a converted module's weight is <module>.weight, float8_e4m3fn
    stored_dtype = WEIGHT_DTYPE
    ignored_suffixes = ACTIVATION_SCALE_SUFFIXES

    @property
    def companions(self) -> dict[str, str]:
        """What :meth:`Fp8Widener.widen_into` takes beside the weight, by keyword: key suffix."""
        return {"scale": ".weight" + self.scale_suffix}

    def stored_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        return shape

    def keeps(self, quant) -> None:
        """FP8 weights are always widened (an Orin has no FP8 arithmetic)."""
        return None

    def widener(self, device: torch.device) -> Fp8Widener:
        return Fp8Widener(self, device)

    def describe(self) -> str:
        """For logs and diagnostics, e.g. ``fp8 e4m3, a scale per 128x128 block``."""
        per = {"tensor": "tensor", "channel": "output channel"}.get(self.strategy)
        if per is None:
            bn, bk = self.covered((0, 0))  # group and block: the block they carry
            per = f"group of {bk}" if self.strategy == "group" else f"{bn}x{bk} block"
        return f"fp8 e4m3, a scale per {per}"

    def scale_key(self, weight_key: str) -> str:
        return weight_key + self.scale_suffix

    def covered(self, shape: tuple[int, int]) -> tuple[int, int]:
        """(rows, columns) one scale covers in a weight of ``shape`` (N, K)."""
        n, k = shape
        if self.strategy == "tensor":
            return n, k
        if self.strategy == "channel":
            return 1, k
        assert self.block is not None  # group and block strategies always carry one
        return self.block

    def grid(self, shape: tuple[int, int]) -> tuple[int, int]:
        """The shape of the scales of a weight of ``shape`` (N, K)."""
        bn, bk = self.covered(shape)
        return -(-shape[0] // bn), -(-shape[1] // bk)

    def problem(
        self, key: str, dtype: str, shape: tuple[int, ...], companions: dict[str, tuple[str, tuple[int, ...]] | None]
    ) -> str | None:
        """What is wrong with the FP8 tensor ``key`` (safetensors ``dtype``) of a parameter of ``shape`` and its
        ``companions`` (``scale``: (dtype, shape), None when absent), or None when it can be widened."""
        if dtype != WEIGHT_DTYPE:
            return f"{key} is {dtype}; FP8 weights are read as {WEIGHT_DTYPE}"
        if len(shape) != 2:
            return f"{key} is FP8 with shape {list(shape)}; only 2-D linear weights are read as FP8"
        scale = companions.get("scale")
        if scale is None:
            return f"{key} is FP8 but the checkpoint has no {self.scale_key(key)}"
        scale_dtype, scale_shape = scale
        if scale_dtype not in SCALE_DTYPES:
            return f"{self.scale_key(key)} is {scale_dtype}; scales are read as {', '.join(SCALE_DTYPES)}"
        grid = self.grid((shape[0], shape[1]))
        kept = [d for d in scale_shape if d != 1]  # (N,) for (N, 1) and () for (1, 1) are the same scales
        if len(scale_shape) <= 2 and kept == [d for d in grid if d != 1]:
            return None
        return f"{self.scale_key(key)} has shape {list(scale_shape)}, expected {list(grid)}"

    def blocks(self, scale: torch.Tensor, shape: tuple[int, int]) -> tuple[torch.Tensor, int, int]:
        """(scales as a (rows, columns) grid, rows a scale covers, columns a scale covers) for a weight of
        ``shape``; one scale for the tensor is a column of N equal scales (a view), so that pieces of a few
        rows stay the unit of work."""
        if self.strategy == "tensor":
            return scale.reshape(1, 1).expand(shape[0], 1), 1, shape[1]
        return scale.reshape(self.grid(shape)), *self.covered(shape)


def positive_int(value: Any) -> bool:
    """Whether a config.json value is a positive integer (JSON's true is not one)."""
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _block(value: Any, where: str) -> tuple[int, int]:
    if not (isinstance(value, (list, tuple)) and len(value) == 2 and all(map(positive_int, value))):
        raise CheckpointError(f"{where} must be two positive integers, got {value!r}")
    return value[0], value[1]


class Fp8Widener:
    """Widens the FP8 weights of one checkpoint load into their parameters, on ``device``.

    ``out = q * s`` is computed in fp32 (an e4m3 value is exact in fp32) and rounded once to ``out``'s dtype.
    That is what transformers loads from the same files: it widens fine-grained FP8 the same way, and
    compressed-tensors weights in their scales' dtype, which gives the same values when the model runs in
    that dtype (a bf16 scale's product with an e4m3 value is exact in fp32, so both round once) and less
    exact ones otherwise. On the target device (the one byte a weight
    travels, not four) and a piece of rows at a time (:mod:`.pieces`), in two work buffers reused from piece to
    piece and dropped with the widener (96 MB at most on CUDA, next to the 8B's largest matrices of 50M weights).

    Why not ``q.to(torch.float32)``: torch converts FP8 on the CPU one element at a time (4.6 ns a weight on
    the development VM), and every fresh piece of memory pays its page faults; together about 70 ms a
    6144 x 2048 matrix, 12 s more than a bf16 load of the 2B. Here the byte's bits are moved into an fp16's
    place instead (:meth:`_as_fp16`) and every step runs in place: 15 ms.
    """

    def __init__(self, stored: Fp8Weights, device: torch.device) -> None:
        self.stored, self.device = stored, device
        self._bits: torch.Tensor | None = None  # int16 work buffer
        self._wide: torch.Tensor | None = None  # fp32 work buffer, as many elements

    def widen_into(self, out: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> None:
        """``out`` (N, K), in its own dtype, = the FP8 ``weight`` (N, K) times its ``scale`` (module docstring)."""
        n, k = weight.shape
        grid, bn, bk = self.stored.blocks(scale.to(self.device, torch.float32) * 256.0, (n, k))  # _as_fp16: / 2^8
        step = rows_per_piece(self.device, k, bn)  # whole block rows
        for first in range(0, n, step):
            rows = min(step, n - first)
            wide = self._as_fp16(weight[first : first + rows], rows * k)  # (rows, K) fp32, the values / 2^8
            apply_blockwise_(wide, grid[first // bn : -(-(first + rows) // bn)], bn, bk, torch.Tensor.mul_)
            out[first : first + rows].copy_(wide)

    def _as_fp16(self, weight: torch.Tensor, count: int) -> torch.Tensor:
        """The e4m3 ``weight`` (r, K) as fp32 values 2^-8 times theirs, in the work buffer.

        An e4m3 byte ``s eeee mmm`` (exponent bias 7) moved to the fp16 bits ``s 0eeee mmm0000000``
        (exponent bias 15) is the same significand with an exponent 8 lower, subnormals included (both
        formats' subnormals have the smallest normal exponent): one shift left by 8, an arithmetic shift
        right by 1, and the copied sign bit cleared. NaN (``s 1111 111``) would read as 480: weights hold none.
        """
        if self._bits is None or self._bits.numel() < count:
            self._bits = torch.empty(count, dtype=torch.int16, device=self.device)
            self._wide = torch.empty(count, dtype=torch.float32, device=self.device)
        bits = self._bits[:count].view(weight.shape)
        wide = self._wide[:count].view(weight.shape)
        bits.copy_(weight.view(torch.uint8))
        bits.__ilshift__(8).__irshift__(1).bitwise_and_(-0x4001)  # 0xBFFF as int16: all but bit 14
        return wide.copy_(bits.view(torch.float16))


def apply_blockwise_(wide: torch.Tensor, grid: torch.Tensor, bn: int, bk: int, op: Callable) -> None:
    """``op(wide_block, value)`` in place (``torch.Tensor.mul_``: times a scale) for ``wide`` (rows, K) and its
    values ``grid`` (ceil(rows / bn), ceil(K / bk)), each over its block of bn x bk, through views (no value is
    repeated in memory): the whole blocks, then a last block row and a last block column that bn and bk do not
    divide."""
    rows, k = wide.shape
    whole_rows, whole_cols = rows // bn, k // bk
    for r0, r1, g in ((0, whole_rows * bn, grid[:whole_rows]), (whole_rows * bn, rows, grid[whole_rows:])):
        if r0 == r1:
            continue
        region = wide[r0:r1]
        for c0, c1, part in ((0, whole_cols * bk, g[:, :whole_cols]), (whole_cols * bk, k, g[:, whole_cols:])):
            if c0 == c1:
                continue
            tall, broad = (r1 - r0) // part.shape[0], (c1 - c0) // part.shape[1]
            op(region[:, c0:c1].view(part.shape[0], tall, part.shape[1], broad), part[:, None, :, None])
