"""Giving the host memory of replaced parts back to the system: glibc's ``malloc_trim``.

Why: glibc raises its mmap threshold to the largest block a process frees, so after a model reload or a new
KV pool the next large blocks come from the heap, where what is freed later stays resident. A soak with
runtime ``dtype`` changes grew the default-model node from 318 MB to about 1 GB; without those changes it
stayed near 370 MB. Trimming after a rebuild hands the freed pages back. Elsewhere (not glibc) nothing is
done.
"""

from __future__ import annotations

import ctypes
import ctypes.util


def trim() -> bool:
    """Return the heap's free pages to the system; False where ``malloc_trim`` does not exist or freed none."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return False
    malloc_trim = getattr(libc, "malloc_trim", None)
    if malloc_trim is None:
        return False
    malloc_trim.argtypes, malloc_trim.restype = [ctypes.c_size_t], ctypes.c_int
    return bool(malloc_trim(0))
