"""Block pool bookkeeping: free list, refcounts and the prefix-cache index (no tensors here).

Every block is in exactly one state:

* free      refcount 0, no content key; on the ``_free`` stack,
* cached    refcount 0 with a content key; in the ``_cached_free`` LRU (reusable by a prefix hit, or
            evicted, oldest first, when the free deque is empty),
* used      refcount > 0 (held by that many block tables); may carry a content key.

All operations are O(1) per block (list / OrderedDict / dict), so the engine can call them per step.

More in docs/modules.md, ``orin_vlm_node/kvcache/block_pool.py``.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from .errors import KVCacheError, PoolExhausted
from .prefix_hash import BlockExtras


@dataclass(frozen=True)
class BlockKey:
    """What a cached block holds: its chained key and the content it was computed from (for verification)."""

    digest: bytes
    parent: bytes | None
    tokens: tuple[int, ...]
    extras: BlockExtras


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.evictions = 0
        self.reset()

    def reset(self) -> None:
        """Everything free, nothing cached."""
        self._ref = [0] * self.num_blocks
        self._free: list[int] = list(range(self.num_blocks - 1, -1, -1))  # a stack: pop() gives 0, 1, 2, ...
        self._cached_free: OrderedDict[int, None] = OrderedDict()
        self._key: list[BlockKey | None] = [None] * self.num_blocks
        self._by_digest: dict[bytes, int] = {}
        self._children: dict[bytes | None, set[int]] = {}  # parent digest -> cached blocks that follow it

    # -- queries ---------------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        """Blocks an allocation may take (free + cached-but-unreferenced)."""
        return len(self._free) + len(self._cached_free)

    @property
    def num_cached(self) -> int:
        return len(self._by_digest)

    @property
    def num_cached_free(self) -> int:
        return len(self._cached_free)

    def refcount(self, block: int) -> int:
        return self._ref[block]

    def key(self, block: int) -> BlockKey | None:
        return self._key[block]

    def lookup(self, digest: bytes) -> int | None:
        return self._by_digest.get(digest)

    def children(self, parent: bytes | None) -> tuple[int, ...]:
        """Cached blocks whose key follows ``parent`` (None: first blocks of a sequence), for a prompt that
        shares only the head of such a block."""
        return tuple(self._children.get(parent, ()))

    def free_blocks(self) -> list[int]:
        """Snapshot of unreferenced blocks (free and cached-free), for checks and tests."""
        return self._free[::-1] + list(self._cached_free)

    # -- refcounts -------------------------------------------------------------------------------
    def allocate(self, n: int) -> list[int]:
        """``n`` fresh blocks with refcount 1; PoolExhausted (nothing changed) if fewer are free."""
        if n > self.num_free:
            raise PoolExhausted(
                f"KV pool exhausted: need {n} blocks, {self.num_free} of {self.num_blocks} free",
                needed_blocks=n,
                free_blocks=self.num_free,
            )
        out = []
        for _ in range(n):
            if self._free:
                block = self._free.pop()
            else:  # evict the least recently released cached block
                block, _ = self._cached_free.popitem(last=False)
                self.drop_key(block)
                self.evictions += 1
            self._ref[block] = 1
            out.append(block)
        return out

    def incref(self, block: int) -> None:
        """One more table holds ``block`` (fork, or a prefix hit reviving a cached block)."""
        if self._ref[block] == 0:
            if block not in self._cached_free:
                raise KVCacheError(f"incref of free uncached block {block}: it holds no valid KV")
            del self._cached_free[block]
        self._ref[block] += 1

    def decref(self, block: int) -> None:
        ref = self._ref[block]
        if ref <= 0:
            raise KVCacheError(f"decref of unreferenced block {block}")
        self._ref[block] = ref - 1
        if ref == 1:
            if self._key[block] is not None:
                self._cached_free[block] = None  # most recently released: evicted last
            else:
                self._free.append(block)

    # -- content keys ----------------------------------------------------------------------------
    def set_key(self, block: int, key: BlockKey) -> None:
        """Make a used, full block findable by its content key."""
        if self._ref[block] <= 0:
            raise KVCacheError(f"cannot cache unreferenced block {block}")
        if key.digest in self._by_digest or self._key[block] is not None:
            raise KVCacheError(f"block {block} or its key is already cached")
        self._key[block] = key
        self._by_digest[key.digest] = block
        self._children.setdefault(key.parent, set()).add(block)

    def drop_key(self, block: int) -> None:
        """Forget the block's content key (before it is overwritten); an unreferenced block becomes free."""
        key = self._key[block]
        if key is None:
            return
        self._key[block] = None
        if self._by_digest.get(key.digest) == block:
            del self._by_digest[key.digest]
        siblings = self._children[key.parent]
        siblings.discard(block)
        if not siblings:
            del self._children[key.parent]
        if block in self._cached_free:
            del self._cached_free[block]
            self._free.append(block)

    def drop_all_keys(self) -> None:
        for block in list(self._by_digest.values()):
            self.drop_key(block)
