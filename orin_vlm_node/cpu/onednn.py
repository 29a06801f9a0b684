"""oneDNN's shape caches, bounded.

torch runs a bf16 matmul on the CPU through oneDNN, which keeps what it compiled for every distinct shape
(rows, columns, depth) in two caches, oneDNN's primitive cache and ideep's, 1024 entries each by default, at
about 0.7 MB a shape. A prefill's row count is its prompt's length, so a robot asking prompts of many lengths
grows the node by up to a gigabyte before the caches fill: the default model in bf16 went from 0.33 GB to
1.07 GB in 15 s of mixed traffic and 1.39 GB after 300 s, against a flat 0.36 GB in fp32 (whose matmuls go to
MKL, without such caches). 128 entries hold every shape that repeats (a decode step's projections, a
camera's frame size) and bound the caches near 100 MB; the default model answered as fast with 128 as with
1024 (30 image prompts of 32 tokens, three runs each).

More in docs/modules.md, ``orin_vlm_node/cpu/onednn.py``.
"""

from __future__ import annotations

import os

CACHE_ENTRIES = 128
CAPACITY_VARIABLES = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")  # oneDNN's, ideep's


def bound_onednn_caches(entries: int = CACHE_ENTRIES) -> dict[str, str]:
    """Set each cache's capacity to ``entries`` where the environment does not already; the values in effect."""
    for name in CAPACITY_VARIABLES:
        os.environ.setdefault(name, str(entries))
    return {name: os.environ[name] for name in CAPACITY_VARIABLES}
