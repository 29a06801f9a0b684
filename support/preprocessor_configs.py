"""``preprocessor_config.json`` files the image-processing tests load: Qwen3-VL's as published on the hub, and
a small one whose limits keep pixel comparisons fast."""

from __future__ import annotations

import json
from pathlib import Path

# Qwen3-VL hub preprocessor_config.json.
QWEN3VL_CONFIG = {
    "size": {"shortest_edge": 65536, "longest_edge": 16777216},
    "patch_size": 16,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
    "image_processor_type": "Qwen2VLImageProcessorFast",
}
# Small limits (4..96 tokens) so pixel comparisons that exercise both up- and downscaling stay fast;
# CLIP mean/std so per-channel normalisation is checked too.
SMALL_CONFIG = {
    "size": {"shortest_edge": 32 * 32 * 4, "longest_edge": 32 * 32 * 96},
    "patch_size": 16,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "image_mean": [0.48145466, 0.4578275, 0.40821073],
    "image_std": [0.26862954, 0.26130258, 0.27577711],
    "image_processor_type": "Qwen2VLImageProcessorFast",
}


def config_dir(directory: Path, config: dict) -> Path:
    """``directory`` (created) with ``config`` as its preprocessor_config.json."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "preprocessor_config.json").write_text(json.dumps(config))
    return directory
