"""Which machine and which software produced a result file.

A figure means nothing without the CPU, core count, memory and library versions behind it, and the git
commit of the code measured (with a dirty flag, since a benchmark run on uncommitted code is common).
"""

from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text(encoding="utf-8").splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _ram_gib() -> float:
    try:
        for line in Path("/proc/meminfo").read_text(encoding="utf-8").splitlines():
            if line.startswith("MemTotal:"):
                return round(int(line.split()[1]) / 2**20, 1)
    except (OSError, ValueError):
        pass
    return 0.0


def _git(*args: str) -> str:
    try:
        out = subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, timeout=10, check=False)
        return out.stdout.strip() if out.returncode == 0 else ""
    except (OSError, subprocess.SubprocessError):
        return ""


def _version(module: str) -> str | None:
    try:
        mod = __import__(module)
        return str(getattr(mod, "__version__", "unknown"))
    except Exception:  # noqa: BLE001 - any import failure just means "not available"
        return None


def machine_info() -> dict[str, Any]:
    import torch

    cuda = None
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        cuda = {"name": props.name, "memory_gib": round(props.total_memory / 2**30, 1), "cuda": torch.version.cuda}
    return {
        "cpu_model": _cpu_model(),
        "cores": os.cpu_count() or 0,
        "torch_threads": torch.get_num_threads(),
        "ram_gib": _ram_gib(),
        "os": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": _version("transformers"),
        "numpy": _version("numpy"),
        "cuda_device": cuda,
        "git_commit": _git("rev-parse", "HEAD") or None,
        "git_dirty": bool(_git("status", "--porcelain", "--untracked-files=no")),
        "load_average_1m": round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None,
    }
