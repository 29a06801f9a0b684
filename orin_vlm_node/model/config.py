"""Qwen3-VL architecture numbers, parsed from an HF-format ``config.json``.

Why a separate parser instead of ``transformers.Qwen3VLConfig``: transformers is a test-only
dependency (it is not installed on the robot), and the checkpoint files exist in two spellings
(4.57: ``rope_theta`` + ``rope_scaling``; 5.x: ``rope_parameters``) that we must both accept. Every
value the model needs is a field here, so the modules never read the raw dict.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from .dtypes import checkpoint_dtype
from .errors import CheckpointError

DEFAULT_MROPE_SECTION = (24, 20, 20)
DEFAULT_VISION_ROPE_THETA = 10000.0


@dataclass(frozen=True)
class TextConfig:
    """Decoder (Qwen3 layers with interleaved M-RoPE)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 5_000_000.0
    mrope_section: tuple[int, int, int] = DEFAULT_MROPE_SECTION


@dataclass(frozen=True)
class VisionConfig:
    """Vision tower (ViT with 2D RoPE, learned bilinear position table, 2x2 merger, DeepStack)."""

    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    out_hidden_size: int
    deepstack_visual_indexes: tuple[int, ...]
    in_channels: int = 3
    patch_size: int = 16
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    num_position_embeddings: int = 2304
    rope_theta: float = DEFAULT_VISION_ROPE_THETA
    layer_norm_eps: float = 1e-6

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patch_dim(self) -> int:
        """Length of one flattened patch row of ``pixel_values`` (3*2*16*16 = 1536)."""
        return self.in_channels * self.temporal_patch_size * self.patch_size * self.patch_size

    @property
    def merge_unit(self) -> int:
        """Patches per LLM token (2x2 = 4)."""
        return self.spatial_merge_size * self.spatial_merge_size


@dataclass(frozen=True)
class ModelConfig:
    """Everything the model needs to know about a checkpoint."""

    text: TextConfig
    vision: VisionConfig
    image_token_id: int = 151655
    video_token_id: int = 151656
    vision_start_token_id: int = 151652
    vision_end_token_id: int = 151653
    tie_word_embeddings: bool = False
    checkpoint_dtype: str | None = None  # "bfloat16" etc. as written in config.json, None if absent
    raw: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @property
    def visual_token_ids(self) -> tuple[int, int]:
        """The pad ids whose embeddings vision features replace (images', videos')."""
        return (self.image_token_id, self.video_token_id)

    @property
    def torch_dtype(self) -> torch.dtype | None:
        """The dtype the checkpoint was saved for (what ``dtype="auto"`` means on CUDA)."""
        return checkpoint_dtype(self.checkpoint_dtype)

    @classmethod
    def from_dir(cls, path: str | Path) -> ModelConfig:
        """Parse ``<path>/config.json``; raises :class:`CheckpointError` naming the file on any problem."""
        file = Path(path) / "config.json"
        if not file.is_file():
            raise CheckpointError(f"{file}: missing (not an HF-format Qwen3-VL model directory)")
        return cls.from_json_file(file)

    @classmethod
    def from_json_file(cls, file: str | Path) -> ModelConfig:
        """Parse one config.json-format file (e.g. the shared ``*.config.json`` of the real models)."""
        file = Path(file)
        try:
            data = json.loads(file.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise CheckpointError(f"{file}: cannot read JSON: {exc}") from exc
        try:
            return cls.from_dict(data)
        except CheckpointError as exc:
            raise CheckpointError(f"{file}: {exc}") from exc

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelConfig:
        """Build from a config.json dict (4.57 or 5.x spelling)."""
        if not isinstance(data, dict):
            raise CheckpointError("config is not a JSON object")
        model_type = data.get("model_type")
        if model_type not in (None, "qwen3_vl"):
            raise CheckpointError(f"model_type {model_type!r} is not supported (expected 'qwen3_vl')")
        text_raw = data.get("text_config")
        vision_raw = data.get("vision_config")
        if not isinstance(text_raw, dict) or not isinstance(vision_raw, dict):
            raise CheckpointError("needs 'text_config' and 'vision_config' objects")
        text = _parse_text(text_raw)
        vision = _parse_vision(vision_raw)
        if vision.out_hidden_size != text.hidden_size:
            raise CheckpointError(
                f"vision_config.out_hidden_size {vision.out_hidden_size} != text_config.hidden_size {text.hidden_size}"
            )
        if len(vision.deepstack_visual_indexes) > text.num_hidden_layers:
            raise CheckpointError(
                f"{len(vision.deepstack_visual_indexes)} DeepStack levels but only {text.num_hidden_layers} decoder "
                "layers to inject them into"
            )
        # 5.x reads the top-level flag, 4.57 the text_config one; official configs set both.
        tie = data.get("tie_word_embeddings", text_raw.get("tie_word_embeddings", False))
        dtype = data.get("dtype") or data.get("torch_dtype") or text_raw.get("dtype") or text_raw.get("torch_dtype")
        return cls(
            text=text,
            vision=vision,
            image_token_id=_int(data, "image_token_id", 151655),
            video_token_id=_int(data, "video_token_id", 151656),
            vision_start_token_id=_int(data, "vision_start_token_id", 151652),
            vision_end_token_id=_int(data, "vision_end_token_id", 151653),
            tie_word_embeddings=bool(tie),
            checkpoint_dtype=dtype if isinstance(dtype, str) else None,
            raw=data,
        )


def _int(d: dict[str, Any], key: str, default: int | None = None, where: str = "") -> int:
    value = d.get(key, default)
    if value is None:
        raise CheckpointError(f"missing required field {where}{key}")
    if isinstance(value, bool) or not isinstance(value, int):
        raise CheckpointError(f"field {where}{key} must be an integer, got {value!r}")
    return value


def _positive(d: dict[str, Any], key: str, where: str, default: int | None = None) -> int:
    value = _int(d, key, default, where)
    if value <= 0:
        raise CheckpointError(f"field {where}{key} must be > 0, got {value}")
    return value


def _rope_settings(text_raw: dict[str, Any]) -> tuple[float, tuple[int, int, int]]:
    """theta and mrope_section from either spelling: 5.x ``rope_parameters`` or 4.57 ``rope_theta``+``rope_scaling``."""
    params = text_raw.get("rope_parameters")
    scaling = text_raw.get("rope_scaling")
    merged: dict[str, Any] = {}
    for source in (scaling, params):  # rope_parameters wins where both are present
        if isinstance(source, dict):
            merged.update(source)
    rope_type = merged.get("rope_type", merged.get("type", "default"))
    if rope_type not in ("default", "mrope"):
        raise CheckpointError(f"text_config rope_type {rope_type!r} is not supported (only the default M-RoPE)")
    theta = merged.get("rope_theta", text_raw.get("rope_theta", 5_000_000.0))
    if not isinstance(theta, (int, float)) or isinstance(theta, bool) or theta <= 0:
        raise CheckpointError(f"text_config rope_theta must be a positive number, got {theta!r}")
    section = merged.get("mrope_section", DEFAULT_MROPE_SECTION)
    if (
        not isinstance(section, (list, tuple))
        or len(section) != 3
        or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in section)
    ):
        raise CheckpointError(f"text_config mrope_section must be 3 non-negative integers, got {section!r}")
    return float(theta), (int(section[0]), int(section[1]), int(section[2]))


def _parse_text(raw: dict[str, Any]) -> TextConfig:
    w = "text_config."
    act = raw.get("hidden_act", "silu")
    if act != "silu":
        raise CheckpointError(f"{w}hidden_act {act!r} is not supported (Qwen3-VL uses 'silu')")
    if raw.get("attention_bias", False):
        raise CheckpointError(f"{w}attention_bias=true is not supported (Qwen3-VL has no decoder biases)")
    heads = _positive(raw, "num_attention_heads", w)
    kv_heads = _positive(raw, "num_key_value_heads", w, default=heads)
    hidden = _positive(raw, "hidden_size", w)
    head_dim = _positive(raw, "head_dim", w, default=hidden // heads)
    if heads % kv_heads:
        raise CheckpointError(f"{w}num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}")
    if head_dim % 2:
        raise CheckpointError(f"{w}head_dim {head_dim} must be even for RoPE")
    theta, section = _rope_settings(raw)
    eps = raw.get("rms_norm_eps", 1e-6)
    return TextConfig(
        vocab_size=_positive(raw, "vocab_size", w),
        hidden_size=hidden,
        intermediate_size=_positive(raw, "intermediate_size", w),
        num_hidden_layers=_positive(raw, "num_hidden_layers", w),
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=float(eps),
        rope_theta=theta,
        mrope_section=section,
    )


def _parse_vision(raw: dict[str, Any]) -> VisionConfig:
    w = "vision_config."
    act = raw.get("hidden_act", "gelu_pytorch_tanh")
    if act != "gelu_pytorch_tanh":
        raise CheckpointError(f"{w}hidden_act {act!r} is not supported (Qwen3-VL uses 'gelu_pytorch_tanh')")
    depth = _positive(raw, "depth", w)
    hidden = _positive(raw, "hidden_size", w)
    heads = _positive(raw, "num_heads", w)
    if hidden % heads or (hidden // heads) % 4:
        raise CheckpointError(f"{w}hidden_size {hidden} / num_heads {heads} must give a head dim divisible by 4")
    deepstack = raw.get("deepstack_visual_indexes", [8, 16, 24])
    if not isinstance(deepstack, (list, tuple)) or not all(
        isinstance(i, int) and not isinstance(i, bool) and 0 <= i < depth for i in deepstack
    ):
        raise CheckpointError(f"{w}deepstack_visual_indexes {deepstack!r} must be block indices in 0..{depth - 1}")
    if len(set(deepstack)) != len(deepstack):
        raise CheckpointError(f"{w}deepstack_visual_indexes {deepstack!r} has duplicates")
    num_pos = _positive(raw, "num_position_embeddings", w, default=2304)
    side = int(num_pos**0.5)
    if side * side != num_pos:
        raise CheckpointError(f"{w}num_position_embeddings {num_pos} is not a square grid")
    theta = DEFAULT_VISION_ROPE_THETA  # 4.57 hard-codes it; 5.x writes it into rope_parameters
    rope = raw.get("rope_parameters")
    if isinstance(rope, dict) and isinstance(rope.get("rope_theta"), (int, float)):
        theta = float(rope["rope_theta"])
    return VisionConfig(
        depth=depth,
        hidden_size=hidden,
        intermediate_size=_positive(raw, "intermediate_size", w),
        num_heads=heads,
        out_hidden_size=_positive(raw, "out_hidden_size", w),
        deepstack_visual_indexes=tuple(int(i) for i in deepstack),
        in_channels=_positive(raw, "in_channels", w, default=3),
        patch_size=_positive(raw, "patch_size", w, default=16),
        temporal_patch_size=_positive(raw, "temporal_patch_size", w, default=2),
        spatial_merge_size=_positive(raw, "spatial_merge_size", w, default=2),
        num_position_embeddings=num_pos,
        rope_theta=theta,
    )
