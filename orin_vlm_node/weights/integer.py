"""Checkpoints whose linear weights are stored as 4- or 8-bit integers with scales (compressed-tensors'
``pack-quantized`` and ``int-quantized`` formats): kept as the node's INT4 / INT8 where ``weight_quant`` asks
for that format and the layout maps onto it, widened to the model's dtype otherwise.

Why: the 4-bit releases of Qwen3-VL that vLLM serves are llm-compressor's (W4A16, W4A16_ASYM, AWQ or GPTQ
recipes saved as compressed-tensors; W8A16 and W8A8 for 8 bits). Their weights were quantized offline on a big
machine, often with calibration (GPTQ's error feedback, AWQ's activation-aware scales), which gives better
answers than the round-to-nearest INT4 this node computes at load; and a robot with a small eMMC and a slow
uplink fetches a quarter of the bytes. Widening them to fp16 and quantizing again would lose both.

More in docs/modules.md, ``orin_vlm_node/weights/integer.py``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..model.errors import CheckpointError
from .fp8 import apply_blockwise_, positive_int
from .pieces import rows_per_piece
from .quant import QuantizedLinear, WeightQuant, unpack_nibbles

FORMATS = ("pack-quantized", "int-quantized")
STRATEGIES = ("tensor", "channel", "group")
SCALE_DTYPES = ("F32", "BF16", "F16")
PACKED_SUFFIX = ".weight_packed"  # a pack-quantized module's stored weight


def companion_problem(
    key: str,
    kind: str,
    suffixes: tuple[str, dict[str, str]],
    expected: dict[str, tuple[tuple[int, ...], tuple[str, ...]]],
    found: dict[str, tuple[str, tuple[int, ...]] | None],
    optional: frozenset[str] = frozenset(),
    unit_dims_free: bool = False,
) -> str | None:
    """What is wrong with the companions of the stored weight ``key`` (``kind``: "AWQ integers", ...): each role of
    ``expected`` (role -> (shape, dtypes)) must be ``found`` (role -> (dtype, shape), None when absent) with one
    of those dtypes and exactly that shape, except the ``optional`` roles, which may be absent. ``suffixes``:
    the weight's key suffix and each role's (``(".qweight", {"scale": ".scales", ...})``), which name the
    companions in the messages. ``unit_dims_free``: a shape matches when it differs only by dimensions of size 1
    and has at most two (compressed-tensors saves one scale a tensor as [], [1] or [1, 1], and one a channel as
    [N] or [N, 1]; all hold the same values in the same order). None when all fit."""
    weight_suffix, roles = suffixes
    base = key.removesuffix(weight_suffix)
    for role, (want, dtypes) in expected.items():
        name, got = base + roles[role], found.get(role)
        if got is None:
            if role in optional:
                continue
            return f"{key} is stored as {kind} but the checkpoint has no {name}"
        dtype, shape = got
        if dtype not in dtypes:
            return f"{name} is {dtype}; expected {' or '.join(dtypes)}"
        if not (same_unit_free(shape, want) if unit_dims_free else tuple(shape) == want):
            return f"{name} has shape {list(shape)}, expected {list(want)}"
    return None


def same_unit_free(shape: tuple[int, ...], want: tuple[int, ...]) -> bool:
    """Whether ``shape`` (at most two dimensions) is ``want`` once dimensions of size 1 are left out of both."""
    return len(shape) <= 2 and [d for d in shape if d != 1] == [d for d in want if d != 1]


def dequantize_groups_(wide: torch.Tensor, zeros: torch.Tensor | None, scales: torch.Tensor, width: int) -> None:
    """``wide`` (rows, K) fp32 stored integers -> ``(q - zero) * scale`` in place, each column of ``zeros`` and
    ``scales`` (rows, groups) applying to ``width`` consecutive k (no ``zeros``: symmetric, ``q * scale``)."""
    if zeros is not None:
        apply_blockwise_(wide, zeros, 1, width, torch.Tensor.sub_)
    apply_blockwise_(wide, scales, 1, width, torch.Tensor.mul_)


@dataclass(frozen=True)
class IntWeights:
    """How a checkpoint's integer weights are stored: ``bits`` a value (4 or 8), the scales' ``strategy`` (one of
    STRATEGIES) with its ``group_size`` (``group`` only), whether they are ``symmetric`` (no zero points) and
    ``packed`` (pack-quantized int32 words; else int-quantized int8)."""

    bits: int
    strategy: str
    group_size: int | None
    symmetric: bool
    packed: bool

    @classmethod
    def from_compressed_tensors(cls, weights: dict[str, Any], fmt: str) -> IntWeights:
        """From a compressed-tensors config group's ``weights`` (integer type) saved with ``fmt``; CheckpointError
        naming what is not read."""
        bits, strategy, symmetric = weights.get("num_bits"), weights.get("strategy"), weights.get("symmetric", True)
        packed = fmt == "pack-quantized"
        if bits not in ((4, 8) if packed else (8,)):
            raise CheckpointError(
                f"compressed-tensors {fmt} weights of {bits} bits: this node reads 4- and 8-bit pack-quantized and "
                "8-bit int-quantized integer weights"
            )
        if strategy not in STRATEGIES:
            raise CheckpointError(
                f"compressed-tensors integer weights with strategy {strategy!r}: {', '.join(STRATEGIES)} are read"
            )
        if weights.get("actorder") in ("group", "dynamic"):
            raise CheckpointError(
                "compressed-tensors integer weights with activation-ordered groups (actorder "
                f"{weights['actorder']!r}, a weight_g_idx per projection): groups of consecutive inputs are read"
            )
        if not symmetric and strategy == "tensor":
            raise CheckpointError("compressed-tensors asymmetric integer weights with one scale per tensor: not read")
        size = weights.get("group_size")
        if strategy == "group" and not positive_int(size):
            raise CheckpointError(f"weights.group_size must be a positive integer, got {size!r}")
        return cls(bits, strategy, size if strategy == "group" else None, bool(symmetric), packed)

    # ---- what the loader reads -------------------------------------------------------------------------------

    @property
    def weight_suffix(self) -> str:
        """The key suffix of a converted module's stored weight (``<module>.weight_packed``)."""
        return PACKED_SUFFIX if self.packed else ".weight"

    @property
    def stored_dtype(self) -> str:
        """safetensors' name of the stored weight's dtype."""
        return "I32" if self.packed else "I8"

    @property
    def companions(self) -> dict[str, str]:
        """What :meth:`widen_into` and :meth:`store_into` take beside the weight, by keyword: key suffix."""
        return {"scale": ".weight_scale"} | ({} if self.symmetric else {"zero_point": ".weight_zero_point"})

    @property
    def ignored_suffixes(self) -> tuple[str, ...]:
        """Keys read past: the packed shape (config.json gives it) and activation quantization's parameters."""
        return (".weight_shape", ".input_scale", ".input_zero_point")

    def widener(self, device: torch.device) -> IntWeights:
        """What widens this checkpoint's weights: the format itself (no work buffers to keep)."""
        return self

    @property
    def mode(self) -> str:
        """The node's format with as many bits."""
        return "int4" if self.bits == 4 else "int8"

    def describe(self) -> str:
        """For logs and diagnostics, e.g. ``int4 (pack-quantized, symmetric), a scale per group of 128``."""
        per = {"tensor": "tensor", "channel": "output channel"}.get(self.strategy, f"group of {self.group_size}")
        kind = "symmetric" if self.symmetric else "with zero points"
        return f"int{self.bits} ({'pack' if self.packed else 'int'}-quantized, {kind}), a scale per {per}"

    def stored_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The stored weight's shape for a weight of ``shape`` (N, K)."""
        n, k = shape
        return (n, -(-k * self.bits // 32)) if self.packed else (n, k)

    def problem(
        self, key: str, dtype: str, shape: tuple[int, int], companions: dict[str, tuple[str, tuple[int, ...]] | None]
    ) -> str | None:
        """What is wrong with the stored weight ``key`` (safetensors ``dtype``) of a weight of ``shape`` (N, K) and
        its ``companions`` (keyword -> (dtype, shape), None when absent), or None when it can be read."""
        if dtype != self.stored_dtype:
            return f"{key} is {dtype}; {self.describe()} weights are stored as {self.stored_dtype}"
        n, k = shape
        groups = self._columns(k)
        expected = {"scale": ((1, 1) if self.strategy == "tensor" else (n, groups), SCALE_DTYPES)}
        if not self.symmetric:
            zeros = (-(-n * self.bits // 32), groups) if self.packed else (n, groups)
            expected["zero_point"] = (zeros, (self.stored_dtype,))
        suffixes = (self.weight_suffix, self.companions)
        return companion_problem(key, "integers", suffixes, expected, companions, unit_dims_free=True)

    # ---- widening and keeping --------------------------------------------------------------------------------

    def keeps(self, quant: WeightQuant | None) -> WeightQuant | None:
        """How a projection to be stored as ``quant`` holds this checkpoint's values unchanged (module docstring),
        or None when they are widened."""
        if quant is None or quant.mode != self.mode:
            return None
        if self.bits == 8:
            return quant if self.symmetric and self.strategy != "group" else None
        if self.strategy != "group":
            return quant
        g = self.group_size
        return WeightQuant("int4", g, quant.lm_head) if g and g >= 2 and not g & (g - 1) else None

    def widen_into(
        self, out: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor | None = None
    ) -> None:
        """``out`` (N, K), in its own dtype, = ``(q - z) * s`` of the stored ``weight`` (module docstring), computed
        in fp32 a piece of rows at a time (:mod:`.pieces`) on ``out``'s device."""
        n, k = out.shape
        device = out.device
        scales, width = self._grid(scale, n).to(device, torch.float32), self._width(k)
        zeros = None if zero_point is None else self._zero_grid(zero_point, n, k).to(device, torch.float32)
        step = rows_per_piece(device, k)
        for first in range(0, n, step):
            rows = slice(first, first + step)
            wide = self._values(weight[rows].to(device), k).to(torch.float32)  # (rows, K)
            if self.packed:
                wide -= 1 << (self.bits - 1)  # q
            dequantize_groups_(wide, None if zeros is None else zeros[rows], scales[rows], width)
            out[rows].copy_(wide)

    def store_into(
        self,
        module: QuantizedLinear,
        rows: slice,
        weight: torch.Tensor,
        scale: torch.Tensor,
        zero_point: torch.Tensor | None = None,
    ) -> None:
        """Rows ``rows`` of ``module`` (stored as :meth:`keeps` said) from the stored ``weight`` as they are."""
        device, k = module.qweight.device, module.in_features
        n = rows.stop - rows.start
        s = self._grid(scale, n).to(device, torch.float32)  # (n, groups of the checkpoint)
        if self.bits == 8:
            q = self._values(weight.to(device), k)
            module.qweight[rows].copy_((q ^ 0x80).view(torch.int8) if self.packed else q)  # q + 128 -> q
            module.scales[rows].copy_(s[:, 0])
            return
        module.qweight[rows].copy_(weight.to(device).contiguous().view(torch.uint8)[:, : -(-k // 2)])
        if self.strategy != "group":
            s = s.expand(n, module.scales.shape[1])  # one scale a row, repeated over the node's groups
        z = 0.0 if zero_point is None else self._zero_grid(zero_point, n, k).to(device, torch.float32)
        module.scales[rows].copy_(s)
        module.offsets[rows].copy_(-(z + 8.0) * s)  # w = (q + 8) * s + offset

    def _values(self, stored: torch.Tensor, k: int) -> torch.Tensor:
        """The first ``k`` values of each row of ``stored``: int8 q for int-quantized, else the unsigned stored
        values (q + 2^(b-1)) as uint8. Words are read as little-endian bytes (x86, Arm)."""
        if not self.packed:
            return stored
        data = stored.contiguous().view(torch.uint8)  # (rows, 4 * words): byte j holds values 2j, 2j+1 or j
        if self.bits == 4:
            data = unpack_nibbles(data)
        return data[:, :k]

    def _zero_grid(self, zero_point: torch.Tensor, n: int, k: int) -> torch.Tensor:
        """z as stored (packed along N for pack-quantized) -> (N, groups) int16 in q's range."""
        if not self.packed:
            return zero_point.to(torch.int16).reshape(n, -1)
        unsigned = self._values(zero_point.t(), n).t()  # (N, groups)
        return unsigned.to(torch.int16) - (1 << (self.bits - 1))

    def _grid(self, scale: torch.Tensor, n: int) -> torch.Tensor:
        """The scales as a (N, groups) grid; one for the tensor is a column of N equal scales (a view)."""
        if self.strategy == "tensor":
            return scale.reshape(1, 1).expand(n, 1)
        return scale.reshape(n, -1)

    def _columns(self, k: int) -> int:
        """Scale columns of a weight with ``k`` inputs."""
        return -(-k // self.group_size) if self.strategy == "group" else 1

    def _width(self, k: int) -> int:
        """Inputs one scale column covers."""
        return self.group_size if self.strategy == "group" else k
