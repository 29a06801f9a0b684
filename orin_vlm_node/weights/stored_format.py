"""Which stored-quantized format config.json declares for the linear weights, and the refusal by name of those
not read.

Read: FP8 (``quant_method: fp8``, compressed-tensors ``float-quantized``: :mod:`.fp8`), 4/8-bit
integers (compressed-tensors ``pack-quantized`` / ``int-quantized``: :mod:`.integer`), AutoAWQ's 4-bit
GEMM layout (``quant_method: awq``: :mod:`.awq`) and GPTQ's own 4-bit format (``quant_method: gptq``:
:mod:`.gptq`). Refused: the other layouts of AWQ and GPTQ (other packings), other widths, bitsandbytes,
and compressed-tensors variants such as mixed schemes, a quantized KV cache or a status other than
``compressed``: reading one wrongly would give a running model with wrong answers, so each is named instead.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..model.errors import CheckpointError
from .awq import AwqWeights
from .fp8 import Fp8Weights
from .gptq import GptqWeights
from .integer import FORMATS as INT_FORMATS
from .integer import IntWeights

StoredFormat = Fp8Weights | IntWeights | AwqWeights | GptqWeights
INTEGER_FORMATS = (IntWeights, AwqWeights, GptqWeights)  # stored as integers: the node may keep them as its INT4 / INT8
FLOAT_FORMATS = ("float-quantized", "naive-quantized")


def checkpoint_format(root: Path, config: dict[str, Any]) -> StoredFormat | None:
    """:func:`stored_format` of the checkpoint in ``root`` whose config.json holds ``config``, a refusal naming
    the file."""
    try:
        return stored_format(config)
    except CheckpointError as exc:
        raise CheckpointError(f"{root / 'config.json'}: {exc}") from exc


def stored_format(config: dict[str, Any]) -> StoredFormat | None:
    """How config.json says the linear weights are stored: None for float weights; CheckpointError naming any
    format not read."""
    for holder in (config, config.get("text_config") or {}):
        spec = holder.get("quantization_config") or holder.get("compression_config")
        if not spec:
            continue
        method = (spec.get("quant_method") or spec.get("format")) if isinstance(spec, dict) else None
        if method == "fp8":
            return Fp8Weights.from_fp8_spec(spec)
        if method == "compressed-tensors":
            return _compressed_tensors(spec)
        if method == "awq":
            return AwqWeights.from_awq_spec(spec)
        if method == "gptq":
            return GptqWeights.from_gptq_spec(spec)
        raise CheckpointError(
            f"the checkpoint is already quantized ({method or 'unknown format'}); this node reads float "
            "checkpoints (fp32/fp16/bf16), FP8 ones (quant_method fp8, or compressed-tensors float-quantized), "
            "4-bit AWQ (quant_method awq, AutoAWQ's gemm layout) and GPTQ (quant_method gptq) ones, and "
            "compressed-tensors integer ones (pack-quantized, int-quantized: llm-compressor's W4A16, AWQ and GPTQ "
            "recipes), and quantizes float weights itself with weight_quant=int8 or int4"
        )
    return None


def _compressed_tensors(spec: dict[str, Any]) -> StoredFormat:
    """The format of a ``quant_method: compressed-tensors`` quantization_config: one weight scheme for every
    config group, FP8 or integer."""
    status = spec.get("quantization_status", "compressed")
    groups = spec.get("config_groups")
    schemes = list(groups.values()) if isinstance(groups, dict) else []
    weights = [s.get("weights") if isinstance(s, dict) else None for s in schemes]
    formats = {s.get("format") or spec.get("format") for s in schemes if isinstance(s, dict)}
    if status != "compressed" or not weights or any(not isinstance(w, dict) for w in weights):
        shown = ", ".join(sorted(map(str, formats))) or repr(spec.get("format"))
        raise CheckpointError(
            f"the checkpoint is already quantized (compressed-tensors, format {shown}, status {status!r}, "
            f"{len([w for w in weights if isinstance(w, dict)])} weight scheme(s)): compressed checkpoints with "
            "quantized weights are read"
        )
    if len(formats) != 1 or any(w != weights[0] for w in weights):
        raise CheckpointError("compressed-tensors checkpoint with mixed weight schemes or formats: not read")
    if spec.get("kv_cache_scheme"):
        raise CheckpointError("compressed-tensors checkpoint with a quantized KV cache: not read")
    fmt, w = formats.pop(), weights[0]
    if fmt in FLOAT_FORMATS and w.get("type") == "float" and w.get("num_bits") == 8:
        return Fp8Weights.from_compressed_tensors(w)
    if fmt in INT_FORMATS and w.get("type") == "int":
        return IntWeights.from_compressed_tensors(w, fmt)
    raise CheckpointError(
        f"the checkpoint is already quantized (compressed-tensors, format {fmt!r}, {w.get('num_bits')}-bit "
        f"{w.get('type')} weights); of compressed-tensors checkpoints this node reads 8-bit float weights "
        f"({', '.join(FLOAT_FORMATS)}) and integer ones ({', '.join(INT_FORMATS)})"
    )
