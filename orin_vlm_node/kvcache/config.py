"""KV-cache configuration and pool sizing.

One dataclass holds every setting of the cache; :func:`plan_pool` turns it into a concrete number of
blocks and says why. On a Jetson the KV pool lives in the robot's RAM, next to the camera drivers and
everything else, so the automatic size is what the workload needs, never a share of whatever is free:
blocks for ``max_context_tokens`` times the sequences held at once (the running request plus the
conversations kept), plus a share for cached prefixes, capped by the free memory minus a reserve for the
rest of the system. An explicit size (blocks or MB) is taken as given, but refused when it is larger
than the memory free for it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .. import settings
from .memory import device_memory

MAX_PAGE_SIZE = settings.BY_NAME["page_size"].max


def check_page_size(page_size: object) -> None:
    """A block holds a power-of-two number of tokens (slot -> block is a shift, tables stay small)."""
    ps = page_size
    if not isinstance(ps, int) or isinstance(ps, bool) or ps < 1 or ps > MAX_PAGE_SIZE or ps & (ps - 1):
        raise ValueError(f"page_size must be a power of two (1, 2, 4, ..., {MAX_PAGE_SIZE}), got {ps!r}")


@dataclass(frozen=True)
class KVCacheConfig:
    """Shape, placement and sizing of a KV cache (paged or contiguous).

    The pool's settings keep the names of the settings schema. Pool size, first match wins: ``kv_pool_blocks``
    (> 0), ``kv_pool_mb`` (> 0), else automatic: ``sequences`` full ``max_context_tokens`` sequences plus
    ``kv_prefix_share`` of that for cached prefixes (paged with prefix caching only), capped by the device's
    free memory (:mod:`.memory`) minus ``kv_memory_reserve_mb``.
    ``require_full_context``: refuse a pool that cannot hold one ``max_context_tokens`` sequence (the
    engine sets it; the cache itself can run smaller pools, e.g. to test exhaustion).
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype = torch.float32
    device: str | torch.device = "cpu"
    page_size: int = 16
    kv_pool_blocks: int | None = None
    kv_pool_mb: float | None = None
    sequences: int = 1
    kv_prefix_share: float = 0.0
    kv_memory_reserve_mb: float = 0.0
    max_context_tokens: int = 4096
    prefix_caching: bool = True
    require_full_context: bool = False

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "max_context_tokens", "sequences"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"KVCacheConfig.{name} must be a positive int, got {value!r}")
        check_page_size(self.page_size)
        if not isinstance(self.dtype, torch.dtype) or not self.dtype.is_floating_point:
            raise ValueError(f"KVCacheConfig.dtype must be a floating torch.dtype, got {self.dtype!r}")
        blocks, mb = self.kv_pool_blocks, self.kv_pool_mb
        if blocks is not None and (not isinstance(blocks, int) or blocks < 0):
            raise ValueError(f"kv_pool_blocks must be a non-negative int, got {blocks!r}")
        if mb is not None and not (mb >= 0 and math.isfinite(mb)):
            raise ValueError(f"kv_pool_mb must be a non-negative finite number, got {mb!r}")
        for name in ("kv_prefix_share", "kv_memory_reserve_mb"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < math.inf:
                raise ValueError(f"KVCacheConfig.{name} must be a finite number >= 0, got {value!r}")
        torch.device(self.device)  # raises on a malformed device string

    @property
    def torch_device(self) -> torch.device:
        return torch.device(self.device)

    @property
    def bytes_per_token(self) -> int:
        """K and V of one token over all layers."""
        elem = torch.empty((), dtype=self.dtype, device="meta").element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * elem

    @property
    def bytes_per_block(self) -> int:
        return self.page_size * self.bytes_per_token

    @property
    def max_blocks_per_sequence(self) -> int:
        return -(-self.max_context_tokens // self.page_size)


@dataclass(frozen=True)
class PoolPlan:
    """The pool size :func:`plan_pool` chose, and why (``reason`` is one line for logs and diagnostics)."""

    num_blocks: int
    page_size: int
    bytes_per_block: int
    source: str  # "kv_pool_blocks" | "kv_pool_mb" | "auto" | "auto, capped by free memory"
    reason: str = ""

    @property
    def tokens(self) -> int:
        return self.num_blocks * self.page_size

    @property
    def bytes(self) -> int:
        return self.num_blocks * self.bytes_per_block

    def describe(self) -> str:
        return (
            f"{self.num_blocks} blocks x {self.page_size} tokens = {self.tokens} tokens, "
            f"{self.bytes / 2**20:.1f} MB ({self.reason or self.source})"
        )


def _mb(n_bytes: float) -> str:
    return f"{n_bytes / 2**20:.0f} MB"


def _auto_blocks(config: KVCacheConfig, contiguous: bool, released_bytes: int) -> tuple[int, str, str]:
    """Blocks the workload needs, capped by free memory: (blocks, source, reason)."""
    bpb = config.bytes_per_block
    context = config.max_blocks_per_sequence
    need = context * config.sequences
    share = math.ceil(need * config.kv_prefix_share) if config.prefix_caching and not contiguous else 0
    why = f"auto: {config.sequences} x {config.max_context_tokens}-token context"
    why += f" + {config.kv_prefix_share:.0%} prefix-cache share" if share else ""
    if config.torch_device.type == "meta":  # shape-only caches (tests, planning): nothing to cap by
        return need + share, "auto", why
    memory = device_memory(config.torch_device)
    budget = memory.free_bytes + released_bytes - int(config.kv_memory_reserve_mb * 2**20)
    if (need + share) * bpb <= budget:
        return need + share, "auto", why
    capped = max(0, budget) // bpb
    return (
        capped,
        "auto, capped by free memory",
        f"{why} needs {_mb((need + share) * bpb)}, capped to {memory.describe()} - reserve "
        f"{config.kv_memory_reserve_mb:g} MB",
    )


def plan_pool(config: KVCacheConfig, contiguous: bool = False, released_bytes: int = 0) -> PoolPlan:
    """Choose the pool size in blocks (``contiguous``: for :class:`ContiguousKVCache` slabs).

    ``released_bytes``: memory that will be freed before this pool is allocated (the pool it replaces),
    counted as free. Raises ValueError, with the numbers, when an explicit size does not fit the free
    memory; when a paged pool could not hold 2 blocks (a pool that small would thrash on every page
    boundary and usually means a unit mistake, e.g. kv_pool_mb given in GB); when a contiguous pool cannot
    hold one ``max_context_tokens`` slab; or, with ``require_full_context``, when a paged pool cannot hold
    one ``max_context_tokens`` sequence.
    """
    min_blocks = 1 if contiguous else 2
    bpb = config.bytes_per_block
    if config.kv_pool_blocks:
        num_blocks, source, reason = config.kv_pool_blocks, "kv_pool_blocks", f"kv_pool_blocks={config.kv_pool_blocks}"
    elif config.kv_pool_mb:
        num_blocks, source = int(config.kv_pool_mb * 2**20) // bpb, "kv_pool_mb"
        reason = f"kv_pool_mb={config.kv_pool_mb:g}"
    else:
        num_blocks, source, reason = _auto_blocks(config, contiguous, released_bytes)
    plan = PoolPlan(
        num_blocks=num_blocks, page_size=config.page_size, bytes_per_block=bpb, source=source, reason=reason
    )
    if source in ("kv_pool_blocks", "kv_pool_mb") and config.torch_device.type != "meta":
        memory = device_memory(config.torch_device)
        if plan.bytes > memory.free_bytes + released_bytes:
            raise ValueError(
                f"KV pool of {_mb(plan.bytes)} ({reason}) does not fit: {memory.describe()}"
                + (f", {_mb(released_bytes)} more once the current pool is freed" if released_bytes else "")
            )
    if num_blocks < min_blocks:
        raise ValueError(
            f"KV pool too small: {plan.describe()}; it must hold at least {min_blocks} blocks "
            f"({min_blocks * bpb / 2**20:.2f} MB at {bpb} bytes per block)"
        )
    if (contiguous or config.require_full_context) and plan.tokens < config.max_context_tokens:
        what = "slab of the contiguous cache" if contiguous else "sequence"
        raise ValueError(
            f"KV pool too small: {plan.describe()} cannot hold one max_context_tokens="
            f"{config.max_context_tokens} {what}; lower max_context_tokens or enlarge the pool"
        )
    return plan
