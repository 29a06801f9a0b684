"""Random-weight Qwen3-VL checkpoints for benchmarks (no model can be downloaded).

All three are built by the test suite's ``make_tiny_checkpoint`` (test/tiny_checkpoint.py: transformers
``save_pretrained`` with perturbed random weights and the tiny byte-level tokenizer), so both our engine
and transformers load exactly the same files:

- ``tiny_checkpoint``: the parity tests' default tiny shape.
- ``kv_shape_checkpoint``: a small model whose *attention* has the 2B's KV shape (16 q heads, 8 kv heads,
  head_dim 128) with a narrow hidden size and few layers. Paging overhead lives in attention, so this
  keeps attention's share of a step realistic at a fraction of the 2B's cost.
- ``big_checkpoint``: every text and vision dimension of the shared 2B config (vocab 151936, 28 layers,
  24-layer vision tower), stored bf16 (~4.3 GB).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch

TEST_DIR = Path(__file__).resolve().parent.parent / "test"


def _make_tiny_checkpoint():
    if str(TEST_DIR) not in sys.path:
        sys.path.insert(0, str(TEST_DIR))
    from tiny_checkpoint import make_tiny_checkpoint

    return make_tiny_checkpoint


def tiny_checkpoint(out: Path) -> Path:
    return Path(_make_tiny_checkpoint()(out))


def kv_shape_checkpoint(out: Path, num_layers: int) -> Path:
    return Path(
        _make_tiny_checkpoint()(
            out,
            num_heads=16,
            num_kv_heads=8,
            head_dim=128,
            hidden=256,
            intermediate=512,
            layers=num_layers,
            deepstack=(0,),
            vision_depth=1,
        )
    )


def big_checkpoint(out: Path, config: dict[str, Any], device: str = "cpu") -> Path:
    text, vision = config["text_config"], config["vision_config"]
    if vision["out_hidden_size"] != text["hidden_size"]:
        raise ValueError("2B config: vision out_hidden_size differs from the text hidden_size")
    return Path(
        _make_tiny_checkpoint()(
            out,
            num_heads=text["num_attention_heads"],
            num_kv_heads=text["num_key_value_heads"],
            head_dim=text["head_dim"],
            hidden=text["hidden_size"],
            intermediate=text["intermediate_size"],
            layers=text["num_hidden_layers"],
            deepstack=tuple(vision["deepstack_visual_indexes"]),
            tie=bool(config.get("tie_word_embeddings", True)),
            vocab_size=text["vocab_size"],
            rope_theta=float(text.get("rope_theta", 5_000_000.0)),
            mrope_section=text.get("rope_scaling", {}).get("mrope_section"),
            vision_depth=vision["depth"],
            vision_hidden=vision["hidden_size"],
            vision_heads=vision["num_heads"],
            vision_intermediate=vision["intermediate_size"],
            num_position_embeddings=vision["num_position_embeddings"],
            dtype=torch.bfloat16,
            device=device,
        )
    )
