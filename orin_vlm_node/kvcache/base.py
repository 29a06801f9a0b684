"""The interface both KV caches implement, so the engine never branches on paged vs contiguous.

Sequences are plain int handles from :meth:`KVCache.new_sequence`. A sequence's *length* is the number
of tokens whose KV slots are reserved (and, once the step's forward ran, written): slots ``0..length-1``.
"""

from __future__ import annotations

import itertools
import logging
from abc import ABC, abstractmethod
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import torch

from .attention import PagedAttentionImpl
from .config import KVCacheConfig, PoolPlan
from .errors import ContextLimitExceeded
from .interface import StepAttention

_log = logging.getLogger(__name__)


@dataclass
class StaticDecodeBuffers:
    """Fixed device tensors one decode step of up to ``batch`` sequences reads, so a CUDA graph can be
    captured over them.

    Row ``i`` belongs to the ``i``-th sequence staged in the step; rows nobody was staged in are
    *padding* (:meth:`pad`): a graph is captured for a bucket of batch sizes, and a step of 3 sequences
    replays the graph of 4. Refilled in place by ``prepare_static_decode`` (outside capture/replay)
    before every decode step. ``slot_mapping`` (B,) int64: physical slot of the row's new token, -1 for
    padding (nothing is stored); ``kv_len`` (B,) int32: slots valid after the write (length including the
    new token), 0 for padding (attends to nothing); ``block_table`` (B, W) int32: the sequence's table
    row (paged: W = max_blocks_per_sequence, -1 past its last block; contiguous: W = 1, its slab index).
    """

    slot_mapping: torch.Tensor
    kv_len: torch.Tensor
    block_table: torch.Tensor

    @property
    def batch(self) -> int:
        return self.kv_len.shape[0]

    def rows(self, n: int) -> StaticDecodeBuffers:
        """The first ``n`` rows as views of these tensors: the buffers of a smaller batch bucket."""
        if not 1 <= n <= self.batch:
            raise ValueError(f"rows({n}) of buffers for {self.batch} sequences")
        return StaticDecodeBuffers(self.slot_mapping[:n], self.kv_len[:n], self.block_table[:n])

    def pad(self, used: int) -> None:
        """Rows ``used..`` become padding: they store no K/V and attend to nothing."""
        self.slot_mapping[used:].fill_(-1)
        self.kv_len[used:].fill_(0)


def padded_writes(
    slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(slots, k, v)`` for an indexed copy that stores nothing for padding rows (slot < 0).

    A padding row is redirected to row 0's slot with row 0's values (row 0 is never padding): the
    duplicate writes carry equal values, so the copy stays one graph-capturable op whatever the rows
    hold, with no shape that depends on the data. ``slot_mapping`` (B,), ``k``/``v`` (B, nkv, hd).
    """
    keep = slot_mapping >= 0  # (B,)
    rows = keep.view(-1, 1, 1)
    return (
        torch.where(keep, slot_mapping, slot_mapping[:1]),
        torch.where(rows, k, k[:1]),
        torch.where(rows, v, v[:1]),
    )


ExtraKeys = Sequence[Hashable | None]


class KVCache(ABC):
    """One interface for :class:`PagedKVCache` and :class:`ContiguousKVCache` (see the package docstring)."""

    supports_prefix_caching: bool = False

    def __init__(self, config: KVCacheConfig, plan: PoolPlan) -> None:
        """``plan``: the pool's size as :func:`~.config.plan_pool` chose it, logged here, where the pool is
        really made (a plan is also computed to check a change before it is applied)."""
        self.config = config
        self.plan = plan
        _log.info("KV pool: %s", plan.describe())
        self._ids = itertools.count(1)

    # -- sequences -------------------------------------------------------------------------------
    @abstractmethod
    def new_sequence(self) -> int:
        """A new empty sequence (length 0)."""

    @abstractmethod
    def length(self, seq: int) -> int:
        """Tokens whose KV slots the sequence holds."""

    @abstractmethod
    def ensure_capacity(self, seq: int, new_len: int) -> None:
        """Make room for ``new_len`` tokens (no-op if there is); PoolExhausted before any change."""

    @abstractmethod
    def step(self, seq: int, num_new: int) -> StepAttention:
        """Reserve slots ``length .. length+num_new-1`` (length grows now) and return this step's attention."""

    @abstractmethod
    def fork(self, seq: int) -> int:
        """A new sequence with the same KV (shared pages with copy-on-write, or a copy)."""

    @abstractmethod
    def truncate(self, seq: int, new_len: int) -> None:
        """Drop the KV of slots ``new_len..`` (e.g. a step whose forward was abandoned)."""

    @abstractmethod
    def release(self, seq: int) -> None:
        """Give the sequence's storage back; the handle becomes invalid."""

    @abstractmethod
    def clear(self) -> None:
        """Release every sequence and forget all cached prefixes."""

    @abstractmethod
    def block_table(self, seq: int) -> list[int]:
        """Physical storage units of the sequence, in order (paged: blocks; contiguous: its slab)."""

    # -- prefix caching --------------------------------------------------------------------------
    @abstractmethod
    def match_prefix(self, token_ids: Sequence[int], extra_keys: ExtraKeys | None = None) -> int:
        """Tokens of this prompt that :meth:`attach_prefix` would reuse now (no state change)."""

    @abstractmethod
    def attach_prefix(self, seq: int, token_ids: Sequence[int], extra_keys: ExtraKeys | None = None) -> int:
        """Attach the longest cached prefix to the empty ``seq``: whole cached blocks, then the shared head of
        the cached block that agrees longest with the rest; returns its token count.

        Never the whole prompt: at least the last token is left to compute so logits exist.
        ``extra_keys[i]`` (optional, per token) is anything else the KV of token ``i`` depends on,
        e.g. the content hash of the image an image-pad token belongs to; None for plain text tokens.
        """

    @abstractmethod
    def register_prefix(self, seq: int, token_ids: Sequence[int], extra_keys: ExtraKeys | None = None) -> int:
        """Offer the sequence's full blocks for reuse; ``token_ids`` are its tokens from slot 0 (KV written).

        Returns how many blocks were newly registered.
        """

    @abstractmethod
    def set_prefix_caching(self, enabled: bool) -> bool:
        """Turn prefix caching on/off at runtime; returns the effective state."""

    # -- attention backend ------------------------------------------------------------------------
    @abstractmethod
    def set_attention_impl(self, impl: PagedAttentionImpl | None) -> None:
        """Swap the tensor backend (e.g. the CUDA kernels; None = the torch one); storage stays as it is."""

    # -- static (CUDA-graph) decode --------------------------------------------------------------
    static_table_width: int  # entries of the block-table row in StaticDecodeBuffers

    def new_static_decode_buffers(self, batch: int = 1) -> StaticDecodeBuffers:
        """Allocate the fixed tensors a static decode step of up to ``batch`` sequences reads (refilled by
        ``prepare_static_decode``); every row starts as padding."""
        if batch < 1:
            raise ValueError(f"static decode buffers need batch >= 1, got {batch}")
        dev = self.config.device
        return StaticDecodeBuffers(
            slot_mapping=torch.full((batch,), -1, dtype=torch.int64, device=dev),
            kv_len=torch.zeros(batch, dtype=torch.int32, device=dev),
            block_table=torch.full((batch, self.static_table_width), -1, dtype=torch.int32, device=dev),
        )

    @abstractmethod
    def prepare_static_decode(self, seq: int, buffers: StaticDecodeBuffers, row: int = 0) -> None:
        """Host-side half of a decode step: grow ``seq`` by one token, fill row ``row`` of ``buffers`` in place.

        Call it before launching (or capturing) the step, never inside a capture: it allocates blocks,
        copies on write and uploads block-table changes. PoolExhausted before any change.
        """

    @abstractmethod
    def static_decode_attention(self, buffers: StaticDecodeBuffers, width: int | None = None) -> StepAttention:
        """Decode attention of ``buffers.batch`` rows (one new token per sequence, padding rows included)
        that reads slot, kv_len and the table rows only from ``buffers`` tensors.

        A row attends over at most the first ``width`` token slots of its sequence (None:
        ``max_context_tokens``): the caller picks a width that holds every row's sequence (one captured
        graph per width) instead of paying for the whole context limit every token.
        """

    # -- introspection ---------------------------------------------------------------------------
    @abstractmethod
    def stats(self) -> dict:
        """Usage figures: blocks used/free/cached, tokens stored, fragmentation, bytes, prefix hits."""

    # -- helpers ---------------------------------------------------------------------------------
    def _check_context(self, new_len: int) -> None:
        if new_len > self.config.max_context_tokens:
            raise ContextLimitExceeded(
                f"sequence would hold {new_len} tokens, more than max_context_tokens={self.config.max_context_tokens}"
            )


def check_step_shapes(num_new: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, config: KVCacheConfig) -> None:
    """Clear errors for a model/cache mismatch instead of an index error deep in a gather."""
    nkv, hd = config.num_kv_heads, config.head_dim
    if k.shape != (num_new, nkv, hd) or v.shape != (num_new, nkv, hd):
        raise ValueError(
            f"step expects k/v of shape ({num_new}, {nkv}, {hd}), got {tuple(k.shape)} and {tuple(v.shape)}"
        )
    if q.dim() != 3 or q.shape[0] != num_new or q.shape[2] != hd or q.shape[1] % nkv:
        raise ValueError(f"step expects q of shape ({num_new}, n*{nkv}, {hd}), got {tuple(q.shape)}")
