"""The KV storage tensor on the CPU: zeroed, 2 MB-aligned, in transparent huge pages where the kernel
offers them, committed at allocation, and unmapped when the cache is gone."""

from __future__ import annotations

import gc
import re
from pathlib import Path

import pytest
import torch

from orin_vlm_node.kvcache import ContiguousKVCache, KVCacheConfig, PagedKVCache
from orin_vlm_node.kvcache.storage import HUGE_PAGE, allocate_kv_storage

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")
MAPS, SMAPS = Path("/proc/self/maps"), Path("/proc/self/smaps")


def _mapping_fields(address: int) -> dict[str, int] | None:
    """The smaps fields (kB) of the mapping holding ``address``, or None when nothing maps it."""
    fields: dict[str, int] | None = None
    for line in SMAPS.read_text().splitlines():
        head = re.match(r"^([0-9a-f]+)-([0-9a-f]+) ", line)
        if head:
            if fields is not None:
                return fields
            fields = {} if int(head[1], 16) <= address < int(head[2], 16) else None
        elif fields is not None and line.endswith(" kB"):
            key, value = line.split(":")
            fields[key] = int(value.split()[0])
    return fields


def _thp_mode() -> str:
    match = re.search(r"\[(\w+)\]", THP.read_text()) if THP.is_file() else None
    return match[1] if match else "absent"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_cpu_storage_is_zeroed_contiguous_and_starts_on_a_huge_page(dtype):
    shape = (2, 3, 40, 16, 8, 128)  # 15 MB in fp32
    storage = allocate_kv_storage(shape, dtype, "cpu")
    assert storage.shape == shape and storage.dtype == dtype and storage.is_contiguous()
    assert storage.data_ptr() % HUGE_PAGE == 0
    assert not storage.any()
    storage[1, 2, 39, 15, 7, 127] = 3.0  # the last element is writable and belongs to this tensor alone
    assert storage.sum().item() == 3.0


def test_small_storage_is_an_ordinary_tensor():
    storage = allocate_kv_storage((2, 1, 4, 16, 2, 8), torch.float32, torch.device("cpu"))
    assert storage.shape == (2, 1, 4, 16, 2, 8) and not storage.any()


@pytest.mark.skipif(not SMAPS.is_file(), reason="needs /proc/self/smaps (Linux)")
def test_the_storage_is_committed_and_in_huge_pages_where_the_kernel_offers_them():
    storage = allocate_kv_storage((64, 2**20), torch.float32, "cpu")  # 256 MB
    fields = _mapping_fields(storage.data_ptr())
    assert fields is not None
    assert fields["Rss"] >= storage.numel() * 4 // 1024  # reserved now, not at the first long conversation
    if _thp_mode() not in ("madvise", "always"):
        pytest.skip(f"transparent huge pages are {_thp_mode()!r} here: ordinary pages (checked above)")
    assert fields["AnonHugePages"] > 0, fields


@pytest.mark.skipif(not MAPS.is_file(), reason="needs /proc/self/maps (Linux)")
def test_the_memory_is_unmapped_when_the_cache_is_gone():
    cfg = KVCacheConfig(num_layers=2, num_kv_heads=8, head_dim=128, dtype=torch.float32, page_size=16,
                        kv_pool_blocks=64, max_context_tokens=256)  # fmt: skip
    cache = PagedKVCache(cfg)
    address = cache.kv_storage.data_ptr()
    assert _mapping_fields(address) is not None
    del cache
    gc.collect()
    assert _mapping_fields(address) is None


@pytest.mark.parametrize("paged", [True, False])
def test_both_caches_store_in_it(paged):
    cfg = KVCacheConfig(num_layers=2, num_kv_heads=8, head_dim=128, dtype=torch.float32, page_size=16,
                        kv_pool_blocks=64, max_context_tokens=512)  # fmt: skip
    cache = PagedKVCache(cfg) if paged else ContiguousKVCache(cfg)
    assert cache.kv_storage.data_ptr() % HUGE_PAGE == 0 and not cache.kv_storage.any()
