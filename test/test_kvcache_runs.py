"""Paged attention reads the pool in place, one view per run of consecutive blocks, and one softmax over all
runs: checked against the reference attention over the same keys and values laid out contiguously, for
tables of many runs, every page size from 1 to 256, and tables written by prefix sharing and copy-on-write.
The free list is LIFO, so sequential requests keep getting consecutive blocks.
"""

from __future__ import annotations

import pytest
import torch

from orin_vlm_node.kvcache import KVCacheConfig, PagedKVCache, causal_attention
from orin_vlm_node.kvcache.attention import block_runs

NKV, GROUP, HD = 2, 3, 16


def _cache(page_size: int, num_blocks: int, max_context: int = 1024) -> PagedKVCache:
    cfg = KVCacheConfig(
        num_layers=1,
        num_kv_heads=NKV,
        head_dim=HD,
        page_size=page_size,
        kv_pool_blocks=num_blocks,
        max_context_tokens=max_context,
        prefix_caching=True,
    )
    return PagedKVCache(cfg)


def _qkv(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(n, NKV * GROUP, HD, generator=g),
        torch.randn(n, NKV, HD, generator=g),
        torch.randn(n, NKV, HD, generator=g),
    )


def _run(cache: PagedKVCache, seq: int, q, k, v, pieces: list[int]) -> torch.Tensor:
    """Write and attend ``pieces`` tokens at a time (a prefill, then decode steps); outputs concatenated."""
    outs, start = [], cache.length(seq)
    for n in pieces:
        attn = cache.step(seq, n)
        outs.append(attn(0, q[start : start + n], k[start : start + n], v[start : start + n]))
        start += n
    return torch.cat(outs)


def _reference(q, k, v, first: int) -> torch.Tensor:
    """Queries ``first:`` attending causally over the contiguous rows, one query at a time where decoding."""
    return causal_attention(q[first:], k, v, first)


def test_block_runs():
    assert block_runs([]) == ()
    assert block_runs([7, 8, 9, 3, 4, 0]) == ((7, 3), (3, 2), (0, 1))
    assert block_runs([5, 4]) == ((5, 1), (4, 1))  # descending neighbours are two runs


@pytest.mark.parametrize("page_size", [1, 2, 4, 8, 16, 32, 64, 128, 256])
def test_a_table_of_many_runs_attends_like_contiguous_rows(page_size):
    """Three sequences grow in turn, so their blocks interleave; the last one's table is many short runs."""
    tokens = 3 * page_size + page_size // 2 + 1  # several pages, the last one partly filled
    cache = _cache(page_size, num_blocks=3 * (tokens // page_size + 2))
    seqs = [cache.new_sequence() for _ in range(3)]
    data = {s: _qkv(tokens, seed=s) for s in seqs}
    outs = {s: [] for s in seqs}
    for start in range(0, tokens, page_size):  # one page per sequence per round
        n = min(page_size, tokens - start)
        for s in seqs:
            q, k, v = data[s]
            outs[s].append(_run(cache, s, q[: start + n], k[: start + n], v[: start + n], [n]))
    target = seqs[-1]
    runs = block_runs(cache.block_table(target))
    assert len(runs) == len(cache.block_table(target)) > 1  # no two of its blocks are neighbours
    for s in seqs:
        q, k, v = data[s]
        torch.testing.assert_close(torch.cat(outs[s]), _reference(q, k, v, 0), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_decode_over_many_runs_matches_the_reference(page_size):
    """Decode steps (one query) over a fragmented table, crossing page boundaries as it grows."""
    cache = _cache(page_size, num_blocks=2 * (40 // page_size + 1))
    filler = cache.new_sequence()
    seq = cache.new_sequence()
    q, k, v = _qkv(40, seed=3)
    fq, fk, fv = _qkv(40, seed=4)
    out = []
    for _ in range(40):  # filler and target take turns: one token each
        _run(cache, filler, fq, fk, fv, [1])
        out.append(_run(cache, seq, q, k, v, [1]))
    assert len(block_runs(cache.block_table(seq))) > 1
    torch.testing.assert_close(torch.cat(out), _reference(q, k, v, 0), rtol=1e-5, atol=1e-5)


def test_prefix_shared_blocks_then_own_blocks():
    """A second sequence attaches the first's cached prefix blocks and continues in blocks of its own."""
    page = 4
    cache = _cache(page, num_blocks=32)
    prompt = list(range(11))  # two full pages cached, the rest recomputed
    q, k, v = _qkv(20, seed=5)
    first = cache.new_sequence()
    _run(cache, first, q, k, v, [len(prompt)])
    cache.register_prefix(first, prompt)
    other = cache.new_sequence()  # takes a block between, so the second's own blocks are not neighbours
    _run(cache, other, *_qkv(6, seed=6), [6])
    second = cache.new_sequence()
    hit = cache.attach_prefix(second, prompt)
    assert hit == 8
    out = _run(cache, second, q, k, v, [len(prompt) - hit] + [1] * 9)
    table = cache.block_table(second)
    assert table[:2] == cache.block_table(first)[:2] and len(block_runs(table)) > 1
    torch.testing.assert_close(out, _reference(q, k, v, hit), rtol=1e-5, atol=1e-5)


def test_copy_on_write_table_attends_its_own_rows():
    """A fork shares every block; writing into the shared last page copies it; both read their own rows."""
    page = 4
    cache = _cache(page, num_blocks=32)
    q, k, v = _qkv(14, seed=7)
    parent = cache.new_sequence()
    _run(cache, parent, q, k, v, [6])
    child = cache.fork(parent)
    cq, ck, cv = _qkv(14, seed=8)
    ck[:6], cv[:6] = k[:6], v[:6]  # the shared history
    child_out = _run(cache, child, cq, ck, cv, [1] * 8)
    parent_out = _run(cache, parent, q, k, v, [1] * 8)
    assert cache.block_table(child)[0] == cache.block_table(parent)[0]  # the full first page stays shared
    assert cache.block_table(child)[1] != cache.block_table(parent)[1]  # the written page was copied
    torch.testing.assert_close(child_out, _reference(cq, ck, cv, 6), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(parent_out, _reference(q, k, v, 6), rtol=1e-5, atol=1e-5)


def test_lifo_free_list_keeps_sequential_requests_consecutive():
    """Requests of mixed lengths one after another: every table is one run (the old FIFO list scattered them)."""
    page = 4
    cache = _cache(page, num_blocks=64)
    for i, n in enumerate([30, 5, 60, 17, 2, 44, 9, 120, 33]):
        seq = cache.new_sequence()
        q, k, v = _qkv(n, seed=i)
        _run(cache, seq, q, k, v, [max(1, n // 2)] + [1] * (n - max(1, n // 2)))
        assert len(block_runs(cache.block_table(seq))) == 1, (i, cache.block_table(seq))
        cache.release(seq)
