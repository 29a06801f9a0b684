"""Fork + copy-on-write: forks share pages until one writes into a shared page."""

from __future__ import annotations

import pytest
import torch

from orin_vlm_node.kvcache import ContiguousKVCache, KVCacheConfig, PagedKVCache, PoolExhausted, causal_attention

NKV, HD, LAYERS = 2, 4, 3


def _cfg(**kw) -> KVCacheConfig:
    base = dict(num_layers=LAYERS, num_kv_heads=NKV, head_dim=HD, page_size=4, kv_pool_blocks=16, max_context_tokens=64)
    base.update(kw)
    return KVCacheConfig(**base)


def _write(cache, seq, k: torch.Tensor, v: torch.Tensor) -> list[torch.Tensor]:
    """Append k/v (L, nkv, hd) to every layer (layer l stores k + l); returns per-layer attention outputs."""
    attn = cache.step(seq, k.shape[0])
    q = torch.randn(k.shape[0], NKV * 2, HD)
    return [attn(layer, q, k + layer, v + layer) for layer in range(LAYERS)]


def _gather(cache: PagedKVCache, seq: int) -> torch.Tensor:
    table = torch.tensor(cache.block_table(seq))
    return cache.kv_storage[:, :, table].flatten(2, 3)[:, :, : cache.length(seq)]


@pytest.mark.parametrize("cache_cls", [PagedKVCache, ContiguousKVCache])
def test_forks_writing_into_the_same_partial_block_never_see_each_other(cache_cls):
    cache = cache_cls(_cfg(kv_pool_blocks=32))  # contiguous: two 64-token slabs
    parent = cache.new_sequence()
    k0, v0 = torch.randn(6, NKV, HD), torch.randn(6, NKV, HD)  # 6 tokens: block 1 half full
    _write(cache, parent, k0, v0)
    child = cache.fork(parent)
    assert cache.length(child) == 6
    if cache_cls is PagedKVCache:
        assert cache.block_table(child) == cache.block_table(parent)
        assert cache.stats()["blocks_used"] == 2
    k_p, v_p = torch.randn(3, NKV, HD), torch.randn(3, NKV, HD)
    k_c, v_c = torch.randn(3, NKV, HD), torch.randn(3, NKV, HD)
    q = torch.randn(1, NKV * 2, HD)
    _write(cache, parent, k_p, v_p)
    _write(cache, child, k_c, v_c)
    # Each branch attends over the common prefix + its own tokens only.
    for seq, (k_new, v_new) in ((parent, (k_p, v_p)), (child, (k_c, v_c))):
        k_all, v_all = torch.cat([k0, k_new]), torch.cat([v0, v_new])
        kd, vd = torch.randn(1, NKV, HD), torch.randn(1, NKV, HD)
        out = cache.step(seq, 1)(1, q, kd + 1, vd + 1)
        expected = causal_attention(q, torch.cat([k_all, kd]) + 1, torch.cat([v_all, vd]) + 1, 9)
        torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)
    if cache_cls is PagedKVCache:
        tp, tc = cache.block_table(parent), cache.block_table(child)
        assert tp[0] == tc[0] and tp[1] != tc[1]  # full block 0 still shared, block 1 copied
        assert cache.pool.refcount(tp[0]) == 2 and cache.pool.refcount(tp[1]) == 1
        for layer in range(LAYERS):  # the copy covered every layer
            torch.testing.assert_close(_gather(cache, child)[0, layer, :6], k0 + layer)
            torch.testing.assert_close(_gather(cache, parent)[1, layer, 6:9], v_p + layer)
            torch.testing.assert_close(_gather(cache, child)[1, layer, 6:9], v_c + layer)


def test_fork_at_page_boundary_needs_no_copy():
    cache = PagedKVCache(_cfg())
    parent = cache.new_sequence()
    _write(cache, parent, torch.randn(8, NKV, HD), torch.randn(8, NKV, HD))
    child = cache.fork(parent)
    used = cache.stats()["blocks_used"]
    _write(cache, child, torch.randn(1, NKV, HD), torch.randn(1, NKV, HD))
    _write(cache, parent, torch.randn(1, NKV, HD), torch.randn(1, NKV, HD))
    assert cache.stats()["blocks_used"] == used + 2  # one new page each, nothing copied
    assert cache.block_table(parent)[:2] == cache.block_table(child)[:2]


def test_copy_on_write_exhaustion_changes_nothing():
    cache = PagedKVCache(_cfg(kv_pool_blocks=3))
    parent = cache.new_sequence()
    _write(cache, parent, torch.randn(6, NKV, HD), torch.randn(6, NKV, HD))  # 2 blocks
    child = cache.fork(parent)
    filler = cache.new_sequence()
    cache.ensure_capacity(filler, 4)  # the last free block
    before = (cache.block_table(child), cache.length(child), cache.stats())
    with pytest.raises(PoolExhausted) as info:
        cache.step(child, 1)  # needs a copy of the shared half-full block
    assert info.value.needed_blocks == 1 and info.value.free_blocks == 0
    assert (cache.block_table(child), cache.length(child), cache.stats()) == before
    cache.release(filler)
    _write(cache, child, torch.randn(1, NKV, HD), torch.randn(1, NKV, HD))
    assert cache.block_table(child)[1] != cache.block_table(parent)[1]
