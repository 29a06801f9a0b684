"""Checks and resolution of ``EngineConfig`` values, shared by ``Engine.__init__``, ``reconfigure``
and ``validate_changes`` so all three reject exactly the same things with the same messages."""

from __future__ import annotations

import dataclasses
import math

import torch

from ..cuda.sources import KernelSourcesNotFound, check_kernel_dir
from ..kvcache import KVCacheConfig
from ..kvcache.config import MAX_PAGE_SIZE
from .config import EngineConfig
from .events import SamplingParams
from .sampling import validate_sampling

DTYPES = {
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
    "fp32": torch.float32,
    "float32": torch.float32,
}
CONFIG_FIELDS = frozenset(f.name for f in dataclasses.fields(EngineConfig))

# Which part of the engine a field change rebuilds.
MODEL_FIELDS = frozenset({"model_path", "device", "dtype"})
KV_LAYOUT_FIELDS = frozenset(
    {
        "use_paged_attention",
        "page_size",
        "kv_pool_blocks",
        "kv_pool_mb",
        "kv_prefix_share",
        "kv_memory_reserve_mb",
        "max_sessions",
        "max_context_tokens",
    }
)
BACKEND_FIELDS = frozenset(
    {"use_cuda_kernels", "use_cuda_graph", "allow_kernel_fallback", "kernel_dir", "kernel_cache_dir"}
)
IMAGE_FIELDS = frozenset({"image_min_pixels", "image_max_pixels"})


def resolve_device(name: str) -> torch.device:
    """``auto`` -> cuda if available else cpu; "cuda" without CUDA is an error, not a silent fallback."""
    if not isinstance(name, str):
        raise ValueError(f"device must be a string (auto, cpu, cuda), got {name!r}")
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except (RuntimeError, ValueError):
        raise ValueError(f"device {name!r} is not valid (use auto, cpu or cuda)") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} requested but CUDA is not available on this machine")
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"device {name!r} is not supported (use auto, cpu or cuda)")
    return device


def resolve_dtype(name: str, device: torch.device, checkpoint_dtype: torch.dtype | None) -> torch.dtype:
    """``auto`` -> the checkpoint's dtype on CUDA (bf16 if it names none), fp32 on CPU."""
    if name == "auto":
        if device.type == "cuda":
            return checkpoint_dtype or torch.bfloat16
        return torch.float32
    try:
        return DTYPES[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown dtype {name!r} (use auto, bf16, fp16 or fp32)") from None


def check_fields(fields: dict) -> None:
    """Type and range checks of individual fields (no cross-field or model-dependent checks)."""
    unknown = set(fields) - CONFIG_FIELDS
    if unknown:
        raise ValueError(f"unknown engine setting(s): {', '.join(sorted(unknown))}")

    def is_int(v) -> bool:
        return isinstance(v, int) and not isinstance(v, bool)

    for name in (
        "use_paged_attention",
        "prefix_caching",
        "use_cuda_kernels",
        "use_cuda_graph",
        "allow_kernel_fallback",
    ):
        if name in fields and not isinstance(fields[name], bool):
            raise ValueError(f"{name} must be true or false, got {fields[name]!r}")
    for name in ("max_sessions", "kv_memory_reserve_mb"):
        if name in fields and (not is_int(fields[name]) or fields[name] < 0):
            raise ValueError(f"{name} must be an integer >= 0, got {fields[name]!r}")
    if "kv_prefix_share" in fields:
        share = fields["kv_prefix_share"]
        if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0 <= share <= 4:
            raise ValueError(f"kv_prefix_share must be a number in 0..4 (share of the pool), got {share!r}")
    if "page_size" in fields:
        ps = fields["page_size"]
        if not is_int(ps) or ps < 1 or ps > MAX_PAGE_SIZE or ps & (ps - 1):
            raise ValueError(f"page_size must be a power of two in 1..{MAX_PAGE_SIZE}, got {ps!r}")
    if "kv_pool_blocks" in fields and (not is_int(fields["kv_pool_blocks"]) or fields["kv_pool_blocks"] < 0):
        raise ValueError(
            f"kv_pool_blocks must be an integer >= 0 (0 = size by kv_pool_mb), got {fields['kv_pool_blocks']!r}"
        )
    if "kv_pool_mb" in fields:
        mb = fields["kv_pool_mb"]
        if isinstance(mb, bool) or not isinstance(mb, (int, float)) or not math.isfinite(mb) or mb < 0:
            raise ValueError(f"kv_pool_mb must be a finite number >= 0, got {mb!r}")
    if "max_context_tokens" in fields and (
        not is_int(fields["max_context_tokens"]) or fields["max_context_tokens"] < 2
    ):
        raise ValueError(f"max_context_tokens must be an integer >= 2, got {fields['max_context_tokens']!r}")
    for name in ("image_min_pixels", "image_max_pixels"):
        if name in fields and (not is_int(fields[name]) or fields[name] < 0):
            raise ValueError(f"{name} must be an integer >= 0 (0 = the checkpoint's value), got {fields[name]!r}")
    mn, mx = fields.get("image_min_pixels", 0), fields.get("image_max_pixels", 0)
    if mn and mx and mn > mx:
        raise ValueError(f"image_min_pixels {mn} is larger than image_max_pixels {mx}")
    if "sampling" in fields:
        if not isinstance(fields["sampling"], SamplingParams):
            raise ValueError(f"sampling must be a SamplingParams, got {type(fields['sampling']).__name__}")
        validate_sampling(fields["sampling"])
    if "device" in fields:
        resolve_device(fields["device"])
    if "dtype" in fields:
        resolve_dtype(fields["dtype"], torch.device("cpu"), None)
    if "model_path" in fields and not isinstance(fields["model_path"], str):
        raise ValueError(f"model_path must be a string, got {fields['model_path']!r}")
    for name in ("kernel_dir", "kernel_cache_dir"):
        if name in fields and not isinstance(fields[name], str):
            raise ValueError(f"{name} must be a string, got {fields[name]!r}")
    if fields.get("kernel_dir"):
        try:
            check_kernel_dir(fields["kernel_dir"])  # a typo in an explicit path is refused, not ignored
        except KernelSourcesNotFound as exc:
            raise ValueError(str(exc)) from None


def kv_cache_config(
    config: EngineConfig, num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device
) -> KVCacheConfig:
    """The KV cache settings an engine config implies: explicit sizes, or sized by need for the running
    request plus ``max_sessions`` kept conversations (see ``kvcache.config.plan_pool``)."""
    return KVCacheConfig(
        num_layers=num_layers,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        dtype=dtype,
        device=device,
        page_size=config.page_size,
        num_blocks=config.kv_pool_blocks or None,
        pool_mb=float(config.kv_pool_mb) or None,
        sequences=1 + config.max_sessions,
        prefix_share=float(config.kv_prefix_share),
        reserve_mb=float(config.kv_memory_reserve_mb),
        max_context_tokens=config.max_context_tokens,
        prefix_caching=config.prefix_caching and config.use_paged_attention,
        require_full_context=True,
    )
