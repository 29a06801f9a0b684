"""Random-weight Qwen3-VL checkpoints written by transformers itself, for tests and benchmarks.

Why: no real model can be downloaded, so the reference is ``transformers``' ``Qwen3VLForConditionalGeneration``
built from a ``Qwen3VLConfig`` and saved with ``save_pretrained`` -- the exact file layout our loader must
read, loaded by both our engine and transformers. Weights are perturbed away from HF's init (norm weights
!= 1, biases != 0, weights ~ 1/sqrt(fan_in)) so every term of the math matters and logits are decisive
enough for greedy parity.

Token ids follow the tiny tokenizer (:mod:`support.tokenizer`): ``<|endoftext|>``=0, ``<|im_start|>``=1,
``<|im_end|>``=2, ``<|vision_start|>``=3, ``<|vision_end|>``=4, ``<|vision_pad|>``=5, ``<|image_pad|>``=6,
``<|video_pad|>``=7.

* ``make_tiny_checkpoint(tmp_path / "ckpt", layers=2, tie=False)``, or ``cached_tiny_checkpoint(**kwargs)``
  (one build per distinct kwargs per process): the parity tests' tiny shapes (vocab 1024).
* :func:`kv_shape_checkpoint`: a small model whose *attention* has the 2B's KV shape (16 q heads, 8 kv
  heads, head_dim 128) with a narrow hidden size and few layers: paging overhead lives in attention, so
  this keeps attention's share of a step realistic at a fraction of the 2B's cost. It is talkative (see
  :func:`make_tiny_checkpoint`): the paged benchmark steps engines one streamed token at a time.
* :func:`big_checkpoint`: every text and vision dimension of a real config (e.g. Qwen3-VL-2B: vocab 151936,
  28 layers, 24-layer vision tower), stored bf16 (~4.3 GB).

Quantized copies of these checkpoints (FP8, compressed-tensors integers, AWQ, GPTQ): :mod:`support.quantized_copies`.
"""

from __future__ import annotations

import atexit
import functools
import json
import math
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path

import torch

from support.tokenizer import build_tiny_tokenizer, write_tiny_tokenizer

ENDOFTEXT, IM_START, IM_END, VISION_START, VISION_END, VISION_PAD, IMAGE_PAD, VIDEO_PAD = range(8)
PATCH_DIM = 3 * 2 * 16 * 16


def default_mrope_section(head_dim: int) -> list[int]:
    """Qwen3-VL's [24, 20, 20] scaled to ``head_dim/2`` frequencies (e.g. [6, 5, 5] for head_dim 32)."""
    hw = round(head_dim / 2 * 20 / 64)
    return [head_dim // 2 - 2 * hw, hw, hw]


def make_tiny_checkpoint(
    path: str | Path,
    *,
    seed: int = 0,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 32,
    hidden: int = 64,
    intermediate: int = 128,
    layers: int = 3,
    deepstack: Sequence[int] = (0, 1),
    tie: bool = True,
    vocab_size: int = 1024,
    rope_theta: float = 5_000_000.0,
    mrope_section: Sequence[int] | None = None,
    vision_depth: int = 3,
    vision_hidden: int = 64,
    vision_heads: int = 4,
    vision_intermediate: int = 128,
    num_position_embeddings: int = 64,
    dtype: torch.dtype = torch.float32,
    legacy_rope_keys: bool = False,
    with_tokenizer: bool = True,
    device: str = "cpu",
    talkative: bool = False,
) -> Path:
    """Build, perturb and ``save_pretrained`` a tiny Qwen3-VL; return the directory.

    ``legacy_rope_keys`` rewrites config.json's text RoPE settings in the 4.57 spelling
    (``rope_theta`` + ``rope_scaling``) instead of 5.x ``rope_parameters``. ``device``: where the weights
    are made ("cuda" builds a 2B-shape checkpoint in seconds instead of minutes; the values then differ
    from a CPU build with the same seed). ``talkative`` (untied, with the tiny tokenizer): the LM head rows
    of every id that does not decode on its own to whole characters are zero (:func:`mute_ids`), so their
    logit is 0 while the largest of the others is positive: greedy answers never end on their own (long
    answers through interfaces without ``ignore_eos``, e.g. the ROS node in benchmarks) and every token
    completes text, so the engine streams one delta per token (benchmarks that take turns token by token).
    """
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    out = Path(path)
    section = list(mrope_section) if mrope_section is not None else default_mrope_section(head_dim)
    config = Qwen3VLConfig(
        text_config={
            "vocab_size": vocab_size,
            "hidden_size": hidden,
            "intermediate_size": intermediate,
            "num_hidden_layers": layers,
            "num_attention_heads": num_heads,
            "num_key_value_heads": num_kv_heads,
            "head_dim": head_dim,
            "rms_norm_eps": 1e-6,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": rope_theta,
                "mrope_section": section,
                "mrope_interleaved": True,
            },
            "tie_word_embeddings": tie,
            "bos_token_id": ENDOFTEXT,
            "eos_token_id": IM_END,
            "pad_token_id": ENDOFTEXT,
        },
        vision_config={
            "depth": vision_depth,
            "hidden_size": vision_hidden,
            "intermediate_size": vision_intermediate,
            "num_heads": vision_heads,
            "out_hidden_size": hidden,
            "num_position_embeddings": num_position_embeddings,
            "deepstack_visual_indexes": list(deepstack),
            "patch_size": 16,
            "temporal_patch_size": 2,
            "spatial_merge_size": 2,
        },
        image_token_id=IMAGE_PAD,
        video_token_id=VIDEO_PAD,
        vision_start_token_id=VISION_START,
        vision_end_token_id=VISION_END,
        tie_word_embeddings=tie,
    )
    torch.manual_seed(seed)
    with torch.device(device):
        model = Qwen3VLForConditionalGeneration(config).eval()
    _perturb(model, seed)
    if talkative:
        if tie or not with_tokenizer:
            raise ValueError("talkative needs an untied LM head (zeroing a tied row changes the embedding) "
                             "and the tiny tokenizer (whose tokens it mutes)")  # fmt: skip
        with torch.no_grad():
            model.lm_head.weight[mute_ids(vocab_size)] = 0.0
    model.to(dtype)
    model.save_pretrained(out)
    if legacy_rope_keys:
        _rewrite_rope_legacy(out / "config.json")
    write_json(
        out / "preprocessor_config.json",
        {
            "image_processor_type": "Qwen2VLImageProcessorFast",
            "processor_class": "Qwen3VLProcessor",
            "patch_size": 16,
            "temporal_patch_size": 2,
            "merge_size": 2,
            "image_mean": [0.5, 0.5, 0.5],
            "image_std": [0.5, 0.5, 0.5],
            "do_convert_rgb": True,
            "do_rescale": True,
            "rescale_factor": 1 / 255,
            "do_normalize": True,
            "do_resize": True,
            "resample": 3,
            "size": {"shortest_edge": 32 * 32 * 4, "longest_edge": 32 * 32 * 64},
        },
    )
    write_json(
        out / "generation_config.json",
        {
            "bos_token_id": ENDOFTEXT,
            "pad_token_id": ENDOFTEXT,
            "eos_token_id": [IM_END, ENDOFTEXT],
            "do_sample": True,
            "temperature": 0.7,
            "top_p": 0.8,
            "top_k": 20,
        },
    )
    if with_tokenizer:
        write_tiny_tokenizer(out)
    return out


def mute_ids(vocab_size: int) -> list[int]:
    """Ids below ``vocab_size`` a talkative model never says: the special tokens (EOS among them), ids the
    tiny tokenizer does not have (they decode to nothing) and tokens holding part of a UTF-8 character
    (they decode to U+FFFD alone; a random model's greedy text can repeat one of them for a whole answer,
    which the engine holds back as an incomplete character until the answer ends)."""
    tokenizer = build_tiny_tokenizer()

    def whole(text: str) -> bool:
        return bool(text) and "\ufffd" not in text

    return [i for i in range(vocab_size) if not whole(tokenizer.decode([i], skip_special_tokens=True))]


def kv_shape_checkpoint(out: Path, num_layers: int) -> Path:
    """The 2B's attention shape on a narrow, shallow model (see the module docstring)."""
    return make_tiny_checkpoint(
        out, num_heads=16, num_kv_heads=8, head_dim=128, hidden=256, intermediate=512, layers=num_layers,
        deepstack=(0,), vision_depth=1, tie=False, talkative=True,
    )  # fmt: skip


def big_checkpoint(out: Path, config: dict, device: str = "cpu") -> Path:
    """Every dimension of an HF Qwen3-VL ``config`` (the parsed config.json), random weights, bf16 on disk."""
    text, vision = config["text_config"], config["vision_config"]
    if vision["out_hidden_size"] != text["hidden_size"]:
        raise ValueError("config: vision out_hidden_size differs from the text hidden_size")
    return make_tiny_checkpoint(
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


@functools.cache
def _cached(items: tuple) -> Path:
    kwargs = dict(items)
    name = "ckpt_" + "_".join(f"{k}-{v}" for k, v in items).replace(" ", "").replace("torch.", "")
    name = "".join(c if c.isalnum() or c in "-_." else "_" for c in name)[:180]
    return make_tiny_checkpoint(_session_dir() / name, **kwargs)


def cached_tiny_checkpoint(**kwargs) -> Path:
    """Like :func:`make_tiny_checkpoint` under a per-process temp dir, built once per distinct kwargs.

    Callers must not modify the returned directory (copy it first).
    """
    items = tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in kwargs.items()))
    return _cached(items)


@functools.lru_cache(maxsize=1)
def _session_dir() -> Path:
    root = Path(tempfile.mkdtemp(prefix="tiny_qwen3vl_"))
    atexit.register(shutil.rmtree, root, ignore_errors=True)
    return root


def random_pixel_values(grid_thw: Sequence[Sequence[int]], seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Random (N, 1536) fp32 patches in [-1, 1] and the (n, 3) long grid for images of these patch grids."""
    grid = torch.tensor([list(g) for g in grid_thw], dtype=torch.long)
    n = int(grid.prod(-1).sum())
    gen = torch.Generator().manual_seed(seed)
    return torch.rand((n, PATCH_DIM), generator=gen) * 2 - 1, grid


def image_prompt(text_ids: Sequence[Sequence[int]], grid_thw: Sequence[Sequence[int]], merge: int = 2) -> list[int]:
    """ChatML-like prompt: text chunk, image, text chunk, image, ..., text chunk, generation prompt.

    ``text_ids`` has one more entry than ``grid_thw``; each image becomes
    ``<|vision_start|> + t*h*w/merge^2 x <|image_pad|> + <|vision_end|>``.
    """
    if len(text_ids) != len(grid_thw) + 1:
        raise ValueError("need one more text chunk than images")
    ids = [IM_START, 20, 21]
    for chunk, (t, h, w) in zip(text_ids[:-1], grid_thw, strict=True):
        ids += list(chunk) + [VISION_START] + [IMAGE_PAD] * (t * h * w // (merge * merge)) + [VISION_END]
    ids += list(text_ids[-1]) + [IM_END, 22, IM_START, 23, 24]
    return ids


def mm_token_type_ids(ids: Sequence[int]) -> torch.Tensor:
    """(1, L) int: 1 at image pads, 0 elsewhere (what transformers 5.x needs next to image_grid_thw)."""
    return torch.tensor([[1 if i == IMAGE_PAD else 0 for i in ids]], dtype=torch.int32)


def _perturb(model: torch.nn.Module, seed: int) -> None:
    device = next(model.parameters()).device
    gen = torch.Generator(device=device).manual_seed(seed + 1000)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float32, device=device)
            if p.dim() == 1 and "norm" in name and name.endswith("weight"):
                p.copy_(1.0 + 0.2 * noise)
            elif p.dim() == 1:
                p.copy_(0.1 * noise)
            else:
                p.copy_(noise / math.sqrt(p[0].numel()))


def _rewrite_rope_legacy(config_file: Path) -> None:
    data = json.loads(config_file.read_text())
    text = data["text_config"]
    rope = text.pop("rope_parameters")
    text["rope_theta"] = rope.pop("rope_theta")
    text["rope_scaling"] = rope
    write_json(config_file, data)


def write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
