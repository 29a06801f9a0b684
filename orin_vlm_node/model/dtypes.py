"""The floating-point types a model can run in, by every name they are written in.

One table for the whole package: ``dtype`` settings (``bf16``), config.json's ``torch_dtype``
(``bfloat16``) and torch's own spelling (``float16``) all resolve here.
"""

from __future__ import annotations

import torch

DTYPES: dict[str, torch.dtype] = {
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
    "half": torch.float16,
    "fp32": torch.float32,
    "float32": torch.float32,
    "float": torch.float32,
}


def resolve_dtype(dtype: torch.dtype | str) -> torch.dtype:
    """torch dtype from a torch.dtype or any name above; ValueError for anything else."""
    resolved = DTYPES.get(dtype.lower()) if isinstance(dtype, str) else dtype
    if resolved not in DTYPES.values():
        raise ValueError(f"unsupported model dtype {dtype!r}: use bf16, fp16 or fp32")
    return resolved


def checkpoint_dtype(name: str | None) -> torch.dtype | None:
    """The dtype a config.json names (``torch_dtype``/``dtype``), None when it names none we run in."""
    return DTYPES.get(name.lower()) if isinstance(name, str) else None
