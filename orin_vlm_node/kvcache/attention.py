"""Pluggable paged attention: the protocol a backend implements, and the torch implementation.

The paged cache owns the bookkeeping (blocks, tables, slot mapping) and delegates the tensor work of
each step to a :class:`PagedAttentionImpl`. The torch implementation here is the default and the
reference; the CUDA helper provides the same three methods with kernels
(``PagedKVCache.set_attention_impl(impl)``).

Layouts an implementation receives (one layer at a time, all on the cache device):

More in docs/modules.md, ``orin_vlm_node/kvcache/attention.py``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from .fused_prefill import step_attention
from .reference import masked_decode_attention


@dataclass(frozen=True)
class StepBlocks:
    """The blocks a step attends over, for the device and for the host."""

    table: torch.Tensor  # (max_blocks_per_sequence,) int32 on the cache device, -1 past the last block
    runs: tuple[tuple[int, int], ...]  # (first block, count): the first ceil(kv_len / page) entries, in order


def block_runs(blocks: Sequence[int]) -> tuple[tuple[int, int], ...]:
    """``blocks`` as runs of consecutive ids: [7, 8, 9, 3, 4] -> ((7, 3), (3, 2))."""
    runs: list[tuple[int, int]] = []
    for block in blocks:
        if runs and runs[-1][0] + runs[-1][1] == block:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((block, 1))
    return tuple(runs)


class PagedAttentionImpl(Protocol):
    """What a paged-attention backend provides (torch reference below, CUDA kernels in ``cuda/``)."""

    name: str
    skips_negative_slots: bool  # write_kv stores nothing for a negative slot

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
        blocks: StepBlocks,
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
        blocks: int,
    ) -> torch.Tensor:
        """One query per sequence: ``q`` (B, nq, hd), row ``b`` at slot ``kv_len[b]-1`` over the slots
        ``0..kv_len[b]-1`` of table row ``block_table[b]``; ``kv_len`` (B,) int32 on the device; rows with
        ``kv_len`` 0 (padding) return finite values nobody reads. Returns (B, nq, hd).

        Must not read anything back to the host nor depend on ``kv_len`` for shapes (CUDA-graph safe).
        """
        ...


class TorchPagedAttention:
    """Reference implementation on torch ops: each run of consecutive blocks is read in place as one view.

    :meth:`attend` (prefill and the dynamic decode step): a single-query step never copies K/V, one
    product per run and one softmax over all of them; a multi-token step on the CPU goes through torch's
    fused kernel (:mod:`.fused_prefill`), which takes the runs as one tensor. :meth:`attend_decode` (the
    static step a CUDA graph replays) cannot follow a table that changes between replays without a kernel,
    so it gathers the bucket's blocks, as the contiguous cache gathers its slab there; the CUDA kernels
    read in place on both paths.
    """

    name = "torch"
    skips_negative_slots = False

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
        blocks: StepBlocks,
        q_start: int,
        kv_len: int,
    ) -> torch.Tensor:
        page = k_pool.shape[1]
        k_slots, v_slots = k_pool.flatten(0, 1), v_pool.flatten(0, 1)  # (num_blocks * page, nkv, hd), views
        k_parts, v_parts = [], []
        left = kv_len
        for first, count in blocks.runs:
            n = min(count * page, left)
            k_parts.append(k_slots[first * page : first * page + n])  # (n, nkv, hd), a view
            v_parts.append(v_slots[first * page : first * page + n])
            left -= n
            if left == 0:
                break
        if left:
            raise ValueError(f"the runs cover {kv_len - left} of kv_len={kv_len} slots")
        return step_attention(q, k_parts, v_parts, q_start)

    def attend_decode(
        self,
        q: torch.Tensor,
        k_pool: torch.Tensor,
        v_pool: torch.Tensor,
        block_table: torch.Tensor,
        kv_len: torch.Tensor,
        blocks: int,
    ) -> torch.Tensor:
        # Unused entries are -1; clamp them to a valid block, their slots are masked by kv_len anyway.
        table = block_table[:, :blocks].clamp(min=0).long()  # (B, blocks)
        k = k_pool[table].flatten(1, 2)  # (B, blocks * page, nkv, hd)
        v = v_pool[table].flatten(1, 2)
        return masked_decode_attention(q, k, v, kv_len)
