"""What the engine reports about its parts: the node's ``/diagnostics`` and ``ready`` event, the CLI's
``--json``. Every field is read from the parts in effect; the KV figures come from a snapshot the engine
takes while no request runs, so the cache is never read while it changes.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from .backend import decode_path
from .config import EngineConfig
from .parts import EngineParts


def lm_head_storage(config: EngineConfig, dtype: torch.dtype) -> str:
    """How the LM head is stored: its quantized format (``weight_quant_lm_head``) or the model's dtype."""
    head = config.quant.head
    return head.mode if head else str(dtype).replace("torch.", "")


def describe_parts(parts: EngineParts, kv: dict[str, Any], busy: bool, served: int, last: dict) -> dict[str, Any]:
    """The description of ``parts``: ``kv`` the KV cache's stats snapshot, ``served`` the requests finished,
    ``last`` the metrics of the last one."""
    stats, cfg = dict(kv), parts.config
    return {
        "busy": busy,
        "model_path": str(cfg.model_dir),
        "device": str(parts.device),
        "dtype": str(parts.dtype).replace("torch.", ""),
        "checkpoint_weights": parts.checkpoint_weights,
        "weight_quant": cfg.weight_quant,
        "lm_head": lm_head_storage(cfg, parts.dtype),
        "weight_mb": round(parts.weight_bytes / 1e6, 3),
        "weight_path": parts.weight_path,
        "paged_attention": cfg.use_paged_attention,
        "page_size": stats.get("page_size"),
        "kv_blocks_total": stats.get("blocks_total"),
        "kv_blocks_used": stats.get("blocks_used"),
        "kv_blocks_free": stats.get("blocks_free"),
        "kv_blocks_cached": stats.get("blocks_cached", 0),
        "prefix_caching": stats.get("prefix_caching", False),
        "prefix_hit_rate": stats.get("prefix_hit_rate", 0.0),
        "max_context_tokens": cfg.max_context_tokens,
        "kv_pool": stats.get("pool"),
        "decode_path": decode_path(parts.attention, parts.decode_step),
        "kernels": parts.attention.status,
        "kernels_degraded": parts.attention.degraded,
        "decode": parts.decode_step.describe(),
        "sessions": len(parts.session_store),
        "vision_cache": parts.vision_cache.stats(),
        "requests_served": served,
        "eos_token_ids": list(parts.tokenizer.eos_token_ids),
        "last_metrics": dict(last),
        "kv_cache": stats,
    }


def serving_summary(described: Mapping[str, Any]) -> str:
    """What answers the prompts, for the ready log: the model and device, or the server and model."""
    if described.get("backend") == "openai":
        return f"server {described['remote_url']}, model {described['remote_model']}"
    model, device, dtype = (described.get(k, "?") for k in ("model_path", "device", "dtype"))
    return f"model {model}, device {device}, dtype {dtype}"


def backend_summary(described: Mapping[str, Any]) -> str:
    """``kernels: on|off (...); decode: ...; KV pool: ...`` -- what the ready/reconfigured events say; with a
    server, its state."""
    if described.get("backend") == "openai":
        problem = described.get("server_problem") or described.get("last_error")
        where = f"remote: {described['remote_model']} at {described['remote_url']}"
        return f"{where} ({problem})" if problem else where
    return (
        f"{described.get('kernels', 'kernels: unknown')}; decode: {described.get('decode_path', '?')}; "
        f"KV pool: {described.get('kv_pool', '?')}"
    )
