"""The interface both KV caches implement, so the engine never branches on paged vs contiguous.

Sequences are plain int handles from :meth:`KVCache.new_sequence`. A sequence's *length* is the number
of tokens whose KV slots are reserved (and, once the step's forward ran, written): slots ``0..length-1``.
"""

from __future__ import annotations

import itertools
from abc import ABC, abstractmethod
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import torch

from .attention import PagedAttentionImpl
from .config import KVCacheConfig
from .errors import ContextLimitExceeded
from .interface import StepAttention


@dataclass
class StaticDecodeBuffers:
    """Fixed device tensors one decode step reads, so a CUDA graph can be captured over them.

    Refilled in place by ``prepare_static_decode`` (outside capture/replay) before every decode step.
    ``slot_mapping`` (1,) int64: physical slot of the new token; ``kv_len`` (1,) int32: slots valid after
    the write (length including the new token); ``block_table`` (W,) int32: the sequence's table row
    (paged: W = max_blocks_per_sequence, -1 past its last block; contiguous: W = 1, its slab index).
    """

    slot_mapping: torch.Tensor
    kv_len: torch.Tensor
    block_table: torch.Tensor


ExtraKeys = Sequence[Hashable | None]


class KVCache(ABC):
    """One interface for :class:`PagedKVCache` and :class:`ContiguousKVCache` (see the package docstring)."""

    supports_prefix_caching: bool = False

    def __init__(self, config: KVCacheConfig) -> None:
        self.config = config
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
        """Attach the longest cached full-block prefix to the empty ``seq``; returns its token count.

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

    def new_static_decode_buffers(self) -> StaticDecodeBuffers:
        """Allocate the fixed tensors a static decode step reads (refilled by ``prepare_static_decode``)."""
        dev = self.config.device
        return StaticDecodeBuffers(
            slot_mapping=torch.zeros(1, dtype=torch.int64, device=dev),
            kv_len=torch.zeros(1, dtype=torch.int32, device=dev),
            block_table=torch.full((self.static_table_width,), -1, dtype=torch.int32, device=dev),
        )

    @abstractmethod
    def prepare_static_decode(self, seq: int, buffers: StaticDecodeBuffers) -> None:
        """Host-side half of a decode step: grow by one token, fill ``buffers`` in place.

        Call it before launching (or capturing) the step, never inside a capture: it allocates blocks,
        copies on write and uploads block-table changes. PoolExhausted before any change.
        """

    @abstractmethod
    def static_decode_attention(self, buffers: StaticDecodeBuffers, width: int | None = None) -> StepAttention:
        """Decode attention that reads slot, kv_len and the table row only from ``buffers`` tensors.

        It attends over the first ``width`` token slots of the sequence (None: ``max_context_tokens``), so
        its work is proportional to that width: the caller picks a width that holds the sequence (one
        captured graph per width) instead of paying for the whole context limit every token.
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
