"""Which attention implementation and decode step the engine runs, and the line that says so.

Chosen at startup (and again on reconfiguration) and reported, so an operator sees from the log, the
node's diagnostics or the CLI's ``--json`` whether the fast path is really in use: ``kernels: on (...)``
or ``kernels: off (<reason>)``, and the decode path, e.g. "kernels+graphs" on a Jetson, "torch reference
(dynamic step)" on a CPU.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..cuda import AttentionShape, BackendChoice, select_backend
from ..model.config import ModelConfig
from .config import EngineConfig
from .decode_step import DecodeStep


def select_attention(
    config: EngineConfig, model_config: ModelConfig, dtype: torch.dtype, device: torch.device, loaded: Sequence = ()
):
    """The kernel choice for this model on this device (the kernels serve the paged cache only); ``loaded``: the
    kernel runtimes the engine holds (``select_backend`` reuses one that has the same cubins)."""
    text = model_config.text
    shape = AttentionShape(dtype, text.head_dim, text.num_attention_heads, text.num_key_value_heads)
    if not config.use_paged_attention and device.type == "cuda" and config.use_cuda_kernels:
        return BackendChoice(False, "the contiguous KV cache (use_paged_attention=false) uses torch attention")
    return select_backend(
        device,
        config.use_cuda_kernels,
        shape,
        kernel_dir=config.kernel_dir,
        kernel_cache_dir=config.kernel_cache_dir,
        allow_kernel_fallback=config.allow_kernel_fallback,
        loaded=loaded,
    )


def decode_path(choice: BackendChoice, step: DecodeStep) -> str:
    """One short phrase: "kernels+graphs", "kernels", "torch+graphs" or "torch reference", plus the step."""
    info = step.describe()
    graphs = info.get("graphs") == "on"
    if choice.kernels:
        path = "kernels+graphs" if graphs else "kernels"
    else:
        path = "torch+graphs" if graphs else "torch reference"
    return f"{path} ({info['step']} step)"
