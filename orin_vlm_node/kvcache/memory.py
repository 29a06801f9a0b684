"""How much memory the KV pool may still take on a device, the way the robot sees it.

On a discrete GPU that is the driver's free device memory. On a Jetson the GPU has no memory of its own:
``torch.cuda.get_device_properties(0).is_integrated`` is true and CPU and GPU allocate from the same
DRAM, so ``cudaMemGetInfo`` is not what the rest of the robot (camera drivers, SLAM, planners) can spare;
the kernel's ``MemAvailable`` is. On the CPU it is ``MemAvailable`` too. Memory torch's caching allocator
holds but does not use counts as free: the pool's own allocation would reuse it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

MEMINFO = Path("/proc/meminfo")


@dataclass(frozen=True)
class MemoryReading:
    """Free and total bytes for the pool on one device, and where the figures come from."""

    free_bytes: int
    total_bytes: int
    source: str

    def describe(self) -> str:
        return f"{self.free_bytes / 2**20:.0f} of {self.total_bytes / 2**20:.0f} MB free ({self.source})"


def meminfo(path: Path = MEMINFO) -> tuple[int, int]:
    """(MemAvailable, MemTotal) in bytes from ``/proc/meminfo``; ValueError when it cannot be read."""
    values: dict[str, int] = {}
    try:
        with open(path, encoding="ascii") as f:
            for line in f:
                key, _, rest = line.partition(":")
                if key in ("MemAvailable", "MemTotal"):
                    values[key] = int(rest.split()[0]) * 1024  # the file is in kB
    except (OSError, ValueError, IndexError) as exc:
        raise ValueError(f"cannot read {path} to size the KV pool: {exc}") from exc
    if len(values) != 2:
        raise ValueError(f"{path} has no MemAvailable/MemTotal lines; size the KV pool by kv_pool_mb or kv_pool_blocks")
    return values["MemAvailable"], values["MemTotal"]


def device_memory(device: torch.device) -> MemoryReading:
    """Memory the KV pool may take on ``device`` (see the module docstring for where it comes from)."""
    if device.type == "cpu":
        free, total = meminfo()
        return MemoryReading(free, total, "MemAvailable")
    if device.type != "cuda":
        raise ValueError(f"KV pool sizing from free memory is not supported on device {device}; give its size")
    index = device.index if device.index is not None else torch.cuda.current_device()
    cached = torch.cuda.memory_reserved(index) - torch.cuda.memory_allocated(index)
    if torch.cuda.get_device_properties(index).is_integrated:
        free, total = meminfo()
        return MemoryReading(free + cached, total, "MemAvailable: the integrated GPU shares system memory")
    free, total = torch.cuda.mem_get_info(index)
    return MemoryReading(int(free) + cached, int(total), "cudaMemGetInfo")
