"""Pluggable paged attention: the protocol a backend implements, and the torch implementation.

The paged cache owns the bookkeeping (blocks, tables, slot mapping) and delegates the tensor work of
each step to a :class:`PagedAttentionImpl`. The torch implementation here is the default and the
reference; the CUDA helper provides the same three methods with kernels
(``PagedKVCache.set_attention_impl(impl)``).

Layouts an implementation receives (one layer at a time, all on the cache device):

* ``k_pool``, ``v_pool``: (num_blocks, page_size, num_kv_heads, head_dim), contiguous, the cache dtype.
  Physical slot ``s`` is ``k_pool.view(-1, nkv, hd)[s]``, i.e. block ``s // page_size``, offset
  ``s % page_size``.
* ``slot_mapping``: (L,) int64, the physical slot of each new token, in token order.
* ``block_table``: int32, the sequence's physical blocks in logical order. For :meth:`attend` it holds at
  least ``ceil(kv_len / page_size)`` valid entries; for :meth:`attend_decode` it is the full fixed-width
  row (``max_blocks_per_sequence``) whose entries past the sequence's last block are ``-1``.
* The block table a kernel reads has been uploaded before the step that needs it (``PagedKVCache.step``
  and ``prepare_static_decode`` upload changed entries before they return), never during a launch.

Semantics (both must match :mod:`.reference` exactly up to kernel rounding): query ``i`` of a step sits at
slot ``q_start + i`` and attends causally to slots ``0 .. q_start + i``; GQA maps kv head ``j`` to q heads
``j*g .. j*g+g-1``; scale ``head_dim ** -0.5``; softmax in fp32; output in q's dtype.
"""

from __future__ import annotations

from typing import Protocol

import torch

from .reference import causal_attention, masked_decode_attention


class PagedAttentionImpl(Protocol):
    """What a paged-attention backend provides (torch reference below, CUDA kernels in ``cuda/``)."""

    name: str

    def write_kv(
        self, k_pool: torch.Tensor, v_pool: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor
    ) -> None:
        """Store ``k``, ``v`` (L, nkv, hd) at physical slots ``slot_mapping`` (L,) int64."""
        ...

    def attend(
        self,
        q: torch.Tensor,
        k_pool: torch.Tensor,
        v_pool: torch.Tensor,
        block_table: torch.Tensor,
        q_start: int,
        kv_len: int,
    ) -> torch.Tensor:
        """Causal attention of ``q`` (L, nq, hd) at slots ``q_start..q_start+L-1`` over ``kv_len`` slots."""
        ...

    def attend_decode(
        self,
        q: torch.Tensor,
        k_pool: torch.Tensor,
        v_pool: torch.Tensor,
        block_table: torch.Tensor,
        kv_len: torch.Tensor,
    ) -> torch.Tensor:
        """One query (1, nq, hd) at slot ``kv_len-1``; ``kv_len`` is a (1,) int32 device tensor.

        Must not read anything back to the host nor depend on ``kv_len`` for shapes (CUDA-graph safe).
        """
        ...


class TorchPagedAttention:
    """Reference implementation: gather the sequence's pages (one indexed copy, no per-token loop)."""

    name = "torch"

    def write_kv(
        self, k_pool: torch.Tensor, v_pool: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor
    ) -> None:
        nkv, hd = k_pool.shape[2], k_pool.shape[3]
        k_pool.view(-1, nkv, hd).index_copy_(0, slot_mapping, k.to(k_pool.dtype))
        v_pool.view(-1, nkv, hd).index_copy_(0, slot_mapping, v.to(v_pool.dtype))

    def attend(
        self,
        q: torch.Tensor,
        k_pool: torch.Tensor,
        v_pool: torch.Tensor,
        block_table: torch.Tensor,
        q_start: int,
        kv_len: int,
    ) -> torch.Tensor:
        page = k_pool.shape[1]
        blocks = block_table[: -(-kv_len // page)].long()
        run = _consecutive_run(blocks)
        if run is not None:  # the pages lie back to back in the pool: read them in place, no gather
            k = k_pool[run].flatten(0, 1)[:kv_len].to(q.dtype)  # (kv_len, nkv, hd)
            v = v_pool[run].flatten(0, 1)[:kv_len].to(q.dtype)
        else:
            k = k_pool[blocks].flatten(0, 1)[:kv_len].to(q.dtype)
            v = v_pool[blocks].flatten(0, 1)[:kv_len].to(q.dtype)
        return causal_attention(q, k, v, q_start)

    def attend_decode(
        self,
        q: torch.Tensor,
        k_pool: torch.Tensor,
        v_pool: torch.Tensor,
        block_table: torch.Tensor,
        kv_len: torch.Tensor,
    ) -> torch.Tensor:
        # Unused entries are -1; clamp them to a valid block, their slots are masked by kv_len anyway.
        blocks = block_table.clamp(min=0).long()
        k = k_pool[blocks].flatten(0, 1).to(q.dtype)  # (max_blocks * page, nkv, hd)
        v = v_pool[blocks].flatten(0, 1).to(q.dtype)
        return masked_decode_attention(q, k, v, kv_len)


def _consecutive_run(blocks: torch.Tensor) -> slice | None:
    """``slice(b, b + n)`` when the host-side table ``blocks`` (n,) is b, b+1, ..., b+n-1, else None.

    A sequence that grew in a fresh or unfragmented pool gets consecutive blocks, and reading them as a
    view saves one copy of its whole K and V per layer and step. Only checked for CPU tables: on a GPU
    the check would be a host sync (and the CUDA kernels read pages in place anyway).
    """
    if blocks.device.type != "cpu" or blocks.numel() == 0:
        return None
    first = int(blocks[0])
    if blocks.numel() > 1 and not bool(torch.equal(blocks, torch.arange(first, first + blocks.numel()))):
        return None
    return slice(first, first + blocks.numel())
