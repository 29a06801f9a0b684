"""Paged and contiguous caches give the same attention, equal to the reference on the whole sequence.

Lengths cross page boundaries many times, in chunked prefill, eager decode and the static
(CUDA-graph-style) decode path: the page boundary is where paged attention breaks when it breaks.
"""

from __future__ import annotations

import pytest
import torch

from orin_vlm_node.kvcache import ContiguousKVCache, KVCacheConfig, PagedKVCache, causal_attention

PREFILL_CHUNKS = (37, 50, 3)  # ends at 90: mid-page for every page size but 1 and 2
EAGER_DECODE = 30
STATIC_DECODE = 30
TOTAL = sum(PREFILL_CHUNKS) + EAGER_DECODE + STATIC_DECODE


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny matmuls: extra threads only fight the other test processes on a 2-core runner."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _run(cache, q, k, v):
    """Feed per-layer q/k/v (layers, T, heads, hd) through the cache; returns (layers, T, nq, hd)."""
    layers = q.shape[0]
    seq = cache.new_sequence()
    outs = [[] for _ in range(layers)]

    def run_step(attn, lo, hi):
        for layer in range(layers):
            outs[layer].append(attn(layer, q[layer, lo:hi], k[layer, lo:hi], v[layer, lo:hi]))

    pos = 0
    for n in PREFILL_CHUNKS:
        run_step(cache.step(seq, n), pos, pos + n)
        pos += n
    for _ in range(EAGER_DECODE):
        run_step(cache.step(seq, 1), pos, pos + 1)
        pos += 1
    buffers = cache.new_static_decode_buffers()
    attn = cache.static_decode_attention(buffers)  # built once, like a captured graph
    for _ in range(STATIC_DECODE):
        cache.prepare_static_decode(seq, buffers)
        run_step(attn, pos, pos + 1)
        pos += 1
    assert cache.length(seq) == TOTAL
    return torch.stack([torch.cat(o) for o in outs])


@pytest.mark.parametrize(
    "page_size,nkv,group,hd",
    [(1, 1, 1, 8), (2, 2, 3, 16), (4, 4, 2, 32), (16, 2, 4, 16), (64, 1, 2, 8), (4, 1, 1, 8), (16, 4, 2, 32)],
)
def test_paged_equals_contiguous_equals_reference(page_size, nkv, group, hd):
    layers = 2
    gen = torch.Generator().manual_seed(page_size * 1000 + nkv * 10 + hd)
    q = torch.randn(layers, TOTAL, nkv * group, hd, generator=gen)
    k = torch.randn(layers, TOTAL, nkv, hd, generator=gen)
    v = torch.randn(layers, TOTAL, nkv, hd, generator=gen)
    cfg = KVCacheConfig(
        num_layers=layers,
        num_kv_heads=nkv,
        head_dim=hd,
        page_size=page_size,
        max_context_tokens=256,
        kv_pool_blocks=None,
    )
    paged_cache = PagedKVCache(cfg)
    paged = _run(paged_cache, q, k, v)
    contiguous = _run(ContiguousKVCache(cfg), q, k, v)
    assert torch.equal(paged, contiguous)
    for layer in range(layers):
        expected = causal_attention(q[layer], k[layer], v[layer], 0)
        torch.testing.assert_close(paged[layer], expected, rtol=1e-5, atol=1e-5)
    # The pages really are scattered through the pool, not one contiguous run by accident.
    assert paged_cache.stats()["blocks_used"] == -(-TOTAL // page_size)


def test_bf16_pools_match_bf16_reference():
    layers, nkv, group, hd = 1, 2, 2, 64
    cfg = KVCacheConfig(num_layers=layers, num_kv_heads=nkv, head_dim=hd, dtype=torch.bfloat16, page_size=16)
    q = torch.randn(layers, TOTAL, nkv * group, hd).bfloat16()
    k = torch.randn(layers, TOTAL, nkv, hd).bfloat16()
    v = torch.randn(layers, TOTAL, nkv, hd).bfloat16()
    paged = _run(PagedKVCache(cfg), q, k, v)
    assert torch.equal(paged, _run(ContiguousKVCache(cfg), q, k, v))
    torch.testing.assert_close(paged[0], causal_attention(q[0], k[0], v[0], 0), rtol=2e-2, atol=2e-2)


def test_scattered_blocks_after_other_sequences_released():
    """A sequence whose blocks come back from the free list in several runs still reads its own pages."""
    cfg = KVCacheConfig(num_layers=1, num_kv_heads=1, head_dim=8, page_size=4, kv_pool_blocks=12, max_context_tokens=64)
    cache = PagedKVCache(cfg)
    fillers = [cache.new_sequence() for _ in range(3)]
    for i, s in enumerate(fillers):
        cache.ensure_capacity(s, 4 * (i + 2))
    cache.release(fillers[1])
    cache.release(fillers[0])
    seq = cache.new_sequence()
    q, k, v = torch.randn(30, 2, 8), torch.randn(30, 1, 8), torch.randn(30, 1, 8)
    out = torch.cat(
        [cache.step(seq, 10)(0, q[:10], k[:10], v[:10])]
        + [cache.step(seq, 1)(0, q[i : i + 1], k[i : i + 1], v[i : i + 1]) for i in range(10, 30)]
    )
    from orin_vlm_node.kvcache.attention import block_runs

    assert len(block_runs(cache.block_table(seq))) > 1
    torch.testing.assert_close(out, causal_attention(q, k, v, 0), rtol=1e-6, atol=1e-6)


def test_step_rejects_mismatched_shapes():
    cfg = KVCacheConfig(num_layers=1, num_kv_heads=2, head_dim=8, page_size=4)
    for cache in (PagedKVCache(cfg), ContiguousKVCache(cfg)):
        attn = cache.step(cache.new_sequence(), 3)
        with pytest.raises(ValueError, match="k/v of shape"):
            attn(0, torch.randn(3, 4, 8), torch.randn(2, 2, 8), torch.randn(2, 2, 8))
        with pytest.raises(ValueError, match="q of shape"):
            attn(0, torch.randn(3, 3, 8), torch.randn(3, 2, 8), torch.randn(3, 2, 8))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (paged cache on the GPU)")
@pytest.mark.parametrize("page_size", [1, 16])
def test_paged_on_cuda_matches_cpu_reference(page_size):
    """Device block tables uploaded incrementally, host-computed slot mappings sent per step, static
    decode buffers refilled in place: the GPU run must equal the CPU reference."""
    layers, nkv, group, hd = 2, 2, 2, 32
    gen = torch.Generator().manual_seed(page_size)
    q = torch.randn(layers, TOTAL, nkv * group, hd, generator=gen)
    k = torch.randn(layers, TOTAL, nkv, hd, generator=gen)
    v = torch.randn(layers, TOTAL, nkv, hd, generator=gen)
    cfg = KVCacheConfig(
        num_layers=layers, num_kv_heads=nkv, head_dim=hd, page_size=page_size, max_context_tokens=256, device="cuda"
    )
    out = _run(PagedKVCache(cfg), q.cuda(), k.cuda(), v.cuda()).cpu()
    for layer in range(layers):
        torch.testing.assert_close(out[layer], causal_attention(q[layer], k[layer], v[layer], 0), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("num_q", [1, 5])
@pytest.mark.parametrize("layout", ["consecutive", "shuffled"])
def test_torch_paged_attend_reads_consecutive_and_scattered_pages_alike(layout, num_q):
    """A decode query reads every run of consecutive blocks in place, one softmax over all runs: one run
    gives exactly the contiguous result, scattered blocks the same up to float rounding. A multi-token step
    (the CPU's fused kernel) takes the runs as one tensor: exactly the contiguous result either way. Both
    agree with the reference formula to float rounding."""
    from orin_vlm_node.kvcache.attention import StepBlocks, TorchPagedAttention, block_runs
    from orin_vlm_node.kvcache.fused_prefill import cpu_sdpa_maps_kv_heads, step_attention, uses_fused_prefill

    gen = torch.Generator().manual_seed(5)
    page, nkv, nq, hd, kv_len = 4, 2, 4, 8, 23
    blocks_needed = -(-kv_len // page)
    k = torch.randn(kv_len, nkv, hd, generator=gen)
    v = torch.randn(kv_len, nkv, hd, generator=gen)
    q = torch.randn(num_q, nq, hd, generator=gen)
    if layout == "consecutive":
        table = torch.arange(3, 3 + blocks_needed, dtype=torch.int32)
    else:
        table = torch.randperm(12, generator=gen)[:blocks_needed].to(torch.int32)
    k_pool = torch.full((12, page, nkv, hd), float("nan"))  # unused pages are poison
    v_pool = torch.full((12, page, nkv, hd), float("nan"))
    slots = (table.long()[:, None] * page + torch.arange(page)).flatten()[:kv_len]
    impl = TorchPagedAttention()
    impl.write_kv(k_pool, v_pool, k, v, slots)
    # Trailing table entries past kv_len (-1: unallocated) must not be read either way.
    padded = torch.cat([table, torch.full((3,), -1, dtype=torch.int32)])
    blocks = StepBlocks(padded, block_runs(table.tolist()))
    assert (len(blocks.runs) == 1) == (layout == "consecutive")
    out = impl.attend(q, k_pool, v_pool, blocks, kv_len - num_q, kv_len)
    fused = num_q > 1 and cpu_sdpa_maps_kv_heads(torch.__version__)
    assert uses_fused_prefill(q) == fused
    tol = 0 if layout == "consecutive" or fused else 1e-6
    torch.testing.assert_close(out, step_attention(q, [k], [v], kv_len - num_q), rtol=tol, atol=tol)
    torch.testing.assert_close(out, causal_attention(q, k, v, kv_len - num_q), rtol=1e-6, atol=1e-6)
