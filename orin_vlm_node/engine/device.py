"""Where the model runs and in what precision: the ``device`` and ``dtype`` settings resolved.

``auto`` picks CUDA when torch sees a GPU; asking for CUDA where there is none is an error, never a
silent CPU run. ``dtype=auto`` is the checkpoint's own dtype on CUDA (bf16 when it names none) and fp32 on
the CPU, where half precision is slow and not what the parity tests hold the model to.
"""

from __future__ import annotations

import torch

from ..model.dtypes import resolve_dtype as dtype_by_name


def resolve_device(name: str) -> torch.device:
    """``auto`` -> cuda if available else cpu; ValueError for cuda without CUDA or an unknown device."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except (RuntimeError, ValueError):
        raise ValueError(f"device {name!r} is not valid (use auto, cpu or cuda)") from None
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"device {name!r} is not supported (use auto, cpu or cuda)")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} requested but CUDA is not available on this machine")
    return device


def resolve_dtype(name: str, device: torch.device, checkpoint_dtype: torch.dtype | None) -> torch.dtype:
    """``auto`` -> the checkpoint's dtype on CUDA (bf16 if it names none), fp32 on CPU; else the named one."""
    if name == "auto":
        return (checkpoint_dtype or torch.bfloat16) if device.type == "cuda" else torch.float32
    return dtype_by_name(name)
