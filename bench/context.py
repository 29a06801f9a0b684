"""What a benchmark section gets: settings, the run's scratch directory, checkpoints built once, logging.

Why: several sections need the same checkpoints (the default model, a tiny random one, the 2B-shape random
one). Building a 2B checkpoint costs a minute and 4 GB of disk, so it is built at most once per run, in the
run's temporary directory, and removed with it. Each section runs in a process of its own (``bench.run``)
with a context of its own on that one directory, so a checkpoint an earlier section built is found there.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from bench.config import REPO, BenchConfig

DEFAULT_MODEL_DIR = REPO / "orin_vlm_node" / "default_model"
# The embedded default model's text and vision dimensions (its config.json), for random look-alikes.
DEFAULT_MODEL_DIMS = dict(
    hidden=128,
    layers=4,
    num_heads=4,
    num_kv_heads=2,
    head_dim=32,
    intermediate=384,
    vocab_size=1024,  # the tiny tokenizer's (the default model has 768)
    vision_depth=4,
    vision_hidden=96,
    vision_heads=4,
    vision_intermediate=288,
    num_position_embeddings=256,
    deepstack=(0, 1, 2),
)


def checkpoint_complete(out: Path) -> bool:
    """Whether ``support.checkpoints`` finished writing a checkpoint into ``out`` (the tokenizer is written
    last), so a later section, or a later run through ``--checkpoint-cache``, can take it as it is."""
    return all((out / f).is_file() for f in ("config.json", "model.safetensors", "tokenizer.json"))


class BenchContext:
    def __init__(self, config: BenchConfig, scratch: Path) -> None:
        self.config = config
        self.scratch = scratch
        self._t0 = time.perf_counter()
        self._big: Path | None = None
        self.big_checkpoint_origin = ""

    # -- logging -----------------------------------------------------------------------------------
    def log(self, msg: str) -> None:
        print(f"[bench {time.perf_counter() - self._t0:7.1f}s] {msg}", file=sys.stderr, flush=True)

    # -- inputs ------------------------------------------------------------------------------------
    @staticmethod
    def image(height: int, width: int, seed: int = 0) -> np.ndarray:
        """A deterministic RGB uint8 test image (smooth gradients plus noise, so no two patches are equal)."""
        rng = np.random.default_rng(seed)
        yy, xx = np.mgrid[0:height, 0:width].astype(np.float32)
        base = np.stack([xx / max(width - 1, 1), yy / max(height - 1, 1), (xx + yy) / max(height + width - 2, 1)], -1)
        img = base * 200.0 + rng.integers(0, 56, size=(height, width, 3))
        return np.clip(img, 0, 255).astype(np.uint8)

    # -- checkpoints -------------------------------------------------------------------------------
    def default_model(self) -> tuple[Path, str]:
        """The embedded default model if it is there, else a tiny random checkpoint (and which one)."""
        if (DEFAULT_MODEL_DIR / "config.json").is_file() and any(DEFAULT_MODEL_DIR.glob("*.safetensors")):
            return DEFAULT_MODEL_DIR, "default_model (embedded, trained)"
        return self.tiny_checkpoint(), "tiny random checkpoint (default_model not present)"

    def tiny_checkpoint(self) -> Path:
        from support.checkpoints import make_tiny_checkpoint

        return self._scratch_checkpoint("tiny", make_tiny_checkpoint)

    def talkative_checkpoint(self) -> Path:
        """Random weights with the default model's dimensions whose greedy answers never end and stream a
        delta per token (``talkative``: only whole characters have LM head rows): long answers where no
        ``ignore_eos`` can be asked for (through the ROS node)."""
        from support.checkpoints import make_tiny_checkpoint

        return self._scratch_checkpoint(
            "talkative", lambda out: make_tiny_checkpoint(out, **DEFAULT_MODEL_DIMS, tie=False, talkative=True)
        )

    def kv_shape_checkpoint(self, num_layers: int) -> Path:
        """A small random model whose attention has the 2B's KV shape (16 q heads, 8 kv heads, head_dim 128)."""
        from support.checkpoints import kv_shape_checkpoint

        return self._scratch_checkpoint(f"kvshape{num_layers}", lambda out: kv_shape_checkpoint(out, num_layers))

    def _scratch_checkpoint(self, key: str, build: Callable[[Path], Path]) -> Path:
        """``scratch/key``, built by ``build`` unless an earlier section's process of this run built it: every
        section runs in a process of its own (``bench.run``), all of them on the run's scratch directory."""
        out = self.scratch / key
        if not checkpoint_complete(out):
            build(out)
        return out

    def big_checkpoint_missing(self) -> str | None:
        """Why a section's 2B-shape part does not run (quick mode, no 2B config), or None when it does."""
        if not self.config.big_checkpoint:
            return f"2B-shape checkpoint not run in {self.config.mode} mode (minutes of CPU per repeat)"
        if not Path(self.config.big_config_path).is_file():
            return f"2B config {self.config.big_config_path} not found"
        return None

    def big_checkpoint(self) -> Path:
        """The 2B-shape random-weight checkpoint in bf16: built once per run in the scratch directory, or
        kept in ``config.checkpoint_cache`` (``--checkpoint-cache``) and reused by later runs, since
        building it takes minutes on 2 cores. ``big_checkpoint_origin`` says which happened."""
        if self._big is None:
            from support.checkpoints import big_checkpoint

            path = Path(self.config.big_config_path)
            if self.config.checkpoint_cache:
                out = Path(self.config.checkpoint_cache) / "qwen3vl-2b-shape-random-bf16"
            else:
                out = self.scratch / "big"
            if checkpoint_complete(out):
                self.big_checkpoint_origin = f"reused from {out} (built earlier by support.checkpoints)"
                self.log(f"2B-shape checkpoint: {self.big_checkpoint_origin}")
            else:
                import torch

                device = "cuda" if torch.cuda.is_available() else "cpu"  # seconds on a GPU, minutes on 2 cores
                self.log(f"building 2B-shape random checkpoint from {path} into {out} (bf16, on {device}, once)")
                t0 = time.perf_counter()
                big_checkpoint(out, json.loads(path.read_text()), device=device)
                self.big_checkpoint_origin = f"built in {time.perf_counter() - t0:.0f} s into {out}"
                self.log(f"2B-shape checkpoint {self.big_checkpoint_origin}")
            self._big = out
        return self._big
