"""Pool exhaustion: typed error at exactly the right token, no state change, no leak, pool reusable."""

from __future__ import annotations

import pytest
import torch

from orin_vlm_node.kvcache import (
    ContextLimitExceeded,
    ContiguousKVCache,
    KVCacheConfig,
    PagedKVCache,
    PoolExhausted,
    causal_attention,
)


def _cfg(**kw) -> KVCacheConfig:
    base = dict(num_layers=1, num_kv_heads=1, head_dim=4, page_size=4, kv_pool_blocks=5, max_context_tokens=64)
    base.update(kw)
    return KVCacheConfig(**base)


def _decode(cache, seq, n: int) -> None:
    for _ in range(n):
        attn = cache.step(seq, 1)
        attn(0, torch.randn(1, 1, 4), torch.randn(1, 1, 4), torch.randn(1, 1, 4))


@pytest.mark.parametrize("page_size,num_blocks", [(4, 5), (1, 7), (16, 2)])
def test_decode_raises_at_exactly_pool_capacity_and_pool_serves_next_request(page_size, num_blocks):
    cache = PagedKVCache(_cfg(page_size=page_size, kv_pool_blocks=num_blocks))
    capacity = page_size * num_blocks
    seq = cache.new_sequence()
    cache.step(seq, 3)(0, torch.randn(3, 1, 4), torch.randn(3, 1, 4), torch.randn(3, 1, 4))
    _decode(cache, seq, capacity - 3)  # fills the pool to the last slot
    assert cache.length(seq) == capacity and cache.stats()["blocks_free"] == 0
    table = cache.block_table(seq)
    with pytest.raises(PoolExhausted, match=f"from {capacity} to {capacity + 1} tokens"):
        cache.step(seq, 1)
    assert cache.length(seq) == capacity and cache.block_table(seq) == table
    cache.release(seq)
    stats = cache.stats()
    assert stats["blocks_free"] == num_blocks and stats["blocks_used"] == 0 and stats["tokens_stored"] == 0
    # The next request gets the whole pool and computes correctly.
    nxt = cache.new_sequence()
    q, k, v = torch.randn(capacity, 1, 4), torch.randn(capacity, 1, 4), torch.randn(capacity, 1, 4)
    out = cache.step(nxt, capacity)(0, q, k, v)
    torch.testing.assert_close(out, causal_attention(q, k, v, 0))


def test_prefill_too_large_changes_nothing():
    cache = PagedKVCache(_cfg())
    other = cache.new_sequence()
    cache.step(other, 9)  # 3 blocks
    seq = cache.new_sequence()
    with pytest.raises(PoolExhausted) as info:
        cache.step(seq, 9)  # needs 3, 2 free
    assert (info.value.needed_blocks, info.value.free_blocks) == (3, 2)
    assert cache.length(seq) == 0 and cache.block_table(seq) == []
    assert cache.stats()["blocks_free"] == 2
    cache.step(seq, 8)  # exactly what is left
    assert cache.stats()["blocks_free"] == 0


def test_static_decode_exhaustion_leaves_buffers_and_sequence_alone():
    cache = PagedKVCache(_cfg(kv_pool_blocks=2))
    seq = cache.new_sequence()
    cache.step(seq, 8)
    buffers = cache.new_static_decode_buffers()
    with pytest.raises(PoolExhausted):
        cache.prepare_static_decode(seq, buffers)
    assert cache.length(seq) == 8 and int(buffers.kv_len) == 0


def test_contiguous_exhausts_on_sequences_not_tokens():
    cache = ContiguousKVCache(_cfg(kv_pool_blocks=32, max_context_tokens=64))  # 128 tokens = 2 slabs of 64
    a, b = cache.new_sequence(), cache.new_sequence()
    with pytest.raises(PoolExhausted, match="slab"):
        cache.new_sequence()
    cache.release(a)
    cache.release(b)
    assert cache.stats()["blocks_free"] == 2


@pytest.mark.parametrize("cache_cls", [PagedKVCache, ContiguousKVCache])
def test_context_limit_is_a_value_error_before_any_change(cache_cls):
    cache = cache_cls(_cfg(kv_pool_blocks=64, max_context_tokens=16))
    seq = cache.new_sequence()
    cache.step(seq, 10)
    with pytest.raises(ContextLimitExceeded, match="max_context_tokens=16"):
        cache.step(seq, 7)
    assert cache.length(seq) == 10
    with pytest.raises(ValueError, match="unknown or released"):
        cache.step(12345, 1)
