"""Checkpoints whose linear weights are stored in FP8 with block scales (config.json ``quant_method: fp8``).

Why: Qwen publishes Qwen3-VL in this format beside bf16 (the ``-FP8`` model repositories), at about half
the download and disk size -- what a robot with a small eMMC and a slow uplink wants to fetch. A Jetson
Orin (sm_87) has no FP8 arithmetic, so each weight is widened to the model's dtype as it streams in; with
``weight_quant`` the decoder projections are then stored as INT8/INT4 from the widened values, as from any
float checkpoint.

Layout ("fine-grained FP8", as transformers saves it): a converted linear's ``<module>.weight`` is
float8_e4m3fn (N, K) and ``<module>.weight_scale_inv`` holds one scale per block of ``weight_block_size =
[bn, bk]`` weights, shape (ceil(N / bn), ceil(K / bk)): ``w[n, k] = q[n, k] * s[n // bn, k // bk]`` (a last
block row or column that the block size does not divide is a partial block with its own scale). Without
``weight_block_size`` the scale is one number for the whole tensor. Scales are float32, or powers of two
stored as float8_e8m0fnu (``scale_fmt: ue8m0``). Modules listed in ``modules_to_not_convert`` are ordinary
float tensors. Activation scales (``activation_scheme: static``) are not used: activations stay in the
model's dtype, which only removes a rounding step.

Every other stored-quantized format (AWQ, GPTQ, compressed-tensors, bitsandbytes, ...) is refused by name:
their 4-bit layouts differ from this node's INT4, and reading one wrongly would give a running model with
wrong answers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .errors import CheckpointError

SCALE_SUFFIX = "_scale_inv"  # "<module>.weight" + this = its scale's key
ACTIVATION_SCALE_SUFFIXES = (".input_scale", ".activation_scale")
WEIGHT_DTYPE = "F8_E4M3"  # safetensors' name for float8_e4m3fn
SCALE_DTYPES = ("F32", "BF16", "F16", "F8_E8M0")
WIDEN_ELEMENTS = 1 << 24  # weights widened at a time (64 MB of fp32 working copy)


@dataclass(frozen=True)
class Fp8Weights:
    """How a checkpoint's FP8 weights are scaled: one scale per ``block`` (rows, columns), or per tensor."""

    block: tuple[int, int] | None

    @classmethod
    def from_spec(cls, spec: dict[str, Any]) -> Fp8Weights:
        """From config.json's ``quantization_config`` (``quant_method: fp8``); CheckpointError if it names an
        FP8 variant this node does not read."""
        fmt = spec.get("fmt", "e4m3")
        if fmt != "e4m3":
            raise CheckpointError(f"FP8 checkpoint with fmt {fmt!r}: only e4m3 weights are read")
        block = spec.get("weight_block_size")
        if block is None:
            return cls(None)
        if not (
            isinstance(block, (list, tuple))
            and len(block) == 2
            and all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)
        ):
            raise CheckpointError(f"quantization_config.weight_block_size must be two positive integers, got {block!r}")
        return cls((block[0], block[1]))

    def describe(self) -> str:
        """For logs and diagnostics, e.g. ``fp8 e4m3, a scale per 128x128 block``."""
        per = f"{self.block[0]}x{self.block[1]} block" if self.block else "tensor"
        return f"fp8 e4m3, a scale per {per}"

    def problem(self, key: str, shape: tuple[int, ...], scale: tuple[str, tuple[int, ...]] | None) -> str | None:
        """What is wrong with the FP8 tensor ``key`` of ``shape`` and its scale (safetensors dtype, shape), or
        None when it can be widened."""
        if len(shape) != 2:
            return f"{key} is FP8 with shape {list(shape)}; only 2-D linear weights are read as FP8"
        if scale is None:
            return f"{key} is FP8 but the checkpoint has no {key}{SCALE_SUFFIX}"
        dtype, scale_shape = scale
        if dtype not in SCALE_DTYPES:
            return f"{key}{SCALE_SUFFIX} is {dtype}; scales are read as {', '.join(SCALE_DTYPES)}"
        if self.block is None:
            fits = len(scale_shape) <= 2 and all(d == 1 for d in scale_shape)
            want = "one number"
        else:
            grid = (-(-shape[0] // self.block[0]), -(-shape[1] // self.block[1]))
            fits, want = tuple(scale_shape) == grid, str(list(grid))
        return None if fits else f"{key}{SCALE_SUFFIX} has shape {list(scale_shape)}, expected {want}"


class Fp8Widener:
    """Widens the FP8 weights of one checkpoint load into their parameters, on ``device``.

    ``out = q * s`` is computed in fp32 (an e4m3 value is exact in fp32) and rounded once to ``out``'s dtype,
    which is what transformers loads from the same files. On the target device (the one byte a weight
    travels, not four) and WIDEN_ELEMENTS weights at a time, in two work buffers reused from piece to piece
    and dropped with the widener (96 MB at most, next to the 8B's largest matrices of 50M weights).

    Why not ``q.to(torch.float32)``: torch converts FP8 on the CPU one element at a time (4.6 ns a weight on
    the development VM), and every fresh piece of memory pays its page faults; together about 70 ms a
    6144 x 2048 matrix, 12 s more than a bf16 load of the 2B. Here the byte's bits are moved into an fp16's
    place instead (:meth:`_as_fp16`) and every step runs in place: 15 ms.
    """

    def __init__(self, stored: Fp8Weights, device: torch.device) -> None:
        self.block, self.device = stored.block, device
        self._bits: torch.Tensor | None = None  # int16 work buffer
        self._wide: torch.Tensor | None = None  # fp32 work buffer, as many elements

    def widen_into(self, out: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> None:
        """``out`` (N, K), in its own dtype, = the FP8 ``weight`` (N, K) times its ``scale`` (module docstring)."""
        n, k = weight.shape
        s = scale.to(self.device, torch.float32) * 256.0  # _as_fp16 gives the value / 2^8
        if self.block is None:
            bn, by_column = 1, s.reshape(1, 1).expand(n, k)  # every row its own "block" of the one scale
        else:
            bn, bk = self.block
            by_column = s.repeat_interleave(bk, dim=1)[:, :k]  # (ceil(N / bn), K)
        step = max(1, WIDEN_ELEMENTS // (k * bn)) * bn  # whole block rows
        for first in range(0, n, step):
            rows = min(step, n - first)
            wide = self._as_fp16(weight[first : first + rows], rows * k)  # (rows, K) fp32, the values / 2^8
            whole, lead = rows // bn, first // bn
            if whole:
                wide[: whole * bn].view(whole, bn, k).mul_(by_column[lead : lead + whole, None, :])
            if rows % bn:
                wide[whole * bn :].mul_(by_column[lead + whole])
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


def stored_weights(config: dict[str, Any]) -> Fp8Weights | None:
    """How config.json says the weights are stored: None for float weights, :class:`Fp8Weights` for FP8;
    CheckpointError naming any other quantized format."""
    for holder in (config, config.get("text_config") or {}):
        spec = holder.get("quantization_config") or holder.get("compression_config")
        if not spec:
            continue
        method = (spec.get("quant_method") or spec.get("format")) if isinstance(spec, dict) else None
        if method == "fp8":
            return Fp8Weights.from_spec(spec)
        raise CheckpointError(
            f"the checkpoint is already quantized ({method or 'unknown format'}); this node reads float "
            "checkpoints (fp32/fp16/bf16) and FP8 ones with block scales (quant_method fp8), and quantizes them "
            "itself with weight_quant=int8 or int4"
        )
    return None
