"""CUDA implementation of the kvcache ``PagedAttentionImpl`` protocol (write_kv / attend / attend_decode).

Plug it in with ``PagedKVCache.set_attention_impl(CudaPagedAttention(runtime))``. The ``launcher`` is
anything with ``launch(cfg, args)``: the PyCUDA :class:`~.runtime.KernelRuntime` on a GPU, or the CPU
harness in the tests, which runs these exact calls (shapes, dtypes, launch plans) through the kernels
on the CPU.

The shape (dtype, head_dim, GQA group) is checked once, when the backend is chosen
(``backend.AttentionShape``); a shape the kernels do not cover never gets this implementation.
"""

from __future__ import annotations

import torch

from ..kvcache.attention import StepBlocks
from . import launch as L


class CudaPagedAttention:
    """Paged attention through the kernels of ``kernels/``: prefill one sequence per call, decode one
    launch for the whole batch of a static decode step (its ``[batch, max_blocks]`` table rows).

    ``sm_count`` sizes the split-K plan of decode; the plan depends only on the batch and on the width a
    row can use (the capacity of the decode step's context bucket), never on the current lengths, so a
    captured decode graph stays valid as the sequences grow within their bucket.
    """

    name = "cuda"
    skips_negative_slots = True  # the write kernel skips a negative slot (a padding row)

    def __init__(self, launcher, sm_count: int = 16, min_tokens_per_split: int = L.DEFAULT_MIN_TOKENS_PER_SPLIT):
        self.launcher = launcher
        self.sm_count = sm_count
        self.min_tokens_per_split = min_tokens_per_split
        self._workspaces: dict[tuple, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    # -- protocol ---------------------------------------------------------------------------------
    def write_kv(
        self, k_pool: torch.Tensor, v_pool: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor
    ) -> None:
        nkv, hd = k_pool.shape[2], k_pool.shape[3]
        if k.shape[1:] != (nkv, hd) or v.shape != k.shape:
            raise ValueError(f"k/v of shape {tuple(k.shape)}/{tuple(v.shape)} do not fit a pool of ({nkv}, {hd}) rows")
        n = k.shape[0]
        if slot_mapping.shape != (n,):
            raise ValueError(f"slot_mapping must have shape ({n},), got {tuple(slot_mapping.shape)}")
        if n == 0:
            return None
        k = k.to(k_pool.dtype).contiguous()
        v = v.to(v_pool.dtype).contiguous()
        slots = slot_mapping.to(torch.int64).contiguous()
        row = L.check_kv_row(nkv, hd, k_pool.dtype)
        self.launcher.launch(L.kv_write_launch(n, k_pool.dtype), [k_pool, v_pool, k, v, slots, row])
        return None

    def attend(
        self,
        q: torch.Tensor,
        k_pool: torch.Tensor,
        v_pool: torch.Tensor,
        blocks: StepBlocks,
        q_start: int,
        kv_len: int,
    ) -> torch.Tensor:
        num_q, nq, hd = q.shape
        page, nkv = k_pool.shape[1], k_pool.shape[2]
        if q_start < 0 or q_start + num_q > kv_len:
            raise ValueError(f"queries at slots {q_start}..{q_start + num_q - 1} need kv_len >= {q_start + num_q}")
        table = self._table(blocks.table, q.device)
        if table.numel() * page < q_start + num_q:
            raise ValueError(f"block table of {table.numel()} blocks cannot hold {q_start + num_q} slots")
        # Slots past the last query are masked anyway; the kernel places queries at seq_len - num_q + i.
        meta = torch.tensor([q_start + num_q, 0, num_q], dtype=torch.int32).to(q.device, non_blocking=True)
        seq_lens, cu_q_lens = meta[0:1], meta[1:3]
        qc = q.to(k_pool.dtype).contiguous()
        out = torch.empty_like(qc)
        cfg = L.prefill_launch(1, num_q, nq, nkv, hd, k_pool.dtype)
        self.launcher.launch(
            cfg, [out, qc, k_pool, v_pool, table, seq_lens, cu_q_lens, nq, nkv, page, table.numel(), hd**-0.5]
        )
        return out.to(q.dtype)

    def attend_decode(
        self,
        q: torch.Tensor,
        k_pool: torch.Tensor,
        v_pool: torch.Tensor,
        block_table: torch.Tensor,
        kv_len: torch.Tensor,
        blocks: int,
    ) -> torch.Tensor:
        batch, nq, hd = q.shape
        page, nkv = k_pool.shape[1], k_pool.shape[2]
        if block_table.dim() != 2 or block_table.shape[0] != batch or kv_len.shape != (batch,):
            raise ValueError(
                f"attend_decode of {batch} queries needs a ({batch}, W) block table and ({batch},) kv_len, "
                f"got {tuple(block_table.shape)} and {tuple(kv_len.shape)}"
            )
        table = self._table(block_table, q.device)  # (B, W)
        seq_lens = kv_len
        if seq_lens.dtype != torch.int32 or not seq_lens.is_contiguous():
            seq_lens = seq_lens.to(torch.int32).contiguous()
        qc = q.to(k_pool.dtype)
        if not L.rows_in_place(qc):
            qc = qc.contiguous()
        out = torch.empty((batch, nq, hd), dtype=qc.dtype, device=qc.device)
        width = table.shape[1]
        splits, tokens_per_split = self.decode_plan(min(blocks, width) * page, nq, nkv, batch)
        cfg = L.decode_launch(batch, nq, nkv, hd, k_pool.dtype, splits)
        # The row stride is the full width; a row's loop stops at its own length, so the work follows it.
        tail = [qc, k_pool, v_pool, table, seq_lens, nq, nkv, page, width, tokens_per_split, qc.stride(0), hd**-0.5]
        if splits == 1:
            self.launcher.launch(cfg, [out, None, None, None, *tail])
        else:  # one launch: the last split of each group combines the group's partials into out
            part_out, part_lse, counters = self._workspace(q.device, batch, nq, hd, splits, L.decode_counters(cfg))
            self.launcher.launch(cfg, [out, part_out, part_lse, counters, *tail])
        return out.to(q.dtype)

    # -- helpers ----------------------------------------------------------------------------------
    def decode_plan(self, capacity_tokens: int, num_heads: int, num_kv_heads: int, batch: int = 1) -> tuple[int, int]:
        """(num_splits, tokens_per_split) for ``batch`` table rows that can each hold ``capacity_tokens``."""
        blocks = num_kv_heads * L.group_chunks(num_heads, num_kv_heads)
        return L.choose_decode_splits(
            max(1, capacity_tokens), batch, blocks, self.sm_count, min_tokens_per_split=self.min_tokens_per_split
        )

    @staticmethod
    def _table(block_table: torch.Tensor, device: torch.device) -> torch.Tensor:
        """The table as the kernels read it: int32, contiguous, on ``device``."""
        if block_table.dtype != torch.int32 or block_table.device != device or not block_table.is_contiguous():
            return block_table.to(device=device, dtype=torch.int32).contiguous()
        return block_table

    def _workspace(
        self, device: torch.device, batch: int, nq: int, hd: int, splits: int, counters: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Split-K partials and the groups' finish counters (zero; each launch leaves them zero), allocated
        once per shape (first use is eager warm-up, before any capture)."""
        key = (str(device), batch, nq, hd, splits, counters)
        ws = self._workspaces.get(key)
        if ws is None:
            ws = (
                torch.empty(batch, nq, splits, hd, dtype=torch.float32, device=device),
                torch.empty(batch, nq, splits, dtype=torch.float32, device=device),
                torch.zeros(counters, dtype=torch.int32, device=device),
            )
            self._workspaces[key] = ws
        return ws
