"""The one tensor that holds every layer's K and V, allocated zeroed; on the CPU in transparent huge pages.

Why huge pages on the CPU: K and V are stored token-major, (slots, kv heads, head_dim), so attention for
one KV head reads one ``head_dim`` row per token at a stride of ``kv heads * head_dim`` elements, a 4 KB
stride on the 2B shape in fp32. With 4 KB pages every such row sits in a page of its own: a head's pass
over 4096 tokens walks 4096 pages, one TLB miss each, and how much that costs depends on where the
pages landed (two identical contiguous caches measured 13% to 27% apart at 4k context). In 2 MB pages the same
pass walks 8 pages. ``madvise(MADV_HUGEPAGE)`` asks for them where the kernel's transparent huge pages
are in ``madvise`` mode (the default of Ubuntu and JetPack) or ``always``; where they are off or the
call is unsupported, the storage is the same tensor in ordinary pages.

More in docs/modules.md, ``orin_vlm_node/kvcache/storage.py``.
"""

from __future__ import annotations

import logging
import math
import mmap

import torch

_log = logging.getLogger(__name__)

HUGE_PAGE = 2 << 20  # bytes; the x86-64 and arm64 (4 KB granule) transparent huge page


def allocate_kv_storage(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """A zero-filled contiguous tensor of ``shape``; on the CPU 2 MB-aligned and advised into huge pages."""
    device = torch.device(device)
    nbytes = math.prod(shape) * dtype.itemsize
    if device.type != "cpu" or not hasattr(mmap, "MADV_HUGEPAGE") or nbytes < HUGE_PAGE:
        return torch.zeros(shape, dtype=dtype, device=device)
    # Anonymous memory, one huge page longer than needed so that the tensor can start on a 2 MB boundary
    # (the kernel only maps aligned 2 MB ranges with huge pages). The tensor keeps the mapping alive; it
    # is unmapped when the last view of the tensor is gone.
    area = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        area.madvise(mmap.MADV_HUGEPAGE)
    except OSError as exc:  # transparent huge pages disabled in this kernel
        _log.info("KV storage in ordinary pages (madvise(MADV_HUGEPAGE): %s)", exc)
    raw = torch.frombuffer(area, dtype=torch.uint8)  # (nbytes + HUGE_PAGE,), shares the mapping
    start = -raw.data_ptr() % HUGE_PAGE
    storage = raw[start : start + nbytes].view(dtype).view(shape)
    storage.zero_()  # commit the pages now (anonymous memory reads as zero but is not yet allocated)
    return storage
