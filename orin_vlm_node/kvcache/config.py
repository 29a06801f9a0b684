"""KV-cache configuration and pool sizing.

One dataclass holds every setting of the cache; :func:`plan_pool` turns it into a concrete number of
blocks. Sizing is explicit so a node on an 8 GB Orin (CPU and GPU share the same DRAM) does not grab
memory it needs elsewhere: the operator gives blocks, megabytes, or a fraction of what is free now.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch

_log = logging.getLogger(__name__)

MAX_PAGE_SIZE = 256


@dataclass(frozen=True)
class KVCacheConfig:
    """Shape, placement and sizing of a KV cache (paged or contiguous).

    Pool size, first match wins: ``num_blocks`` (> 0), ``pool_mb`` (> 0), ``memory_fraction`` (> 0, of
    the device memory free right now: ``torch.cuda.mem_get_info`` on CUDA, ``MemAvailable`` of
    /proc/meminfo on CPU); none set: exactly enough blocks for one ``max_context_tokens`` sequence.
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype = torch.float32
    device: str | torch.device = "cpu"
    page_size: int = 16
    num_blocks: int | None = None
    pool_mb: float | None = None
    memory_fraction: float | None = None
    max_context_tokens: int = 4096
    prefix_caching: bool = True

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "max_context_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"KVCacheConfig.{name} must be a positive int, got {value!r}")
        ps = self.page_size
        if not isinstance(ps, int) or isinstance(ps, bool) or ps < 1 or ps > MAX_PAGE_SIZE or ps & (ps - 1):
            raise ValueError(f"page_size must be a power of two in 1..{MAX_PAGE_SIZE}, got {ps!r}")
        if not isinstance(self.dtype, torch.dtype) or not self.dtype.is_floating_point:
            raise ValueError(f"KVCacheConfig.dtype must be a floating torch.dtype, got {self.dtype!r}")
        if self.num_blocks is not None and (not isinstance(self.num_blocks, int) or self.num_blocks < 0):
            raise ValueError(f"num_blocks must be a non-negative int, got {self.num_blocks!r}")
        if self.pool_mb is not None and not (self.pool_mb >= 0 and math.isfinite(self.pool_mb)):
            raise ValueError(f"pool_mb must be a non-negative finite number, got {self.pool_mb!r}")
        if self.memory_fraction is not None and not (0.0 <= self.memory_fraction <= 1.0):
            raise ValueError(f"memory_fraction must be in [0, 1], got {self.memory_fraction!r}")
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
    """The pool size :func:`plan_pool` chose, and why."""

    num_blocks: int
    page_size: int
    bytes_per_block: int
    source: str  # "num_blocks" | "pool_mb" | "memory_fraction" | "max_context"

    @property
    def tokens(self) -> int:
        return self.num_blocks * self.page_size

    @property
    def bytes(self) -> int:
        return self.num_blocks * self.bytes_per_block

    def describe(self) -> str:
        return (
            f"{self.num_blocks} blocks x {self.page_size} tokens = {self.tokens} tokens, "
            f"{self.bytes / 2**20:.1f} MB (sized by {self.source})"
        )


def available_memory_bytes(device: torch.device) -> int:
    """Bytes the pool may still take on ``device``: free CUDA memory, or MemAvailable on CPU."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    if device.type == "cpu":
        try:
            with open("/proc/meminfo", encoding="ascii") as f:
                for line in f:
                    if line.startswith("MemAvailable:"):
                        return int(line.split()[1]) * 1024  # the value is in kB
        except OSError as exc:
            raise ValueError(f"cannot read /proc/meminfo to size the KV pool by memory_fraction: {exc}") from exc
        raise ValueError("/proc/meminfo has no MemAvailable line; size the KV pool by num_blocks or pool_mb")
    raise ValueError(f"memory_fraction sizing is not supported on device {device}; use num_blocks or pool_mb")


def plan_pool(config: KVCacheConfig, min_blocks: int = 2) -> PoolPlan:
    """Choose the pool size in blocks; log it; warn if it is smaller than one full context.

    Raises ValueError when the pool could not hold ``min_blocks`` blocks (a pool that small would
    thrash on every page boundary and usually means a unit mistake, e.g. pool_mb given in GB).
    """
    bpb = config.bytes_per_block
    if config.num_blocks:
        num_blocks, source = config.num_blocks, "num_blocks"
    elif config.pool_mb:
        num_blocks, source = int(config.pool_mb * 2**20) // bpb, "pool_mb"
    elif config.memory_fraction:
        free = available_memory_bytes(config.torch_device)
        num_blocks, source = int(free * config.memory_fraction) // bpb, "memory_fraction"
    else:
        num_blocks, source = config.max_blocks_per_sequence, "max_context"
    plan = PoolPlan(num_blocks=num_blocks, page_size=config.page_size, bytes_per_block=bpb, source=source)
    if num_blocks < min_blocks:
        raise ValueError(
            f"KV pool too small: {plan.describe()}; it must hold at least {min_blocks} blocks "
            f"({min_blocks * bpb / 2**20:.2f} MB at {bpb} bytes per block)"
        )
    _log.info("KV pool: %s", plan.describe())
    if plan.tokens < config.max_context_tokens:
        _log.warning(
            "KV pool holds %d tokens, fewer than max_context_tokens=%d: long conversations will hit PoolExhausted",
            plan.tokens,
            config.max_context_tokens,
        )
    return plan
