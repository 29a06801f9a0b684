"""``EngineConfig``: the settings the engine consumes, as one dataclass.

Its fields are the ``engine`` settings of the schema (``orin_vlm_node.settings``: name, type, default and
bounds are defined there, the defaults are taken from it; a test holds the names and types to it), plus
two that only the Python API sets:
``max_sessions`` (conversations kept between requests; the node derives it from ``multi_turn``) and
``sampling`` (default sampling under every request's own). The CLI builds it from its flags and the
node from its parameters, and ``Engine.reconfigure`` takes a subset of its fields by name.

Which part of the engine a change rebuilds is the schema's ``rebuilds`` column (:data:`REBUILDS`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .. import settings
from ..weights.quant import WeightQuant
from .events import SamplingParams
from .sampling import validate_sampling

DEFAULT_MODEL_DIR = Path(__file__).resolve().parent.parent / "default_model"


def _default(name: str) -> settings.Value:
    return settings.BY_NAME[name].default


@dataclass
class EngineConfig:
    """The engine's settings; the schema's defaults (``model_path`` "" = the embedded default model)."""

    model_path: str = _default("model_path")
    device: str = _default("device")
    dtype: str = _default("dtype")
    weight_quant: str = _default("weight_quant")
    weight_quant_group_size: int = _default("weight_quant_group_size")
    weight_quant_lm_head: bool = _default("weight_quant_lm_head")
    use_paged_attention: bool = _default("use_paged_attention")
    page_size: int = _default("page_size")
    kv_pool_mb: int = _default("kv_pool_mb")
    kv_pool_blocks: int = _default("kv_pool_blocks")
    kv_prefix_share: float = _default("kv_prefix_share")
    kv_memory_reserve_mb: int = _default("kv_memory_reserve_mb")
    prefix_caching: bool = _default("prefix_caching")
    max_context_tokens: int = _default("max_context_tokens")
    max_batch: int = _default("max_batch")
    prefill_chunk_tokens: int = _default("prefill_chunk_tokens")
    use_cuda_kernels: bool = _default("use_cuda_kernels")
    use_cuda_graph: bool = _default("use_cuda_graph")
    allow_kernel_fallback: bool = _default("allow_kernel_fallback")
    kernel_dir: str = _default("kernel_dir")
    kernel_cache_dir: str = _default("kernel_cache_dir")
    image_min_pixels: int = _default("image_min_pixels")
    image_max_pixels: int = _default("image_max_pixels")
    video_max_tokens: int = _default("video_max_tokens")
    vision_cache_images: int = _default("vision_cache_images")
    prompt_special_tokens: bool = _default("prompt_special_tokens")
    max_sessions: int = 1  # conversations kept between requests (least recently used dropped beyond); sizes the pool
    sampling: SamplingParams = field(default_factory=SamplingParams)

    @property
    def model_dir(self) -> Path:
        return Path(self.model_path) if self.model_path else DEFAULT_MODEL_DIR

    @property
    def quant(self) -> WeightQuant:
        return WeightQuant(self.weight_quant, self.weight_quant_group_size, self.weight_quant_lm_head)


FIELDS = frozenset(f.name for f in dataclasses.fields(EngineConfig))
SCHEMA_FIELDS = frozenset(s.name for s in settings.settings_for("engine"))

# Which part of the engine a change rebuilds: the schema's ``rebuilds`` column, plus ``max_sessions`` (which
# the frontends derive: it sizes the automatic pool). A field in none is read per request or switched in place.
REBUILDS: dict[str, frozenset[str]] = {
    part: frozenset(s.name for s in settings.settings_for("engine") if s.rebuilds == part)
    | ({"max_sessions"} if part == "kv_cache" else set())
    for part in settings.REBUILDS_TEXT
    if part
}


def sampling_from_settings(values: Mapping[str, Any]) -> SamplingParams:
    """The ``sampling`` settings (every one present in ``values``) as SamplingParams; seed -1 = a fresh one."""
    fields = {s.name: values[s.name] for s in settings.settings_for("sampling")}
    if fields["seed"] < 0:
        fields["seed"] = None
    return SamplingParams(**fields)


def config_from_settings(values: Mapping[str, Any], max_sessions: int, max_batch: int) -> EngineConfig:
    """An EngineConfig from setting values (the node's parameters, the CLI's flags): every ``engine``
    setting, the ``sampling`` ones as its default sampling, the conversations the frontend keeps and the
    most requests it runs at once (``max_batch`` as the frontend can use it: it sizes the automatic pool)."""
    engine = {name: values[name] for name in SCHEMA_FIELDS} | {"max_batch": max_batch}
    return EngineConfig(**engine, max_sessions=max_sessions, sampling=sampling_from_settings(values))


def check_fields(fields: Mapping[str, Any]) -> None:
    """Names, types and bounds of engine settings (ValueError names the first problem).

    Rules beyond bounds are checked where they live when the change is planned: the KV cache, the image
    processor, the CUDA layer and the device (``Engine.validate_changes``).
    """
    unknown = set(fields) - FIELDS
    if unknown:
        raise ValueError(f"unknown engine setting(s): {', '.join(sorted(unknown))}")
    settings.check({k: v for k, v in fields.items() if k in SCHEMA_FIELDS})
    if "max_sessions" in fields:
        value = fields["max_sessions"]
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError(f"max_sessions must be an integer >= 0, got {value!r}")
    if "sampling" in fields:
        if not isinstance(fields["sampling"], SamplingParams):
            raise ValueError(f"sampling must be a SamplingParams, got {type(fields['sampling']).__name__}")
        validate_sampling(fields["sampling"])
