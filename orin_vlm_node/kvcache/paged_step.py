"""The StepAttention objects of the paged cache: what the model calls, layer by layer, during one step.

``PagedStep`` (prefill and the dynamic decode step) writes the step's K/V to its slots and attends over the
sequence's table; ``PagedStaticDecode`` (the static decode step a CUDA graph captures) reads the slots, the
lengths and the table rows of a batch only from the fixed :class:`~.base.StaticDecodeBuffers`, over a fixed
width. Both leave the tensor work to the cache's :class:`~.attention.PagedAttentionImpl` (torch or the kernels), and
receive the cache's layers (:class:`PagedLayers`), not the cache.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .attention import PagedAttentionImpl, StepBlocks
from .base import StaticDecodeBuffers, check_step_shapes, padded_writes
from .config import KVCacheConfig
from .interface import KVSink


@dataclass(frozen=True)
class PagedLayers:
    """What a step reads of the paged cache: each layer's (K, V) pools, each (num_blocks, page_size, nkv, hd),
    the attention implementation in use and the cache's shapes."""

    pools: Sequence[tuple[torch.Tensor, torch.Tensor]]
    impl: PagedAttentionImpl
    config: KVCacheConfig


class PagedStep:
    """StepAttention of one paged step; valid until the sequence is next changed (step/fork/truncate)."""

    def __init__(
        self, layers: PagedLayers, slot_mapping: torch.Tensor, blocks: StepBlocks, q_start: int, kv_len: int, n: int
    ) -> None:
        self._layers = layers
        self.slot_mapping = slot_mapping  # (L,) int64
        self._blocks = blocks
        self.q_start = q_start
        self.kv_len = kv_len
        self._n = n

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        layers = self._layers
        check_step_shapes(self._n, q, k, v, layers.config)
        kp, vp = layers.pools[layer]
        impl = layers.impl
        impl.write_kv(kp, vp, k, v, self.slot_mapping)
        return impl.attend(q, kp, vp, self._blocks, self.q_start, self.kv_len)


class PagedStaticDecode:
    """Decode StepAttention of ``buffers.batch`` rows reading slots, lengths and table rows from the static
    buffers only; a row's sequence uses at most the first ``blocks`` entries of its table row (the width
    of the step's context bucket)."""

    def __init__(self, layers: PagedLayers, buffers: StaticDecodeBuffers, blocks: int) -> None:
        self._layers, self._buf, self._blocks = layers, buffers, blocks
        self._rows = buffers.batch

    def kv_sink(self, layer: int, dtype: torch.dtype) -> KVSink | None:
        """The layer's pools and the step's slots, for a producer of rows of ``dtype`` (None: the pools hold
        another dtype, so the rows must be converted on the way in by ``__call__``)."""
        kp, vp = self._layers.pools[layer]
        return KVSink(kp, vp, self._buf.slot_mapping) if kp.dtype == dtype else None

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None) -> torch.Tensor:
        """The step's attention for ``layer``; ``k = v = None``: the caller stored them through :meth:`kv_sink`."""
        layers, buf = self._layers, self._buf
        kp, vp = layers.pools[layer]
        impl = layers.impl
        if (k is None) != (v is None):
            raise ValueError("a step's k and v come together, or neither (stored through kv_sink)")
        if k is not None:
            check_step_shapes(self._rows, q, k, v, layers.config)
            slots = buf.slot_mapping
            if self._rows > 1 and not impl.skips_negative_slots:
                slots, k, v = padded_writes(slots, k, v)
            impl.write_kv(kp, vp, k, v, slots)
        return impl.attend_decode(q, kp, vp, buf.block_table, buf.kv_len, self._blocks)
