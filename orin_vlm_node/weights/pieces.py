"""How many rows of a weight the loader works on at a time, when it quantizes, widens or repacks one.

Loading converts weights through fp32 working copies (a float weight quantized to INT8/INT4, integer or FP8
weights widened to the model's dtype, 4-bit words repacked), and never a whole matrix at once: the 2B's LM
head is 1.2 GB in fp32, a burst of memory the robot's other processes share. The piece size depends on where
the work runs. On the CPU it is 1M weights (4 MB fp32 copies): glibc hands out blocks over 32 MB as fresh
mappings whose pages fault in on every use, and 16M-weight pieces made the 2B's INT4 quantization at load
4-5x slower (most of it kernel time) than pieces that fit the cache and come from the reused heap. On CUDA it
is 16M (64 MB from torch's caching allocator): fewer launches, still a small burst on a Jetson.
"""

from __future__ import annotations

import torch

WORK_ELEMENTS = {"cpu": 1 << 20, "cuda": 1 << 24}  # weights a piece, by device type (others: as CUDA)


def rows_per_piece(device: torch.device, row_elements: int, multiple: int = 1) -> int:
    """Rows of ``row_elements`` weights each in one piece on ``device``: a positive multiple of ``multiple``
    (whole packed words, whole scale blocks), about ``WORK_ELEMENTS`` weights."""
    budget = WORK_ELEMENTS.get(device.type, WORK_ELEMENTS["cuda"])
    return max(1, budget // (row_elements * multiple)) * multiple
