"""The StepAttention objects of the paged cache: what the model calls, layer by layer, during one step.

``PagedStep`` (prefill and the dynamic decode step) writes the step's K/V to its slots and attends over the
sequence's table; ``PagedStaticDecode`` (the static decode step a CUDA graph captures) reads the slots, the
lengths and the table rows of a batch only from the fixed :class:`~.base.StaticDecodeBuffers`, over a fixed
width. Both leave the tensor work to the cache's :class:`~.attention.PagedAttentionImpl` (torch or the kernels).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .attention import StepBlocks
from .base import StaticDecodeBuffers, check_step_shapes, padded_writes
from .interface import KVSink

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
    """Decode StepAttention of ``buffers.batch`` rows reading slots, lengths and table rows from the static
    buffers only; a row's sequence uses at most the first ``blocks`` entries of its table row (the width
    of the step's context bucket)."""

    def __init__(self, cache: PagedKVCache, buffers: StaticDecodeBuffers, blocks: int) -> None:
        self._cache, self._buf, self._blocks = cache, buffers, blocks
        self._rows = buffers.batch

    def kv_sink(self, layer: int, dtype: torch.dtype) -> KVSink | None:
        """The layer's pools and the step's slots, for a producer of rows of ``dtype`` (None: the pools hold
        another dtype, so the rows must be converted on the way in by ``__call__``)."""
        kp, vp = self._cache.pools(layer)
        return KVSink(kp, vp, self._buf.slot_mapping) if kp.dtype == dtype else None

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None) -> torch.Tensor:
        """The step's attention for ``layer``; ``k = v = None``: the caller stored them through :meth:`kv_sink`."""
        cache, buf = self._cache, self._buf
        kp, vp = cache.pools(layer)
        impl = cache.attention_impl
        if (k is None) != (v is None):
            raise ValueError("a step's k and v come together, or neither (stored through kv_sink)")
        if k is not None:
            check_step_shapes(self._rows, q, k, v, cache.config)
            slots = buf.slot_mapping
            if self._rows > 1 and not impl.skips_negative_slots:
                slots, k, v = padded_writes(slots, k, v)
            impl.write_kv(kp, vp, k, v, slots)
        return impl.attend_decode(q, kp, vp, buf.block_table, buf.kv_len, self._blocks)
