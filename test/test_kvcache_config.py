"""Pool sizing and config validation: explicit sizes, memory fraction, warnings and refusals."""

from __future__ import annotations

import logging

import pytest
import torch

import orin_vlm_node.kvcache.config as kv_config
from orin_vlm_node.kvcache import ContiguousKVCache, KVCache, KVCacheConfig, PagedKVCache, plan_pool

# 2 layers * 2 (K,V) * 2 heads * 8 dims * 4 bytes = 256 bytes per token
SHAPE = dict(num_layers=2, num_kv_heads=2, head_dim=8, dtype=torch.float32)


def test_bytes_per_token_and_block():
    cfg = KVCacheConfig(**SHAPE, page_size=16)
    assert cfg.bytes_per_token == 2 * 2 * 2 * 8 * 4
    assert cfg.bytes_per_block == 16 * cfg.bytes_per_token
    bf16 = KVCacheConfig(num_layers=28, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16)
    assert bf16.bytes_per_token == 28 * 2 * 8 * 128 * 2


def test_sizing_priority_blocks_then_mb_then_fraction(monkeypatch):
    monkeypatch.setattr(kv_config, "available_memory_bytes", lambda device: 10 * 2**20)
    both = KVCacheConfig(**SHAPE, page_size=16, num_blocks=7, pool_mb=1.0, max_context_tokens=64)
    assert plan_pool(both).num_blocks == 7 and plan_pool(both).source == "num_blocks"
    mb = KVCacheConfig(**SHAPE, page_size=16, pool_mb=1.0, max_context_tokens=64)
    assert plan_pool(mb).num_blocks == 2**20 // (16 * 256)
    frac = KVCacheConfig(**SHAPE, page_size=16, memory_fraction=0.5, max_context_tokens=64)
    plan = plan_pool(frac)
    assert plan.num_blocks == (5 * 2**20) // (16 * 256) and plan.source == "memory_fraction"
    default = KVCacheConfig(**SHAPE, page_size=16, max_context_tokens=100)
    assert plan_pool(default).num_blocks == 7  # ceil(100 / 16): one full context


def test_cpu_available_memory_comes_from_meminfo():
    free = kv_config.available_memory_bytes(torch.device("cpu"))
    with open("/proc/meminfo") as f:
        total_kb = int(next(line for line in f if line.startswith("MemTotal:")).split()[1])
    assert 0 < free <= total_kb * 1024
    with pytest.raises(ValueError, match="not supported on device meta"):
        kv_config.available_memory_bytes(torch.device("meta"))


def test_chosen_size_is_logged_and_small_pool_warns_with_both_numbers(caplog):
    cfg = KVCacheConfig(**SHAPE, page_size=16, num_blocks=4, max_context_tokens=4096)
    with caplog.at_level(logging.INFO, logger="orin_vlm_node.kvcache.config"):
        cache = PagedKVCache(cfg)
    text = caplog.text
    assert "4 blocks x 16 tokens = 64 tokens, 0.0 MB" in text
    assert "64 tokens" in text and "max_context_tokens=4096" in text
    assert any(r.levelno == logging.WARNING for r in caplog.records)
    assert cache.stats()["pool_bytes"] == 4 * cfg.bytes_per_block


def test_pool_below_two_blocks_is_refused_with_reason():
    with pytest.raises(ValueError, match="at least 2 blocks"):
        PagedKVCache(KVCacheConfig(**SHAPE, page_size=16, num_blocks=1))
    with pytest.raises(ValueError, match="at least 2 blocks"):
        PagedKVCache(KVCacheConfig(**SHAPE, page_size=16, pool_mb=0.001))
    with pytest.raises(ValueError, match="cannot hold one"):
        ContiguousKVCache(KVCacheConfig(**SHAPE, page_size=16, num_blocks=3, max_context_tokens=64))


@pytest.mark.parametrize(
    "field,value,match",
    [
        ("page_size", 3, "power of two"),
        ("page_size", 512, "power of two"),
        ("page_size", 0, "power of two"),
        ("num_layers", 0, "positive int"),
        ("memory_fraction", 1.5, r"\[0, 1\]"),
        ("pool_mb", -1.0, "non-negative"),
        ("num_blocks", -2, "non-negative"),
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
    cache = PagedKVCache(KVCacheConfig(**SHAPE, page_size=page_size, num_blocks=2, device="meta"))
    assert isinstance(cache, KVCache)
    assert tuple(cache.k_pool(1).shape) == (2, page_size, 2, 8)


def test_contiguous_reports_prefix_caching_unsupported():
    cache = ContiguousKVCache(KVCacheConfig(**SHAPE, page_size=16, max_context_tokens=32, prefix_caching=True))
    assert isinstance(cache, KVCache) and not cache.supports_prefix_caching
    assert cache.set_prefix_caching(True) is False and cache.stats()["prefix_caching"] is False
    seq = cache.new_sequence()
    assert cache.attach_prefix(seq, [1, 2, 3]) == 0 and cache.match_prefix([1, 2, 3]) == 0
