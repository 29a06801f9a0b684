"""Qwen3-VL in PyTorch: checkpoint loading, vision tower, decoder, 3-D RoPE positions.

Public API: ``load_model(path, dtype, device) -> Qwen3VLModel``,
``model.encode_images(pixel_values, grid_thw) -> VisionFeatures``,
``model.forward(input_ids, rope_positions, attn, vision=None, logits_index=None) -> logits``,
``ModelConfig.from_dir(path)``, ``positions.mrope_positions`` / ``positions.decode_positions``.
Loader problems raise ``CheckpointError``; bad runtime inputs raise ``ValueError``.
"""

from .config import ModelConfig, TextConfig, VisionConfig
from .errors import CheckpointError
from .loader import load_model
from .positions import decode_positions, mrope_positions, rope_delta
from .qwen3_vl import Qwen3VLModel
from .vision import VisionFeatures

__all__ = [
    "CheckpointError",
    "ModelConfig",
    "Qwen3VLModel",
    "TextConfig",
    "VisionConfig",
    "VisionFeatures",
    "decode_positions",
    "load_model",
    "mrope_positions",
    "rope_delta",
]
