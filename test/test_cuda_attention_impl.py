"""``CudaPagedAttention`` (the kvcache PagedAttentionImpl of the CUDA layer) driven through a real
``PagedKVCache``, with the kernels running in the CPU harness, against the torch implementation.
Also the CPU behaviour of ``select_backend`` and ``DecodeGraph``."""

from __future__ import annotations

import shutil

import pytest
import torch
from cuda_harness.harness import Harness, build

from orin_vlm_node.cuda import CudaPagedAttention, DecodeGraph, select_backend
from orin_vlm_node.kvcache.attention import TorchPagedAttention
from orin_vlm_node.kvcache.config import KVCacheConfig
from orin_vlm_node.kvcache.paged import PagedKVCache


@pytest.fixture(scope="session")
def harness(tmp_path_factory) -> Harness:
    if not shutil.which("g++"):
        pytest.skip("g++ not found: cannot build the CUDA CPU harness")
    lib, _ = build(tmp_path_factory.getbasetemp() / "cuda_harness")  # shared by the cuda test files
    return Harness(lib)


def _caches(impl, dtype, page, nkv=2, hd=64, max_ctx=96):
    cfg = KVCacheConfig(
        num_layers=2,
        num_kv_heads=nkv,
        head_dim=hd,
        dtype=dtype,
        page_size=page,
        num_blocks=40,
        max_context_tokens=max_ctx,
        prefix_caching=False,
    )
    return PagedKVCache(cfg, attention_impl=impl), PagedKVCache(cfg, attention_impl=TorchPagedAttention())


@pytest.mark.parametrize(
    ("dtype", "page", "nq"), [(torch.float32, 4, 8), (torch.float16, 16, 4), (torch.bfloat16, 1, 2)]
)
def test_prefill_chunks_and_static_decode_match_torch_impl(harness, dtype, page, nq):
    # min_tokens_per_split small so the decode plan really splits at this capacity.
    impl = CudaPagedAttention(harness, sm_count=16, min_tokens_per_split=16)
    ours, ref = _caches(impl, dtype, page)
    nkv, hd = 2, 64
    atol = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 3e-2}[dtype]
    sa, sb = ours.new_sequence(), ref.new_sequence()
    gen = torch.Generator().manual_seed(5)
    for chunk in (7, 6):  # two prefill chunks: the second attends to the first through the pool
        step_a, step_b = ours.step(sa, chunk), ref.step(sb, chunk)
        for layer in range(2):
            q = torch.randn(chunk, nq, hd, generator=gen).to(dtype)
            k = torch.randn(chunk, nkv, hd, generator=gen).to(dtype)
            v = torch.randn(chunk, nkv, hd, generator=gen).to(dtype)
            torch.testing.assert_close(step_a(layer, q, k, v), step_b(layer, q, k, v), atol=atol, rtol=0)
    buf_a, buf_b = ours.new_static_decode_buffers(), ref.new_static_decode_buffers()
    dec_a, dec_b = ours.static_decode_attention(buf_a), ref.static_decode_attention(buf_b)
    assert impl.decode_plan(buf_a.block_table.numel() * page, nkv)[0] > 1
    # Slots 13..24 cross page boundaries; the host half runs before each step, as before a graph replay.
    for _ in range(12):
        ours.prepare_static_decode(sa, buf_a)
        ref.prepare_static_decode(sb, buf_b)
        for layer in range(2):
            q = torch.randn(1, nq, hd, generator=gen).to(dtype)
            k = torch.randn(1, nkv, hd, generator=gen).to(dtype)
            v = torch.randn(1, nkv, hd, generator=gen).to(dtype)
            torch.testing.assert_close(dec_a(layer, q, k, v), dec_b(layer, q, k, v), atol=atol, rtol=0)
    assert torch.equal(ours.kv_storage, ref.kv_storage)  # the write kernel placed every token identically


def test_unsupported_head_dim_uses_torch_path(harness, caplog):
    impl = CudaPagedAttention(harness)
    ours, ref = _caches(impl, torch.float32, 8, nkv=1, hd=32)
    sa, sb = ours.new_sequence(), ref.new_sequence()
    q, k, v = torch.randn(5, 2, 32), torch.randn(5, 1, 32), torch.randn(5, 1, 32)
    with caplog.at_level("WARNING"):
        out = ours.step(sa, 5)(0, q, k, v)
    torch.testing.assert_close(out, ref.step(sb, 5)(0, q, k, v))
    assert "do not cover this shape" in caplog.text


def test_select_backend_on_cpu():
    choice = select_backend("cpu", use_cuda_kernels=True, use_cuda_graph=True, kernel_cache_dir="")
    assert (choice.kernels, choice.graphs, choice.reason, choice.attention_impl) == (False, False, "cpu device", None)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU fallback")
def test_select_backend_cuda_without_gpu_falls_back_or_raises():
    choice = select_backend("cuda", True, True, "")
    assert not choice.kernels and not choice.graphs and "no GPU" in choice.reason
    with pytest.raises(RuntimeError, match="no GPU"):
        select_backend("cuda", True, True, "", allow_fallback=False)


def test_decode_graph_is_eager_on_cpu():
    calls = []
    runner = DecodeGraph(lambda: calls.append(1) or torch.ones(2), "cpu")
    assert torch.equal(runner.run(), torch.ones(2)) and torch.equal(runner(), torch.ones(2))
    assert len(calls) == 2 and not runner.captured and runner.describe()["eager_reason"] == "cpu device"
    runner.invalidate()
    assert runner.eager
