"""Contiguous KV cache: every sequence owns one preallocated slab of ``max_context_tokens`` slots.

The baseline the paged cache is measured against (memory) and checked against (outputs). The pool
from :func:`plan_pool` is cut into slabs of one full context each; a sequence takes a slab when it is
created, so its memory cost does not depend on how long it actually gets. No prefix caching.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .attention import PagedAttentionImpl
from .base import ExtraKeys, KVCache, StaticDecodeBuffers, check_step_shapes, padded_writes
from .config import KVCacheConfig, plan_pool
from .errors import PoolExhausted
from .fused_prefill import step_attention
from .reference import masked_decode_attention
from .storage import allocate_kv_storage

_log = logging.getLogger(__name__)


@dataclass
class _Seq:
    slab: int
    length: int = 0


class ContiguousKVCache(KVCache):
    """Per-sequence contiguous storage ``(max_context, nkv, hd)`` per layer, same interface as paged."""

    supports_prefix_caching = False
    static_table_width = 1  # the slab index

    def __init__(self, config: KVCacheConfig) -> None:
        super().__init__(config, plan_pool(config, contiguous=True))
        self.num_slabs = self.plan.tokens // config.max_context_tokens
        if config.prefix_caching:
            _log.info("ContiguousKVCache: prefix caching requested but not supported; disabled")
        C, nkv, hd = config.max_context_tokens, config.num_kv_heads, config.head_dim
        # (2 = K/V, layers, slabs, max_context, nkv, hd); slab row s is sequence storage.
        self.kv_storage = allocate_kv_storage(
            (2, config.num_layers, self.num_slabs, C, nkv, hd), config.dtype, config.device
        )
        self._free: deque[int] = deque(range(self.num_slabs))
        self._seqs: dict[int, _Seq] = {}

    # -- sequences -------------------------------------------------------------------------------
    def _get(self, seq: int) -> _Seq:
        try:
            return self._seqs[seq]
        except KeyError:
            raise ValueError(f"unknown or released sequence {seq}") from None

    def new_sequence(self) -> int:
        if not self._free:
            raise PoolExhausted(
                f"no free contiguous slab: all {self.num_slabs} slabs of "
                f"{self.config.max_context_tokens} tokens are in use",
                needed_blocks=1,
                free_blocks=0,
            )
        sid = next(self._ids)
        self._seqs[sid] = _Seq(slab=self._free.popleft())
        return sid

    def length(self, seq: int) -> int:
        return self._get(seq).length

    def ensure_capacity(self, seq: int, new_len: int) -> None:
        self._get(seq)
        self._check_context(new_len)  # the slab always holds max_context_tokens

    def step(self, seq: int, num_new: int):
        s = self._get(seq)
        if num_new < 1:
            raise ValueError(f"step needs at least one new token, got {num_new}")
        self.ensure_capacity(seq, s.length + num_new)
        start = s.length
        s.length += num_new
        return _ContiguousStep(self, s.slab, start, num_new)

    def fork(self, seq: int) -> int:
        s = self._get(seq)
        child = self.new_sequence()
        c = self._seqs[child]
        self.kv_storage[:, :, c.slab, : s.length].copy_(self.kv_storage[:, :, s.slab, : s.length])
        c.length = s.length
        return child

    def truncate(self, seq: int, new_len: int) -> None:
        s = self._get(seq)
        if not 0 <= new_len <= s.length:
            raise ValueError(f"truncate to {new_len} outside 0..{s.length}")
        s.length = new_len

    def release(self, seq: int) -> None:
        s = self._seqs.pop(seq, None)
        if s is None:
            raise ValueError(f"unknown or released sequence {seq}")
        self._free.append(s.slab)

    def clear(self) -> None:
        self._seqs.clear()
        self._free = deque(range(self.num_slabs))

    def block_table(self, seq: int) -> list[int]:
        return [self._get(seq).slab]

    def set_attention_impl(self, impl: PagedAttentionImpl | None) -> None:
        if impl is not None:
            raise ValueError("the contiguous KV cache uses the torch reference attention; it takes no other")

    # -- prefix caching: not supported -----------------------------------------------------------
    def match_prefix(self, token_ids: Sequence[int], extra_keys: ExtraKeys | None = None) -> int:
        return 0

    def attach_prefix(self, seq: int, token_ids: Sequence[int], extra_keys: ExtraKeys | None = None) -> int:
        if self._get(seq).length:
            raise ValueError("attach_prefix needs an empty sequence")
        return 0

    def register_prefix(self, seq: int, token_ids: Sequence[int], extra_keys: ExtraKeys | None = None) -> int:
        self._get(seq)
        return 0

    def set_prefix_caching(self, enabled: bool) -> bool:
        if enabled:
            _log.info("ContiguousKVCache does not support prefix caching; it stays off")
        return False

    # -- static decode ---------------------------------------------------------------------------
    def prepare_static_decode(self, seq: int, buffers: StaticDecodeBuffers, row: int = 0) -> None:
        s = self._get(seq)
        self.ensure_capacity(seq, s.length + 1)
        # fill_ with host scalars launches tiny kernels, no H2D copy of pageable memory.
        buffers.slot_mapping[row].fill_(s.slab * self.config.max_context_tokens + s.length)
        buffers.kv_len[row].fill_(s.length + 1)
        buffers.block_table[row].fill_(s.slab)
        s.length += 1

    def static_decode_attention(self, buffers: StaticDecodeBuffers, width: int | None = None):
        limit = self.config.max_context_tokens
        return _ContiguousStaticDecode(self, buffers, limit if width is None else max(1, min(width, limit)))

    # -- introspection ---------------------------------------------------------------------------
    def stats(self) -> dict:
        cfg = self.config
        slab_tokens = cfg.max_context_tokens
        used = len(self._seqs)
        tokens = sum(s.length for s in self._seqs.values())
        reserved = used * slab_tokens
        return {
            "kind": "contiguous",
            "page_size": slab_tokens,
            "blocks_total": self.num_slabs,
            "blocks_used": used,
            "blocks_free": self.num_slabs - used,
            "blocks_cached": 0,
            "sequences": used,
            "tokens_stored": tokens,
            "tokens_capacity": self.num_slabs * slab_tokens,
            "internal_fragmentation": (1.0 - tokens / reserved) if reserved else 0.0,
            "kv_bytes_in_use": reserved * cfg.bytes_per_token,
            "kv_bytes_tokens": tokens * cfg.bytes_per_token,
            "pool_bytes": self.kv_storage.numel() * self.kv_storage.element_size(),
            "pool": self.plan.describe(),
            "prefix_caching": False,
            "prefix_queries": 0,
            "prefix_hit_blocks": 0,
            "prefix_miss_blocks": 0,
            "prefix_hit_tokens": 0,
        }


class _ContiguousStep:
    """StepAttention of one contiguous step: write rows ``start..start+L-1`` of the slab, attend."""

    def __init__(self, cache: ContiguousKVCache, slab: int, start: int, num_new: int) -> None:
        self._cache, self._slab, self._start, self._n = cache, slab, start, num_new

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        check_step_shapes(self._n, q, k, v, self._cache.config)
        kv = self._cache.kv_storage
        end = self._start + self._n
        kv[0, layer, self._slab, self._start : end] = k
        kv[1, layer, self._slab, self._start : end] = v
        k_all = kv[0, layer, self._slab, :end].to(q.dtype)
        v_all = kv[1, layer, self._slab, :end].to(q.dtype)
        return step_attention(q, [k_all], [v_all], self._start)


class _ContiguousStaticDecode:
    """Decode attention of ``buffers.batch`` rows reading only the static buffers (slots, lengths, slab
    indices), over the first ``width`` slots of each row's slab."""

    def __init__(self, cache: ContiguousKVCache, buffers: StaticDecodeBuffers, width: int) -> None:
        self._cache, self._buf, self._width = cache, buffers, width
        self._rows = buffers.batch

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        buf = self._buf
        check_step_shapes(self._rows, q, k, v, self._cache.config)
        kv = self._cache.kv_storage
        nkv, hd = self._cache.config.num_kv_heads, self._cache.config.head_dim
        slots = buf.slot_mapping
        if self._rows > 1:
            slots, k, v = padded_writes(slots, k, v)
        kv[0, layer].view(-1, nkv, hd).index_copy_(0, slots, k.to(kv.dtype))
        kv[1, layer].view(-1, nkv, hd).index_copy_(0, slots, v.to(kv.dtype))
        slabs = buf.block_table[:, 0].clamp(min=0).long()  # (B,); a padding row may never have had one
        k_all = kv[0, layer, :, : self._width].index_select(0, slabs).to(q.dtype)  # (B, width, nkv, hd)
        v_all = kv[1, layer, :, : self._width].index_select(0, slabs).to(q.dtype)
        return masked_decode_attention(q, k_all, v_all, buf.kv_len)
