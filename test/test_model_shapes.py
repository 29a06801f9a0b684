"""The real Qwen3-VL 2B/4B/8B configs, built on the meta device: parameter counts, names and shapes.

No weights are allocated (meta tensors), so this checks the full-size architecture in milliseconds.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from orin_vlm_node.model import ModelConfig, Qwen3VLModel
from orin_vlm_node.weights.keys import checkpoint_key_to_name, checkpoint_views, name_to_checkpoint_key

CONFIG_DIR = Path("/work/shared/model-configs")
# Published model sizes: total parameters (tied counted once, in billions) and state-dict key counts incl. lm_head.
EXPECTED = {"2B": (2.128, 626), "4B": (4.438, 714), "8B": (8.767, 750)}


def _config(size: str) -> ModelConfig:
    return ModelConfig.from_json_file(CONFIG_DIR / f"Qwen3-VL-{size}-Instruct.config.json")


@pytest.mark.parametrize("size", list(EXPECTED))
def test_parameter_count_and_key_count(size: str):
    cfg = _config(size)
    with torch.device("meta"):
        model = Qwen3VLModel(cfg)
    billions, keys = EXPECTED[size]
    assert round(model.num_parameters() / 1e9, 3) == billions
    views = checkpoint_views(model)  # one entry per checkpoint matrix, fused projections split again
    assert len(views) + cfg.tie_word_embeddings == keys  # a tied lm_head is stored under one name only
    assert (model.lm_head.weight is model.language_model.embed_tokens.weight) is cfg.tie_word_embeddings
    q = views["language_model.layers.0.self_attn.q_proj.weight"]
    assert q.shape == (cfg.text.num_attention_heads * 128, cfg.text.hidden_size)


def test_names_and_shapes_match_transformers_state_dict():
    """Every HF parameter maps to one of ours with the same shape (2B; checks the loader's key mapping)."""
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    cfg = _config("2B")
    with torch.device("meta"):
        ours = Qwen3VLModel(cfg)
        hf = Qwen3VLForConditionalGeneration(Qwen3VLConfig(**cfg.raw))
    hf_shapes = {k: tuple(v.shape) for k, v in hf.state_dict().items()}
    our_shapes = {name_to_checkpoint_key(n): tuple(v.shape) for n, v in checkpoint_views(ours).items()}
    if cfg.tie_word_embeddings:
        our_shapes["lm_head.weight"] = tuple(ours.lm_head.weight.shape)
    assert our_shapes == hf_shapes
    assert all(name_to_checkpoint_key(checkpoint_key_to_name(k)) == k for k in hf_shapes)
