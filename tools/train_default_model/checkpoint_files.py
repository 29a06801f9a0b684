"""The Hugging Face files of the checkpoint besides the tokenizer: model config, preprocessor and generation
configs, and the bf16 weights."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from .recipe import TrainConfig

TOKEN_PIXELS = 32 * 32  # one image token: a 2x2 group of 16-pixel patches
MIN_PIXELS = TOKEN_PIXELS * 4  # a clip's frames together: at least 4 tokens
VIDEO_MAX_PIXELS = 32 * 32 * 64  # all frames of a clip together: 32 tokens (4 frames: 16 each, in 2 groups)
SIDE_FILES = ("preprocessor_config.json", "video_preprocessor_config.json", "generation_config.json")


def build_config(cfg: TrainConfig, ids: dict[str, int], vocab: int):
    from transformers import Qwen3VLConfig

    head_dim = cfg.text_hidden // cfg.text_heads  # 32 -> 16 rotary frequencies, interleaved T/H/W = 6/5/5
    return Qwen3VLConfig(
        text_config={
            "vocab_size": vocab,
            "hidden_size": cfg.text_hidden,
            "intermediate_size": cfg.text_intermediate,
            "num_hidden_layers": cfg.text_layers,
            "num_attention_heads": cfg.text_heads,
            "num_key_value_heads": cfg.text_kv_heads,
            "head_dim": head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": 1e-6,
            "max_position_embeddings": 4096,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 10000.0,
                "mrope_section": [6, 5, 5],
                "mrope_interleaved": True,
            },
            "bos_token_id": ids["<|endoftext|>"],
            "eos_token_id": ids["<|im_end|>"],
            "pad_token_id": ids["<|endoftext|>"],
            "tie_word_embeddings": True,
        },
        vision_config={
            "depth": cfg.vision_depth,
            "hidden_size": cfg.vision_hidden,
            "num_heads": cfg.vision_heads,
            "intermediate_size": cfg.vision_intermediate,
            "hidden_act": "gelu_pytorch_tanh",
            "in_channels": 3,
            "patch_size": 16,
            "temporal_patch_size": 2,
            "spatial_merge_size": 2,
            "out_hidden_size": cfg.text_hidden,
            "num_position_embeddings": 256,  # 16 x 16 table, bilinearly resampled to each grid
            "deepstack_visual_indexes": [0, 1, 2],
        },
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=True,
    )


# The pixel settings both processors share (Qwen3-VL's: patch 16, temporal patch 2, merge 2, mean/std 0.5).
PIXELS = {
    "do_convert_rgb": True,
    "do_resize": True,
    "do_rescale": True,
    "rescale_factor": 1 / 255,
    "do_normalize": True,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
    "resample": 3,
    "patch_size": 16,
    "temporal_patch_size": 2,
    "merge_size": 2,
}


def write_video_config(out: Path) -> None:
    """``video_preprocessor_config.json``: the image settings, with a pixel budget shared by all of a clip's
    frames (Qwen3-VL's video rule), fps 2 as its processor samples."""
    video = {"video_processor_type": "Qwen3VLVideoProcessor", **PIXELS, "fps": 2.0,
             "size": {"shortest_edge": MIN_PIXELS, "longest_edge": VIDEO_MAX_PIXELS}}  # fmt: skip
    (out / "video_preprocessor_config.json").write_text(json.dumps(video, indent=2) + "\n")


def write_side_configs(out: Path, ids: dict[str, int], cfg: TrainConfig) -> None:
    """Preprocessor (a picture read as ``image_tokens_min``..``image_tokens_max`` tokens), video and generation
    configs."""
    size = {"shortest_edge": TOKEN_PIXELS * cfg.image_tokens_min, "longest_edge": TOKEN_PIXELS * cfg.image_tokens_max}
    preprocessor = {"image_processor_type": "Qwen2VLImageProcessor", **PIXELS, "size": size}
    (out / "preprocessor_config.json").write_text(json.dumps(preprocessor, indent=2) + "\n")
    write_video_config(out)
    generation = {
        "bos_token_id": ids["<|endoftext|>"],
        "pad_token_id": ids["<|endoftext|>"],
        "eos_token_id": [ids["<|im_end|>"], ids["<|endoftext|>"]],
        "do_sample": False,
        "max_new_tokens": 64,
    }
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")


def save(model, out: Path, ids: dict[str, int], cfg: TrainConfig) -> None:
    """bf16 copy of the weights in HF format (the training copy stays float32)."""
    import copy

    half = copy.deepcopy(model).to(torch.bfloat16)
    half.generation_config.do_sample = False
    half.save_pretrained(str(out))
    write_side_configs(out, ids, cfg)  # save_pretrained rewrites generation_config.json; keep ours
