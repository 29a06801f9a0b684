"""Qwen3-VL's math in PyTorch: vision tower, text decoder, 3-D RoPE positions (the weights are loaded into it by
:mod:`orin_vlm_node.weights`, which this package never imports).

Public API: ``Qwen3VLModel(config)``, ``model.encode_images(pixel_values, grid_thw) -> VisionFeatures``,
``model.forward(input_ids, rope_positions, attn, vision=None, logits_index=None) -> logits``,
``ModelConfig.from_dir(path)``, ``positions.mrope_positions`` / ``positions.decode_positions``.
A config.json or checkpoint at fault raises ``CheckpointError``; bad runtime inputs raise ``ValueError``.
"""

from .config import ModelConfig, TextConfig, VisionConfig
from .errors import CheckpointError
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
    "mrope_positions",
    "rope_delta",
]
