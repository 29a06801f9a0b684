"""Host-to-device copies that never make the host wait for the device.

Why: ``torch.tensor(values, device="cuda")`` (and any ``copy_`` from pageable memory) synchronizes the
stream: the host stops until every kernel queued before it has run. The decode loop queues the next
step before it reads the last token (the engine's overlap), so one such copy per token -- a block-table
entry, the ids a penalty looks at -- would put the GPU's idle gap back. A copy from pinned memory with
``non_blocking`` is queued in stream order instead; torch's pinned-memory allocator keeps the source
alive until the copy has run.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def host_to_device(values: Sequence[int], device: torch.device, dtype: torch.dtype = torch.long) -> torch.Tensor:
    """``values`` as a 1-D tensor on ``device``, queued in stream order without a wait on CUDA."""
    host = torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)
