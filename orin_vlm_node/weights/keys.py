"""How checkpoint keys name our parameters: the Hugging Face Qwen3-VL layouts (and older spellings) mapped to
parameter names and back, and the tensor each checkpoint matrix is copied into (a fused projection's rows)."""

from __future__ import annotations

import torch
from torch import nn

from ..model.text import FusedLinear


def checkpoint_key_to_name(key: str) -> str:
    """Checkpoint key -> our parameter name; accepts the Qwen3-VL layout and older spellings.

    ``model.visual.*`` / ``visual.*`` -> ``visual.*``; ``model.language_model.*`` / ``model.*`` (pre-4.52
    layout) / ``language_model.model.*`` -> ``language_model.*``; ``lm_head.*`` and
    ``language_model.lm_head.*`` -> ``lm_head.*``.
    """
    for prefix, repl in (
        ("model.visual.", "visual."),
        ("model.language_model.", "language_model."),
        ("language_model.model.", "language_model."),
        ("language_model.lm_head.", "lm_head."),
        ("visual.", "visual."),
        ("lm_head.", "lm_head."),
        ("model.", "language_model."),
    ):
        if key.startswith(prefix):
            return repl + key[len(prefix) :]
    return key


def name_to_checkpoint_key(name: str) -> str:
    """Our parameter name -> the key an HF Qwen3-VL checkpoint stores it under."""
    return name if name.startswith("lm_head.") else "model." + name


def checkpoint_views(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every tensor a checkpoint provides, by parameter name (as :func:`checkpoint_key_to_name` gives it),
    as the tensor it is copied into: the parameter itself, or for a :class:`FusedLinear` the rows of its
    weight that one checkpoint matrix fills (``...self_attn.q_proj.weight`` -> rows of ``qkv_proj.weight``).
    Tied parameters appear once (under their first name)."""
    fused = {f"{name}.weight": (name, m) for name, m in model.named_modules() if isinstance(m, FusedLinear)}
    views: dict[str, torch.Tensor] = {}
    for name, param in model.named_parameters():
        if name not in fused:
            views[name] = param
            continue
        module_name, module = fused[name]
        parent = module_name.rpartition(".")[0]
        for part, rows in module.part_rows().items():
            views[f"{parent}.{part}.weight"] = param[rows]
    return views
