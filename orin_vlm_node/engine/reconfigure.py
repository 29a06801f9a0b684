"""Checking a change of settings before it is applied, with the rules of the layers that own them.

``ros2 param set`` must get its refusal (and the reason) when it asks, not an error event at the next
request, so every check that can be made on the spot is made here, where the change is planned: names,
types and bounds (the schema), the device and dtype (:mod:`.device`), the model directory, the image
limits (the image processor's own config), the kernel directory (the CUDA layer) and the KV pool (the KV
cache's planner: page size, memory free for it, room for one context). Nothing is built or allocated.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch

from ..cuda import sources
from ..kvcache import KVCacheConfig, plan_pool
from ..model.config import ModelConfig
from ..processing import ImageProcessor
from .config import REBUILDS, EngineConfig, check_fields
from .device import resolve_device, resolve_dtype


def kv_cache_config(
    config: EngineConfig, model: ModelConfig, dtype: torch.dtype, device: torch.device
) -> KVCacheConfig:
    """The KV cache an engine config implies: explicit sizes, or sized by need for ``max_batch`` running
    requests plus ``max_sessions`` kept conversations (see ``kvcache.config.plan_pool``)."""
    text = model.text
    return KVCacheConfig(
        num_layers=text.num_hidden_layers,
        num_kv_heads=text.num_key_value_heads,
        head_dim=text.head_dim,
        dtype=dtype,
        device=device,
        page_size=config.page_size,
        kv_pool_blocks=config.kv_pool_blocks or None,
        kv_pool_mb=config.kv_pool_mb or None,
        sequences=config.max_batch + config.max_sessions,
        kv_prefix_share=float(config.kv_prefix_share),
        kv_memory_reserve_mb=float(config.kv_memory_reserve_mb),
        max_context_tokens=config.max_context_tokens,
        prefix_caching=config.prefix_caching and config.use_paged_attention,
        require_full_context=True,
    )


def changed_fields(config: EngineConfig, fields: Mapping[str, Any]) -> set[str]:
    return {k for k, v in fields.items() if getattr(config, k) != v}


def rebuilds(changed: set[str]) -> set[str]:
    """Which parts (keys of ``REBUILDS``) a set of changed fields rebuilds."""
    return {part for part, names in REBUILDS.items() if changed & names}


def check_changes(
    current: EngineConfig,
    fields: Mapping[str, Any],
    model: ModelConfig,
    device: torch.device,
    dtype: torch.dtype,
    pool_bytes: int,
) -> EngineConfig:
    """The config after ``fields``; ValueError (with the reason) when any part of it cannot be applied.

    ``model``/``device``/``dtype`` are what the engine runs now and ``pool_bytes`` its KV pool (freed before
    a new one is allocated, so it counts as free).
    """
    check_fields(fields)
    new = dataclasses.replace(current, **fields)
    parts = rebuilds(set(fields))
    running_on = device
    if "kernel_dir" in fields:
        check_kernel_dir(new.kernel_dir)
    if "model" in parts:
        device = resolve_device(new.device)
        if "model_path" in fields:
            if not (new.model_dir / "config.json").is_file():
                raise ValueError(f"model_path {new.model_dir} is not a model directory (no config.json)")
            model = ModelConfig.from_dir(new.model_dir)
        dtype = resolve_dtype(new.dtype, device, model.torch_dtype)
    if "images" in parts:
        try:
            ImageProcessor.from_pretrained(
                new.model_dir, image_min_pixels=new.image_min_pixels, image_max_pixels=new.image_max_pixels
            )
        except ValueError as exc:
            limits = f"image_min_pixels={new.image_min_pixels}, image_max_pixels={new.image_max_pixels}"
            raise ValueError(f"{limits}: {exc}") from None
    if parts & {"model", "kv_cache"}:
        released = pool_bytes if device == running_on else 0
        plan_pool(kv_cache_config(new, model, dtype, device), contiguous=not new.use_paged_attention,
                  released_bytes=released)  # fmt: skip
    return new


def check_kernel_dir(value: str) -> None:
    """An explicit kernel directory must hold the kernels: a typo is refused, never ignored."""
    if value:
        try:
            sources.check_kernel_dir(value)
        except sources.KernelSourcesNotFound as exc:
            raise ValueError(str(exc)) from None
