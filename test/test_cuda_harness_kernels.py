"""The real kernels of ``kernels/*.cu`` run under the CPU CUDA emulator and are compared with torch.

Reference: ``orin_vlm_node.kvcache.reference.causal_attention`` on the same (fp32-widened) K/V gathered
through the block table; the kernels compute in fp32, so the only expected difference is the rounding
of the output to its dtype. Launch geometry comes from ``orin_vlm_node.cuda.launch`` (the GPU path's).
"""

from __future__ import annotations

import random

import pytest
import torch
from cuda_harness.harness import Harness, HarnessError

from orin_vlm_node.cuda import launch as L
from orin_vlm_node.kvcache.reference import causal_attention

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# Output rounding of each dtype (plus a little fp32 accumulation-order slack).
ATOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
PAGE_SIZES = [1, 2, 4, 8, 16, 32, 64]


class PagedPool:
    """Random K/V pools with shuffled, non-contiguous block tables (-1 past each sequence's blocks)."""

    def __init__(self, rng: random.Random, lens: list[int], page: int, nkv: int, hd: int, dtype, spare: int = 3):
        self.page, self.lens = page, lens
        needed = [-(-n // page) for n in lens]
        self.max_blocks = max(needed) + rng.randint(0, 2)
        num_blocks = sum(needed) + spare
        self.k = torch.randn(num_blocks, page, nkv, hd).to(dtype)
        self.v = torch.randn(num_blocks, page, nkv, hd).to(dtype)
        physical = list(range(num_blocks))
        rng.shuffle(physical)
        self.table = torch.full((len(lens), self.max_blocks), -1, dtype=torch.int32)
        for b, n in enumerate(needed):
            self.table[b, :n] = torch.tensor(physical[:n], dtype=torch.int32)
            physical = physical[n:]
        self.seq_lens = torch.tensor(lens, dtype=torch.int32)

    def gather(self, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Sequence b's K, V (len, nkv, hd) in fp32, through its block table (the torch reference path)."""
        n = self.lens[b]
        blocks = self.table[b, : -(-n // self.page)].long()
        return self.k[blocks].flatten(0, 1)[:n].float(), self.v[blocks].flatten(0, 1)[:n].float()


def _decode(harness: Harness, q, pool: PagedPool, nh: int, nkv: int, hd: int, splits: int, tps: int) -> torch.Tensor:
    batch = q.shape[0]
    out = torch.empty(q.shape, dtype=q.dtype)
    cfg = L.decode_launch(batch, nh, nkv, hd, q.dtype, splits)
    tail = [pool.table, pool.seq_lens, nh, nkv, pool.page, pool.max_blocks, tps, q.stride(0), hd**-0.5]
    args_tail = [pool.k, pool.v, *tail]
    if splits == 1:
        harness.launch(cfg, [out, None, None, None, q, *args_tail])
        return out
    part_out = torch.empty(batch, nh, splits, hd)
    part_lse = torch.empty(batch, nh, splits)
    counters = torch.zeros(L.decode_counters(cfg), dtype=torch.int32)
    harness.launch(cfg, [out, part_out, part_lse, counters, q, *args_tail])
    assert not counters.any()  # left as found, for the next launch (a graph replays with the same buffer)
    return out


@pytest.mark.parametrize("hd", L.SUPPORTED_HEAD_DIMS)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_decode_matches_reference(harness, dtype, hd):
    rng = random.Random(f"decode-{dtype}-{hd}")
    # Groups past the largest bucket (8) run as several chunks per kv head; 3, 6 and 12 leave chunks part-full.
    groups = [1, 2, 3, 4, 6, 8, 12, 16]
    for trial in range(3):
        nkv = rng.choice([1, 2])
        group = groups[(trial * 3 + L.SUPPORTED_HEAD_DIMS.index(hd)) % len(groups)]
        nh = nkv * group
        page = rng.choice(PAGE_SIZES)
        batch = rng.randint(1, 3)
        lens = [rng.randint(1, 150) for _ in range(batch)]
        pool = PagedPool(rng, lens, page, nkv, hd, dtype)
        # Odd trials read the q heads in place of wider rows (the q/k norm's output also holds the k heads).
        q = torch.randn(batch, nh + (nkv if trial % 2 else 0), hd).to(dtype)[:, :nh]
        refs = []
        for b in range(batch):
            k, v = pool.gather(b)
            refs.append(causal_attention(q[b : b + 1].float(), k, v, lens[b] - 1)[0])
        ref = torch.stack(refs)
        plans = [(1, 0), L.choose_decode_splits(max(lens), batch, nkv, 16, min_tokens_per_split=32)]
        plans.append((-(-max(lens) // 7), 7))  # splits not aligned with pages or warps
        for splits, tps in plans:
            out = _decode(harness, q, pool, nh, nkv, hd, splits, tps)
            assert out.dtype == dtype
            torch.testing.assert_close(
                out.float(),
                ref,
                atol=ATOL[dtype],
                rtol=0,
                msg=lambda m, s=splits, p=page, n=lens: f"splits={s} page={p} lens={n}: {m}",
            )


@pytest.mark.parametrize(("hd", "group", "page"), [(128, 2, 16), (64, 1, 8), (32, 1, 4), (256, 8, 32)])
def test_decode_combines_many_splits_shared_among_lanes(harness, hd, group, page):
    """The last block combines many splits: each item (4 dims of a head) shared by as many adjacent threads as
    the block has for its items (2 for the 2B's two heads of 128, 8 and 16 for one head of 64 and of 32, 1 for
    eight heads of 256), each thread taking several batches of splits, a split count no multiple of the
    lanes, and splits past the end of the shorter sequence."""
    rng = random.Random(f"combine-{hd}-{group}")
    nkv, dtype = 2, torch.float32
    nh = nkv * group
    lens = [611, 97]
    pool = PagedPool(rng, lens, page, nkv, hd, dtype)
    q = torch.randn(2, nh, hd)
    out = _decode(harness, q, pool, nh, nkv, hd, splits=-(-max(lens) // 3), tps=3)  # 204 splits
    for b in range(2):
        k, v = pool.gather(b)
        torch.testing.assert_close(out[b], causal_attention(q[b : b + 1], k, v, lens[b] - 1)[0], atol=2e-5, rtol=0)


def test_decode_split_past_sequence_end_and_empty_sequence(harness):
    """Splits that start beyond a sequence's length and a zero-length sequence give finite, exact results."""
    rng = random.Random(7)
    nh, nkv, hd, dtype = 4, 2, 64, torch.float32
    pool = PagedPool(rng, [3, 70], 16, nkv, hd, dtype)
    q = torch.randn(2, nh, hd)
    out = _decode(harness, q, pool, nh, nkv, hd, splits=8, tps=16)  # seq 0 leaves 7 splits empty
    for b in range(2):
        k, v = pool.gather(b)
        ref = causal_attention(q[b : b + 1], k, v, pool.lens[b] - 1)[0]
        torch.testing.assert_close(out[b], ref, atol=2e-5, rtol=0)
    pool.seq_lens[0] = 0
    out = _decode(harness, q, pool, nh, nkv, hd, splits=1, tps=0)
    assert torch.equal(out[0], torch.zeros(nh, hd))


@pytest.mark.parametrize("hd", L.SUPPORTED_HEAD_DIMS)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_prefill_matches_reference(harness, dtype, hd):
    rng = random.Random(f"prefill-{dtype}-{hd}")
    nkv = rng.choice([1, 2])
    nh = nkv * rng.choice([1, 2, 4, 12])
    page = rng.choice(PAGE_SIZES)
    batch = 2
    q_lens = [rng.randint(1, 40), rng.randint(1, 20)]
    prefixes = [rng.randint(0, 60), rng.randint(0, 30)]
    lens = [p + n for p, n in zip(prefixes, q_lens, strict=True)]
    pool = PagedPool(rng, lens, page, nkv, hd, dtype)
    q = torch.randn(sum(q_lens), nh, hd).to(dtype)
    cu = torch.tensor([0, q_lens[0], sum(q_lens)], dtype=torch.int32)
    out = torch.empty_like(q)
    cfg = L.prefill_launch(batch, max(q_lens), nh, nkv, hd, dtype)
    harness.launch(
        cfg, [out, q, pool.k, pool.v, pool.table, pool.seq_lens, cu, nh, nkv, page, pool.max_blocks, hd**-0.5]
    )
    for b in range(batch):
        k, v = pool.gather(b)
        ref = causal_attention(q[cu[b] : cu[b + 1]].float(), k, v, prefixes[b])
        torch.testing.assert_close(
            out[cu[b] : cu[b + 1]].float(),
            ref,
            atol=ATOL[dtype],
            rtol=0,
            msg=lambda m, b=b, p=page: f"seq {b} page={p}: {m}",
        )


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_kv_write_by_slot_mapping(harness, dtype):
    rng = random.Random(f"write-{dtype}")
    nkv, hd, page, num_blocks = 2, 64, 4, 6
    k_pool = torch.randn(num_blocks, page, nkv, hd).to(dtype)
    v_pool = torch.randn(num_blocks, page, nkv, hd).to(dtype)
    expect_k, expect_v = k_pool.clone(), v_pool.clone()
    slots = rng.sample(range(num_blocks * page), 9) + [-1]  # -1: padding row, skipped
    k = torch.randn(len(slots), nkv, hd).to(dtype)
    v = torch.randn(len(slots), nkv, hd).to(dtype)
    slot_mapping = torch.tensor(slots, dtype=torch.int64)
    row = L.check_kv_row(nkv, hd, dtype)
    harness.launch(L.kv_write_launch(len(slots), dtype), [k_pool, v_pool, k, v, slot_mapping, row])
    keep = slot_mapping >= 0
    expect_k.view(-1, nkv, hd).index_copy_(0, slot_mapping[keep], k[keep])
    expect_v.view(-1, nkv, hd).index_copy_(0, slot_mapping[keep], v[keep])
    assert torch.equal(k_pool, expect_k) and torch.equal(v_pool, expect_v)


def test_write_then_prefill_then_decode_steps(harness):
    """The engine's order: write the chunk's K/V, prefill over the pool, then graph-style decode steps."""
    rng = random.Random(11)
    nh, nkv, hd, page, dtype = 8, 2, 64, 4, torch.float16
    num_blocks, max_blocks = 12, 8
    k_pool = torch.zeros(num_blocks, page, nkv, hd, dtype=dtype)
    v_pool = torch.zeros_like(k_pool)
    physical = list(range(num_blocks))
    rng.shuffle(physical)
    table = torch.full((1, max_blocks), -1, dtype=torch.int32)
    table[0, :5] = torch.tensor(physical[:5], dtype=torch.int32)
    total = 19
    ks, vs = torch.randn(total, nkv, hd).to(dtype), torch.randn(total, nkv, hd).to(dtype)
    qs = torch.randn(total, nh, hd).to(dtype)
    prompt = 13
    slots = torch.tensor([int(table[0, t // page]) * page + t % page for t in range(prompt)], dtype=torch.int64)
    row = L.check_kv_row(nkv, hd, dtype)
    harness.launch(L.kv_write_launch(prompt, dtype), [k_pool, v_pool, ks[:prompt], vs[:prompt], slots, row])
    out = torch.empty(prompt, nh, hd, dtype=dtype)
    seq_lens = torch.tensor([prompt], dtype=torch.int32)
    cu = torch.tensor([0, prompt], dtype=torch.int32)
    harness.launch(
        L.prefill_launch(1, prompt, nh, nkv, hd, dtype),
        [out, qs[:prompt], k_pool, v_pool, table, seq_lens, cu, nh, nkv, page, max_blocks, hd**-0.5],
    )
    ref = causal_attention(qs[:prompt].float(), ks[:prompt].float(), vs[:prompt].float(), 0)
    torch.testing.assert_close(out.float(), ref, atol=2e-3, rtol=0)
    # A graph's split plan is fixed by the capacity (max_blocks * page), not by the current length.
    splits, tps = L.choose_decode_splits(max_blocks * page, 1, nkv, 16, min_tokens_per_split=8)
    assert splits > 1
    part_out, part_lse = torch.empty(1, nh, splits, hd), torch.empty(1, nh, splits)
    counters = torch.zeros(L.decode_counters(L.decode_launch(1, nh, nkv, hd, dtype, splits)), dtype=torch.int32)
    slot = torch.zeros(1, dtype=torch.int64)  # the static step's fixed slot buffer
    for t in range(prompt, total):  # crosses the page boundaries at 16
        seq_lens[0] = t + 1  # the host refills the fixed buffers before each step, as before a graph replay
        slot[0] = int(table[0, t // page]) * page + t % page
        harness.launch(L.kv_write_launch(1, dtype), [k_pool, v_pool, ks[t : t + 1], vs[t : t + 1], slot, row])
        step = torch.empty(1, nh, hd, dtype=dtype)
        harness.launch(
            L.decode_launch(1, nh, nkv, hd, dtype, splits),
            [
                step,
                part_out,
                part_lse,
                counters,
                qs[t : t + 1],
                k_pool,
                v_pool,
                table,
                seq_lens,
                nh,
                nkv,
                page,
                max_blocks,
                tps,
                nh * hd,
                hd**-0.5,
            ],
        )
        ref = causal_attention(qs[t : t + 1].float(), ks[: t + 1].float(), vs[: t + 1].float(), t)
        torch.testing.assert_close(step.float(), ref, atol=2e-3, rtol=0, msg=lambda m, t=t: f"decode slot {t}: {m}")


def test_harness_catches_out_of_bounds_and_wrong_block_size(harness):
    """The safety net itself works: a table entry past the pool and mismatched launches (block size, shared
    memory below the staging area's) all fail loudly."""
    rng = random.Random(3)
    nh, nkv, hd = 2, 1, 64
    pool = PagedPool(rng, [10], 4, nkv, hd, torch.float32)
    q = torch.randn(1, nh, hd)
    pool.table[0, 1] = pool.k.shape[0] + 5  # points past the pool
    with pytest.raises(HarnessError, match="out-of-bounds"):
        _decode(harness, q, pool, nh, nkv, hd, 1, 0)
    cfg = L.decode_launch(1, nh, nkv, hd, torch.float32)
    out = torch.empty_like(q)
    args = [out, None, None, None, q, pool.k, pool.v, pool.table, pool.seq_lens, nh, nkv, 4, 3, 0, nh * hd, 0.1]
    for bad in (
        L.LaunchConfig(cfg.kernel, cfg.grid, (64, 1, 1), cfg.shared_bytes),
        L.LaunchConfig(cfg.kernel, cfg.grid, cfg.block, L.DECODE_WARPS * 2 * (hd + 2) * 4),  # the merge buffer only
    ):
        with pytest.raises(HarnessError, match="trap"):
            harness.launch(bad, args)
