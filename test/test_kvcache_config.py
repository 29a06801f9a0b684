"""Pool sizing and config validation: explicit sizes, sizing by need capped by free memory (discrete and
integrated GPUs faked), refusals with their numbers."""

from __future__ import annotations

import logging

import pytest
import torch

import orin_vlm_node.kvcache.memory as kv_memory
from orin_vlm_node.kvcache import ContiguousKVCache, KVCache, KVCacheConfig, PagedKVCache, plan_pool

# 2 layers * 2 (K,V) * 2 heads * 8 dims * 4 bytes = 256 bytes per token
SHAPE = dict(num_layers=2, num_kv_heads=2, head_dim=8, dtype=torch.float32)


def test_bytes_per_token_and_block():
    cfg = KVCacheConfig(**SHAPE, page_size=16)
    assert cfg.bytes_per_token == 2 * 2 * 2 * 8 * 4
    assert cfg.bytes_per_block == 16 * cfg.bytes_per_token
    bf16 = KVCacheConfig(num_layers=28, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16)
    assert bf16.bytes_per_token == 28 * 2 * 8 * 128 * 2


GIB = 2**30


def _free(monkeypatch, free_bytes: int, total_bytes: int = 16 * GIB) -> None:
    """Pretend the CPU has ``free_bytes`` available (what /proc/meminfo's MemAvailable would say)."""
    monkeypatch.setattr(kv_memory, "meminfo", lambda path=kv_memory.MEMINFO: (free_bytes, total_bytes))


def test_sizing_priority_blocks_then_mb_then_need(monkeypatch):
    _free(monkeypatch, 10 * 2**20)
    both = KVCacheConfig(**SHAPE, page_size=16, kv_pool_blocks=7, kv_pool_mb=1.0, max_context_tokens=64)
    assert plan_pool(both).num_blocks == 7 and plan_pool(both).source == "kv_pool_blocks"
    mb = KVCacheConfig(**SHAPE, page_size=16, kv_pool_mb=1.0, max_context_tokens=64)
    assert plan_pool(mb).num_blocks == 2**20 // (16 * 256)
    need = KVCacheConfig(**SHAPE, page_size=16, max_context_tokens=100)
    assert plan_pool(need).num_blocks == 7  # ceil(100 / 16): one context, no prefix share by default
    shared = KVCacheConfig(**SHAPE, page_size=16, max_context_tokens=100, sequences=3, kv_prefix_share=0.25)
    plan = plan_pool(shared)
    assert plan.num_blocks == 3 * 7 + 6 and plan.source == "auto"  # 21 blocks + ceil(21 * 0.25)
    assert "auto: 3 x 100-token context + 25% prefix-cache share" in plan.describe()
    contiguous = plan_pool(shared, contiguous=True)
    assert contiguous.num_blocks == 21  # slabs never serve prefixes: no share


def test_need_is_capped_by_free_memory_minus_the_reserve(monkeypatch):
    # 256 B per token, 4 KiB per block of 16; a 4096-token context is 256 blocks = 1 MiB.
    _free(monkeypatch, 3 * 2**20 + 2**19)
    cfg = KVCacheConfig(**SHAPE, page_size=16, max_context_tokens=4096, sequences=4, kv_memory_reserve_mb=1.0)
    plan = plan_pool(cfg)
    assert plan.source == "auto, capped by free memory" and plan.num_blocks == (2 * 2**20 + 2**19) // 4096
    assert "needs 4 MB, capped to 4 of" in plan.describe() and "reserve 1 MB" in plan.describe()
    # The pool being replaced is freed first: it counts as free.
    assert plan_pool(cfg, released_bytes=2**20).num_blocks == (3 * 2**20 + 2**19) // 4096
    strict = KVCacheConfig(
        **SHAPE, page_size=16, max_context_tokens=4096, kv_memory_reserve_mb=3.0, require_full_context=True
    )
    with pytest.raises(ValueError, match="cannot hold one max_context_tokens=4096 sequence"):
        plan_pool(strict)


def test_explicit_size_larger_than_free_memory_is_refused_with_the_numbers(monkeypatch):
    _free(monkeypatch, 50 * 2**20, 64 * 2**20)
    with pytest.raises(ValueError, match=r"KV pool of 64 MB \(kv_pool_mb=64\) does not fit: 50 of 64 MB free"):
        plan_pool(KVCacheConfig(**SHAPE, page_size=16, kv_pool_mb=64.0))
    with pytest.raises(ValueError, match="kv_pool_blocks=20000"):
        plan_pool(KVCacheConfig(**SHAPE, page_size=16, kv_pool_blocks=20_000))
    assert plan_pool(KVCacheConfig(**SHAPE, page_size=16, kv_pool_mb=64.0), released_bytes=16 * 2**20).num_blocks > 0


def test_integrated_gpu_sizes_from_system_memory_not_device_memory(monkeypatch):
    """A Jetson: is_integrated, so the pool is sized from MemAvailable (shared with the whole robot)."""

    class Props:
        is_integrated = True

    _free(monkeypatch, 3 * GIB, 8 * GIB)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: Props())
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda index: 300 * 2**20)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda index: 100 * 2**20)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda index: pytest.fail("cudaMemGetInfo is the wrong figure"))
    reading = kv_memory.device_memory(torch.device("cuda"))
    assert reading.free_bytes == 3 * GIB + 200 * 2**20 and reading.total_bytes == 8 * GIB
    assert "integrated GPU shares system memory" in reading.source
    # Qwen3-VL-2B fp16: 28 layers x 8 kv heads x 128 dims, 112 KiB per token; 8192 tokens = 896 MiB.
    cfg = KVCacheConfig(
        num_layers=28, num_kv_heads=8, head_dim=128, dtype=torch.float16, device="cuda", max_context_tokens=8192,
        sequences=1, kv_prefix_share=0.25, kv_memory_reserve_mb=1024,
    )  # fmt: skip
    plan = plan_pool(cfg)
    assert plan.bytes == 1120 * 2**20 and plan.source == "auto"  # one context x 1.25, well under 3 GB - 1 GB
    _free(monkeypatch, 1536 * 2**20, 8 * GIB)  # the robot's other software took the rest
    capped = plan_pool(cfg)
    assert capped.source == "auto, capped by free memory"
    block_mb = cfg.bytes_per_block / 2**20
    assert 1536 + 200 - 1024 - block_mb < capped.bytes / 2**20 <= 1536 + 200 - 1024


def test_discrete_gpu_sizes_from_cuda_free_memory(monkeypatch):
    class Props:
        is_integrated = False

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: Props())
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda index: 0)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda index: 0)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda index: (70 * GIB, 80 * GIB))
    reading = kv_memory.device_memory(torch.device("cuda", 0))
    assert (reading.free_bytes, reading.total_bytes, reading.source) == (70 * GIB, 80 * GIB, "cudaMemGetInfo")


def test_cpu_available_memory_comes_from_meminfo():
    reading = kv_memory.device_memory(torch.device("cpu"))
    with open("/proc/meminfo") as f:
        lines = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f}
    assert reading.total_bytes == lines["MemTotal"] and 0 < reading.free_bytes <= reading.total_bytes
    with pytest.raises(ValueError, match="not supported on device meta"):
        kv_memory.device_memory(torch.device("meta"))


def test_chosen_size_is_logged_with_its_reason_once_when_the_pool_is_made(caplog):
    """Logged by the cache that allocates the pool, once; a plan that only checks a change is not logged."""
    cfg = KVCacheConfig(**SHAPE, page_size=16, kv_pool_blocks=4, max_context_tokens=64)
    with caplog.at_level(logging.INFO, logger="orin_vlm_node.kvcache"):
        plan_pool(cfg)
        assert "KV pool" not in caplog.text
        cache = PagedKVCache(cfg)
        ContiguousKVCache(cfg)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("KV pool")]
    assert lines == ["KV pool: 4 blocks x 16 tokens = 64 tokens, 0.0 MB (kv_pool_blocks=4)"] * 2
    assert cache.stats()["pool_bytes"] == 4 * cfg.bytes_per_block
    assert cache.stats()["pool"] == cache.plan.describe()


def test_pool_below_two_blocks_is_refused_with_reason():
    with pytest.raises(ValueError, match="at least 2 blocks"):
        PagedKVCache(KVCacheConfig(**SHAPE, page_size=16, kv_pool_blocks=1))
    with pytest.raises(ValueError, match="at least 2 blocks"):
        PagedKVCache(KVCacheConfig(**SHAPE, page_size=16, kv_pool_mb=0.001))
    with pytest.raises(ValueError, match="cannot hold one"):
        ContiguousKVCache(KVCacheConfig(**SHAPE, page_size=16, kv_pool_blocks=3, max_context_tokens=64))


@pytest.mark.parametrize(
    "field,value,match",
    [
        ("page_size", 3, "power of two"),
        ("page_size", 512, "power of two"),
        ("page_size", 0, "power of two"),
        ("num_layers", 0, "positive int"),
        ("kv_prefix_share", -0.5, "kv_prefix_share"),
        ("kv_memory_reserve_mb", float("inf"), "kv_memory_reserve_mb"),
        ("sequences", 0, "positive int"),
        ("kv_pool_mb", -1.0, "non-negative"),
        ("kv_pool_blocks", -2, "non-negative"),
        ("dtype", torch.int32, "floating"),
        ("device", "gpu0", "device"),
    ],
)
def test_invalid_config_is_rejected_with_a_named_field(field, value, match):
    kwargs = dict(SHAPE, page_size=16)
    kwargs[field] = value
    with pytest.raises((ValueError, RuntimeError), match=match):
        KVCacheConfig(**kwargs)


@pytest.mark.parametrize("page_size", [1, 2, 4, 8, 16, 32, 64, 128, 256])
def test_every_power_of_two_page_size_builds(page_size):
    cache = PagedKVCache(KVCacheConfig(**SHAPE, page_size=page_size, kv_pool_blocks=2, device="meta"))
    assert isinstance(cache, KVCache)
    assert tuple(cache.k_pool(1).shape) == (2, page_size, 2, 8)


def test_contiguous_reports_prefix_caching_unsupported():
    cache = ContiguousKVCache(KVCacheConfig(**SHAPE, page_size=16, max_context_tokens=32, prefix_caching=True))
    assert isinstance(cache, KVCache) and not cache.supports_prefix_caching
    assert cache.set_prefix_caching(True) is False and cache.stats()["prefix_caching"] is False
    seq = cache.new_sequence()
    assert cache.attach_prefix(seq, [1, 2, 3]) == 0 and cache.match_prefix([1, 2, 3]) == 0
