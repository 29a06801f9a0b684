"""The StepAttention objects of the paged cache: what the model calls, layer by layer, during one step.

``PagedStep`` (prefill and the dynamic decode step) writes the step's K/V to its slots and attends over the
sequence's table; ``PagedStaticDecode`` (the static decode step a CUDA graph captures) reads the slot, the
length and the table row only from the fixed :class:`~.base.StaticDecodeBuffers`, over a fixed width.
Both leave the tensor work to the cache's :class:`~.attention.PagedAttentionImpl` (torch or the kernels).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .attention import StepBlocks
from .base import StaticDecodeBuffers, check_step_shapes

if TYPE_CHECKING:
    from .paged import PagedKVCache


class PagedStep:
    """StepAttention of one paged step; valid until the sequence is next changed (step/fork/truncate)."""

    def __init__(
        self, cache: PagedKVCache, slot_mapping: torch.Tensor, blocks: StepBlocks, q_start: int, kv_len: int, n: int
    ) -> None:
        self._cache = cache
        self.slot_mapping = slot_mapping  # (L,) int64
        self._blocks = blocks
        self.q_start = q_start
        self.kv_len = kv_len
        self._n = n

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        cache = self._cache
        check_step_shapes(self._n, q, k, v, cache.config)
        kp, vp = cache.pools(layer)
        impl = cache.attention_impl
        impl.write_kv(kp, vp, k, v, self.slot_mapping)
        return impl.attend(q, kp, vp, self._blocks, self.q_start, self.kv_len)


class PagedStaticDecode:
    """Decode StepAttention reading slot, kv_len and the first ``blocks`` table entries from the static
    buffers only (a prefix view of the row: the same tensor whatever the sequence does)."""

    def __init__(self, cache: PagedKVCache, buffers: StaticDecodeBuffers, blocks: int) -> None:
        self._cache, self._buf = cache, buffers
        self._table = buffers.block_table[:blocks]

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        cache, buf = self._cache, self._buf
        check_step_shapes(1, q, k, v, cache.config)
        kp, vp = cache.pools(layer)
        cache.attention_impl.write_kv(kp, vp, k, v, buf.slot_mapping)
        return cache.attention_impl.attend_decode(q, kp, vp, self._table, buf.kv_len)
