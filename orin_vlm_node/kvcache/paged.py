"""Paged KV cache: a shared pool of fixed-size blocks, one block table per sequence for all layers.

Storage is one tensor ``(2, num_layers, num_blocks, page_size, num_kv_heads, head_dim)`` (K/V, layer,
block, offset); a sequence's slot ``i`` lives in block ``table[i // page_size]`` at offset ``i % page_size``.
A step (``step`` / ``prepare_static_decode``) first counts the blocks it needs and raises PoolExhausted
before anything changes, then allocates pages and copies shared blocks it writes into, uploads the changed
table entries and computes the slot mapping on the device, all before a kernel runs: graphs replay kernels
only (docs/architecture.md, "Paging under CUDA graphs"). The StepAttention objects are in :mod:`.paged_step`.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from ..transfer import host_to_device
from .attention import PagedAttentionImpl, StepBlocks, TorchPagedAttention, block_runs
from .base import ExtraKeys, KVCache, StaticDecodeBuffers
from .block_pool import BlockKey, BlockPool
from .config import KVCacheConfig, plan_pool
from .errors import PoolExhausted
from .paged_step import PagedLayers, PagedStaticDecode, PagedStep
from .prefix_hash import block_extras, block_hash, normalize_extra_keys, normalize_tokens
from .prefix_lookup import find_prefix
from .storage import allocate_kv_storage

_log = logging.getLogger(__name__)


@dataclass
class _Seq:
    dev_table: torch.Tensor  # (max_blocks_per_sequence,) int32 on the cache device, -1 = no block
    table: list[int] = field(default_factory=list)  # host copy, authoritative
    length: int = 0
    hashes: list[bytes] = field(default_factory=list)  # chained keys of its leading full blocks
    dirty: set[int] = field(default_factory=set)  # table indices not yet uploaded to dev_table
    runs: tuple[tuple[int, int], ...] | None = None  # block_runs(table), None after any table change


class PagedKVCache(KVCache):
    """Block pool + per-sequence block tables + prefix cache + copy-on-write (see module docstring)."""

    supports_prefix_caching = True

    def __init__(self, config: KVCacheConfig, attention_impl: PagedAttentionImpl | None = None) -> None:
        super().__init__(config, plan_pool(config))
        self.page_size = config.page_size
        self.num_blocks = self.plan.num_blocks
        self.pool = BlockPool(self.num_blocks)
        self.static_table_width = config.max_blocks_per_sequence
        self.attention_impl: PagedAttentionImpl = attention_impl or TorchPagedAttention()
        self._prefix_enabled = config.prefix_caching
        shape = (2, config.num_layers, self.num_blocks, self.page_size, config.num_kv_heads, config.head_dim)
        # Zero-filled, not empty: a masked slot contributes weight 0, and 0 * NaN-garbage would be NaN.
        self.kv_storage = allocate_kv_storage(shape, config.dtype, config.device)
        # Per-layer views made once: indexing the storage again for every layer of every step costs dispatch.
        self._pools = [(self.kv_storage[0, layer], self.kv_storage[1, layer]) for layer in range(config.num_layers)]
        self._seqs: dict[int, _Seq] = {}
        self._prefix_queries = 0
        self._prefix_hit_blocks = 0
        self._prefix_miss_blocks = 0
        self._prefix_hit_tokens = 0  # full blocks and the shared heads of partial ones

    # -- storage views ---------------------------------------------------------------------------
    def k_pool(self, layer: int) -> torch.Tensor:
        """(num_blocks, page_size, nkv, hd) keys of one layer (a view)."""
        return self._pools[layer][0]

    def v_pool(self, layer: int) -> torch.Tensor:
        return self._pools[layer][1]

    def pools(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(K, V) pools of one layer, each (num_blocks, page_size, nkv, hd)."""
        return self._pools[layer]

    def set_attention_impl(self, impl: PagedAttentionImpl | None) -> None:
        self.attention_impl = impl or TorchPagedAttention()

    def _layers(self) -> PagedLayers:
        """What a step reads of this cache (a step's attention object takes it, never the cache)."""
        return PagedLayers(self._pools, self.attention_impl, self.config)

    # -- sequences -------------------------------------------------------------------------------
    def _get(self, seq: int) -> _Seq:
        try:
            return self._seqs[seq]
        except KeyError:
            raise ValueError(f"unknown or released sequence {seq}") from None

    def _new_state(self) -> tuple[int, _Seq]:
        w = self.config.max_blocks_per_sequence
        dev_table = torch.full((w,), -1, dtype=torch.int32, device=self.config.device)
        sid = next(self._ids)
        state = _Seq(dev_table=dev_table)
        self._seqs[sid] = state
        return sid, state

    def new_sequence(self) -> int:
        return self._new_state()[0]

    def length(self, seq: int) -> int:
        return self._get(seq).length

    def block_table(self, seq: int) -> list[int]:
        return list(self._get(seq).table)

    def _new_pages(self, s: _Seq, new_len: int) -> int:
        return max(0, -(-new_len // self.page_size) - len(s.table))

    def _plan_growth(self, s: _Seq, new_len: int) -> tuple[list[int], list[int]]:
        """Existing table indices the write of slots ``length..new_len-1`` touches: (to unkey, to copy).

        A block is written in place only if this table alone holds it and it is not in the prefix
        index; a cached block held by nobody else just loses its key, a shared one is copied first.
        """
        unkey, copy = [], []
        if new_len <= s.length:
            return unkey, copy
        first = s.length // self.page_size
        last = min(len(s.table), -(-new_len // self.page_size))
        for idx in range(first, last):
            block = s.table[idx]
            if self.pool.refcount(block) > 1:
                copy.append(idx)
            elif self.pool.key(block) is not None:
                unkey.append(idx)
        return unkey, copy

    def _grow(self, s: _Seq, new_len: int) -> None:
        """Steps 1-2 of the module docstring: check, then allocate and copy-on-write."""
        self._check_context(new_len)
        unkey, copy = self._plan_growth(s, new_len)
        new_pages = self._new_pages(s, new_len)
        needed = new_pages + len(copy)
        if needed > self.pool.num_free:
            raise PoolExhausted(
                f"KV pool exhausted: growing a sequence from {s.length} to {new_len} tokens needs {needed} "
                f"blocks ({new_pages} new, {len(copy)} copy-on-write), {self.pool.num_free} of "
                f"{self.num_blocks} free",
                needed_blocks=needed,
                free_blocks=self.pool.num_free,
            )
        for idx in unkey:
            self.pool.drop_key(s.table[idx])
        if copy:
            fresh = self.pool.allocate(len(copy))
            src = torch.tensor([s.table[i] for i in copy], dtype=torch.long, device=self.kv_storage.device)
            dst = torch.tensor(fresh, dtype=torch.long, device=self.kv_storage.device)
            self.kv_storage[:, :, dst] = self.kv_storage[:, :, src]  # all layers, K and V, in one copy
            for idx, block in zip(copy, fresh, strict=True):
                self.pool.decref(s.table[idx])
                s.table[idx] = block
                s.dirty.add(idx)
        if new_pages:
            start = len(s.table)
            s.table.extend(self.pool.allocate(new_pages))
            s.dirty.update(range(start, len(s.table)))

    def _sync(self, s: _Seq) -> None:
        """Step 3: upload changed table entries (a small indexed H2D write queued without waiting for the
        device, so a new page does not stall an overlapped decode; never during a graph capture)."""
        if not s.dirty:
            return
        s.runs = None
        idx = sorted(s.dirty)
        vals = [s.table[i] if i < len(s.table) else -1 for i in idx]
        dev = s.dev_table.device
        s.dev_table[host_to_device(idx, dev)] = host_to_device(vals, dev, torch.int32)
        s.dirty.clear()

    def ensure_capacity(self, seq: int, new_len: int) -> None:
        s = self._get(seq)
        self._grow(s, new_len)
        self._sync(s)

    def step(self, seq: int, num_new: int) -> PagedStep:
        s = self._get(seq)
        if num_new < 1:
            raise ValueError(f"step needs at least one new token, got {num_new}")
        start, new_len = s.length, s.length + num_new
        self._grow(s, new_len)
        s.length = new_len
        self._sync(s)
        if s.runs is None:  # the table changed (a new page, copy-on-write): once per page, not per token
            s.runs = block_runs(s.table)
        blocks = StepBlocks(s.dev_table, s.runs)
        return PagedStep(self._layers(), self._slot_mapping(s, start, new_len), blocks, start, new_len, num_new)

    def _slot_mapping(self, s: _Seq, start: int, end: int) -> torch.Tensor:
        """Step 4: physical slots of positions ``start..end-1`` as an (L,) int64 device tensor.

        Computed on the host from the authoritative table (a few vectorised CPU ops over the pages this
        step touches) and sent in one small copy: cheaper than several tiny device kernels per step.
        """
        p = self.page_size
        if end - start == 1:  # a decode token: one slot, no tensor math
            slot = s.table[start // p] * p + start % p
            return torch.tensor([slot], dtype=torch.int64, device=s.dev_table.device)
        first = start // p
        positions = torch.arange(start, end, dtype=torch.int64)
        pages = torch.tensor(s.table[first : -(-end // p)], dtype=torch.int64)
        slots = pages[positions // p - first] * p + positions % p
        return slots.to(s.dev_table.device, non_blocking=True)

    def fork(self, seq: int) -> int:
        s = self._get(seq)
        cid, child = self._new_state()
        shared = s.table[: -(-s.length // self.page_size)]  # pages reserved past length stay the parent's
        for block in shared:
            self.pool.incref(block)
        child.table = list(shared)
        child.length = s.length
        child.hashes = list(s.hashes)
        child.dirty = set(range(len(shared)))
        self._sync(child)
        return cid

    def truncate(self, seq: int, new_len: int) -> None:
        s = self._get(seq)
        if not 0 <= new_len <= s.length:
            raise ValueError(f"truncate to {new_len} outside 0..{s.length}")
        keep = -(-new_len // self.page_size)
        for idx in range(len(s.table) - 1, keep - 1, -1):
            self.pool.decref(s.table.pop())
            s.dirty.add(idx)
        s.length = new_len
        del s.hashes[new_len // self.page_size :]
        self._sync(s)

    def release(self, seq: int) -> None:
        s = self._seqs.pop(seq, None)
        if s is None:
            raise ValueError(f"unknown or released sequence {seq}")
        # Tail first: in the cached LRU the tail blocks are then evicted before the shared prefix heads.
        for block in reversed(s.table):
            self.pool.decref(block)

    def clear(self) -> None:
        self._seqs.clear()
        self.pool.reset()

    # -- prefix caching --------------------------------------------------------------------------
    def set_prefix_caching(self, enabled: bool) -> bool:
        self._prefix_enabled = bool(enabled)
        if not enabled:
            self.pool.drop_all_keys()
            for s in self._seqs.values():
                s.hashes.clear()
        return self._prefix_enabled

    def match_prefix(self, token_ids: Sequence[int], extra_keys: ExtraKeys | None = None) -> int:
        if not self._prefix_enabled:
            return 0
        tokens = normalize_tokens(token_ids)
        hits, _, partial = find_prefix(self.pool, self.page_size, tokens, normalize_extra_keys(extra_keys, len(tokens)))
        return len(hits) * self.page_size + (partial[1] if partial else 0)

    def attach_prefix(self, seq: int, token_ids: Sequence[int], extra_keys: ExtraKeys | None = None) -> int:
        s = self._get(seq)
        if s.length or s.table:
            raise ValueError(f"attach_prefix needs an empty sequence, sequence {seq} holds {s.length} tokens")
        tokens = normalize_tokens(token_ids)
        extras = normalize_extra_keys(extra_keys, len(tokens))
        if not self._prefix_enabled:
            return 0
        self._check_context(len(tokens))
        hits, max_full, partial = find_prefix(self.pool, self.page_size, tokens, extras)
        self._prefix_queries += 1
        self._prefix_hit_blocks += len(hits)
        self._prefix_miss_blocks += max_full - len(hits)
        for block, digest in hits:
            self.pool.incref(block)
            s.table.append(block)
            s.hashes.append(digest)
        s.length = len(hits) * self.page_size
        if partial is not None:  # the head of a cached block; writing the rest copies or unkeys it first
            block, shared = partial
            self.pool.incref(block)
            s.table.append(block)
            s.length += shared
        s.dirty.update(range(len(s.table)))
        self._prefix_hit_tokens += s.length
        self._sync(s)
        return s.length

    def register_prefix(self, seq: int, token_ids: Sequence[int], extra_keys: ExtraKeys | None = None) -> int:
        s = self._get(seq)
        tokens = normalize_tokens(token_ids)
        extras = normalize_extra_keys(extra_keys, len(tokens))
        if len(tokens) > s.length:
            raise ValueError(f"register_prefix got {len(tokens)} tokens but sequence {seq} holds KV for {s.length}")
        if not self._prefix_enabled:
            return 0
        p = self.page_size
        parent = s.hashes[-1] if s.hashes else None
        registered = 0
        for i in range(len(s.hashes), len(tokens) // p):
            blk = tokens[i * p : (i + 1) * p]
            ex = block_extras(extras, i, p)
            digest = block_hash(parent, blk, ex)
            block = s.table[i]
            # Same content already cached in another block (computed concurrently): keep that one.
            if self.pool.lookup(digest) is None and self.pool.key(block) is None:
                self.pool.set_key(block, BlockKey(digest=digest, parent=parent, tokens=blk, extras=ex))
                registered += 1
            s.hashes.append(digest)
            parent = digest
        return registered

    # -- static (CUDA-graph) decode --------------------------------------------------------------
    def prepare_static_decode(self, seq: int, buffers: StaticDecodeBuffers, row: int = 0) -> None:
        s = self._get(seq)
        pos = s.length
        self._grow(s, pos + 1)
        s.length = pos + 1
        self._sync(s)
        # fill_ with host scalars launches tiny kernels, no H2D copy of pageable memory.
        buffers.slot_mapping[row].fill_(s.table[pos // self.page_size] * self.page_size + pos % self.page_size)
        buffers.kv_len[row].fill_(pos + 1)
        buffers.block_table[row].copy_(s.dev_table)  # device-to-device, already up to date

    def static_decode_attention(self, buffers: StaticDecodeBuffers, width: int | None = None) -> PagedStaticDecode:
        blocks = self.config.max_blocks_per_sequence
        if width is not None:
            blocks = min(blocks, max(1, -(-width // self.page_size)))
        return PagedStaticDecode(self._layers(), buffers, blocks)

    # -- introspection ---------------------------------------------------------------------------
    def stats(self) -> dict:
        p = self.page_size
        fill: dict[int, int] = {}
        for s in self._seqs.values():
            for idx, block in enumerate(s.table):
                n = min(p, max(0, s.length - idx * p))
                if n > fill.get(block, -1):
                    fill[block] = n
        used = len(fill)
        tokens = sum(fill.values())
        bpt = self.config.bytes_per_token
        lookups = self._prefix_hit_blocks + self._prefix_miss_blocks
        return {
            "kind": "paged",
            "page_size": p,
            "blocks_total": self.num_blocks,
            "blocks_used": used,
            "blocks_free": self.pool.num_free,
            "blocks_cached": self.pool.num_cached,
            "blocks_cached_free": self.pool.num_cached_free,
            "sequences": len(self._seqs),
            "tokens_stored": tokens,
            "tokens_capacity": self.num_blocks * p,
            "internal_fragmentation": (1.0 - tokens / (used * p)) if used else 0.0,
            "kv_bytes_in_use": used * self.config.bytes_per_block,
            "kv_bytes_tokens": tokens * bpt,
            "pool_bytes": self.kv_storage.numel() * self.kv_storage.element_size(),
            "pool": self.plan.describe(),
            "prefix_caching": self._prefix_enabled,
            "prefix_queries": self._prefix_queries,
            "prefix_hit_blocks": self._prefix_hit_blocks,
            "prefix_miss_blocks": self._prefix_miss_blocks,
            "prefix_hit_tokens": self._prefix_hit_tokens,
            "prefix_hit_rate": self._prefix_hit_blocks / lookups if lookups else 0.0,
            "evictions": self.pool.evictions,
        }
