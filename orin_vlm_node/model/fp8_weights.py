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

    def widen_into(self, out: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> None:
        """``out`` (N, K), in its own dtype, = the FP8 ``weight`` (N, K) times its ``scale``; computed in fp32
        (exact for an e4m3 value times an fp32 scale) and rounded once, on ``out``'s device (the one byte a
        weight travels, not four), WIDEN_ELEMENTS weights at a time so the working copy stays small next to
        the 8B's largest matrices."""
        n, k = weight.shape
        s = scale.to(out.device, torch.float32)
        if self.block is None:
            step = max(1, WIDEN_ELEMENTS // k)
            for first in range(0, n, step):
                rows = weight[first : first + step].to(out.device).to(torch.float32)
                out[first : first + step].copy_(rows.mul_(s.reshape(())))
            return
        bn, bk = self.block
        by_column = s.repeat_interleave(bk, dim=1)[:, :k]  # (ceil(N / bn), K)
        step = max(1, WIDEN_ELEMENTS // (k * bn)) * bn  # whole block rows
        for first in range(0, n, step):
            rows = weight[first : first + step].to(out.device).to(torch.float32)  # (r, K)
            scales = by_column[first // bn : -(-(first + rows.shape[0]) // bn)].repeat_interleave(bn, dim=0)
            out[first : first + rows.shape[0]].copy_(rows.mul_(scales[: rows.shape[0]]))


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
