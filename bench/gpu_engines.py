"""The GPU section's engines: the decode paths it compares, how one is built, how its decode graphs launch, and
how many weight bytes a decode step reads (the bound its tokens/s are compared with)."""

from __future__ import annotations

from pathlib import Path

PROMPT = "Describe what a robot arm does when it picks up the red cube and places it on the table."
PATHS = {  # engine settings of each decode path
    "graphs": dict(use_cuda_kernels=True, use_cuda_graph=True),
    "kernels_eager": dict(use_cuda_kernels=True, use_cuda_graph=False),
    "torch": dict(use_cuda_kernels=False, use_cuda_graph=True),
}


def decode_weight_bytes(model) -> int:
    """Bytes one decode step reads from weights: every text-decoder parameter except the embedding table
    (one row is read), plus the LM head (the embedding matrix itself when tied), and the quantized
    projections and LM head as stored (``weight_quant``)."""
    from orin_vlm_node.weights.quant import QuantizedLinear

    quantized = {name: m for name, m in model.named_modules() if isinstance(m, QuantizedLinear)}
    total = sum(m.nbytes for name, m in quantized.items() if not name.startswith("visual."))
    embed, head = None, quantized.get("lm_head")
    for name, p in model.named_parameters():
        if name.startswith("visual."):
            continue
        if "embed_tokens" in name:
            embed = p
            continue
        if name.startswith("lm_head"):
            head = p
        total += p.numel() * p.element_size()
    if head is None and embed is not None:
        total += embed.numel() * embed.element_size()
    return total


def make_engine(model_dir: Path, dtype: str, cache_dir: str, **overrides):
    from orin_vlm_node.engine import Engine, EngineConfig

    config = dict(
        model_path=str(model_dir), device="cuda", dtype=dtype, prefix_caching=False, max_sessions=0, max_batch=1,
        kernel_cache_dir=cache_dir, max_context_tokens=4096,
    )  # fmt: skip
    return Engine(EngineConfig(**(config | overrides)))


def launching(engine, setting: str) -> None:
    """A benchmark's choice of how ``engine``'s decode graphs launch their kernels: its decode step built again
    with ``setting`` "on" (every launch programmatic dependent) or "off" (every launch plain), before its first
    request. The engine itself captures each graph both ways and keeps the faster replay."""
    import torch

    from orin_vlm_node.cuda import LaunchModes
    from orin_vlm_node.engine.assemble import MAX_BATCH
    from orin_vlm_node.engine.decode_step import build_decode_step

    parts = engine.parts
    modes = LaunchModes(parts.attention.launcher, setting)
    stream = torch.cuda.Stream(parts.device)
    parts.decode_step = build_decode_step(parts.model, parts.cache, parts.device, True, MAX_BATCH, stream, modes)
