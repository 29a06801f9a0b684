"""Train the embedded default model: a tiny Qwen3-VL that answers questions about synthetic shape scenes.

Why this exists: the package must ship a model that runs out of the box, on any machine, without downloads,
and that demonstrably uses the picture. Real Qwen3-VL weights cannot be bundled (size, licence, no network),
so this script builds a few-million-parameter model with the *exact* Qwen3-VL architecture
(``transformers.Qwen3VLForConditionalGeneration``: vision tower with DeepStack, interleaved M-RoPE, tied
embeddings) and trains it on the CPU on ``tools/synthetic_scenes.py``. It is a DEMO model, not Qwen3-VL.

Pixels are produced by the runtime's own ``orin_vlm_node.processing.ImageProcessor`` so training and
inference see identical inputs. The result is written in Hugging Face format (config.json, model.safetensors,
tokenizer.json, tokenizer_config.json, chat_template.jinja, preprocessor_config.json, generation_config.json).

Reproduce the committed checkpoint (same seed -> same weights on the same torch build):
    .venv/bin/python tools/train_default_model.py --out orin_vlm_node/default_model
Evaluate a checkpoint with transformers' generate:
    .venv/bin/python tools/train_default_model.py --eval-only --out orin_vlm_node/default_model
"""

from __future__ import annotations

import argparse
import json
import math
import time
from collections import defaultdict
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import numpy as np
import torch

from tools import synthetic_scenes as scenes

TOOLS_DIR = Path(__file__).resolve().parent
REPO_ROOT = TOOLS_DIR.parent

SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
)
# Our own ChatML template in the Qwen3-VL instruct format: no default system prompt, images and videos as
# <|vision_start|><|image_pad|><|vision_end|> (the processor expands the pad), optional "Picture N: " ids.
CHAT_TEMPLATE = (
    "{%- set counter = namespace(image=0, video=0) -%}"
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
    "{%- if message['content'] is string -%}"
    "{{- message['content'] -}}"
    "{%- else -%}"
    "{%- for part in message['content'] -%}"
    "{%- if part['type'] is defined and part['type'] in ('image', 'image_url') -%}"
    "{%- set counter.image = counter.image + 1 -%}"
    "{%- if add_vision_id is defined and add_vision_id -%}{{- 'Picture ' ~ counter.image ~ ': ' -}}{%- endif -%}"
    "{{- '<|vision_start|><|image_pad|><|vision_end|>' -}}"
    "{%- elif part['type'] is defined and part['type'] == 'video' -%}"
    "{%- set counter.video = counter.video + 1 -%}"
    "{%- if add_vision_id is defined and add_vision_id -%}{{- 'Video ' ~ counter.video ~ ': ' -}}{%- endif -%}"
    "{{- '<|vision_start|><|video_pad|><|vision_end|>' -}}"
    "{%- elif part['text'] is defined -%}"
    "{{- part['text'] -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)
MIN_PIXELS = 32 * 32 * 4  # 4 image tokens
MAX_PIXELS = 32 * 32 * 16  # 16 image tokens


@dataclass
class TrainConfig:
    """Everything that determines the trained weights (recorded in the model card)."""

    seed: int = 0
    vision_steps: int = 1400  # stage 1: dense vision pre-training (per-token shape kind, colour, position)
    vision_lr: float = 2e-3
    aux_weight: float = 0.5  # stage 2: weight of the dense vision loss next to the language-model loss
    vision_side_weight: float = 0.0  # stage 1 weight of the side label within the dense loss (>0 hurt kinds)
    side_weight: float = 0.5  # the same in stage 2
    pointer_weight: float = 1.0  # stage 2: attention supervision of answers about a shape (AttentionPointer)
    pointer_layer: int = 2  # the decoder layer whose first head is taught where to look
    steps: int = 2200  # stage 2: question answering
    schedule_steps: int = 0  # length of the cosine schedule; 0 = steps (stopping early = --steps K --schedule-steps H)
    batch_size: int = 32
    lr: float = 1e-3
    min_lr_ratio: float = 0.05
    warmup_steps: int = 100
    weight_decay: float = 0.01
    beta2: float = 0.98
    vision_lr_scale: float = 1.0  # learning rate of the vision tower relative to --lr
    easy_steps: int = 200  # curriculum: single-shape colour/shape/describe questions first
    grad_clip: float = 1.0
    vocab_size: int = 768
    text_hidden: int = 128
    text_layers: int = 4
    text_heads: int = 4
    text_kv_heads: int = 2
    text_intermediate: int = 384
    vision_hidden: int = 96
    vision_depth: int = 4
    vision_heads: int = 4
    vision_intermediate: int = 288
    threads: int = 1  # 1: the committed run's numerics; more threads may change the last bits


# ----------------------------------------------------------------------------------------------------------------
# Tokenizer


def build_tokenizer(cfg: TrainConfig):
    """Byte-level BPE trained on every dataset string (weighted by how often training draws them)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=cfg.vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    rng = np.random.default_rng([scenes.TRAIN_NAMESPACE, cfg.seed, 10**9])
    corpus = scenes.all_texts() * 3
    corpus += ["user\n", "assistant\n", "system\n", "You are a helpful assistant."] * 50
    for _ in range(1000):  # question/answer frequencies as training draws them (images ignored)
        s = scenes.sample(rng)
        corpus += [s.question, s.answer]
    # Every non-ASCII character on its own, often: its bytes merge into one token before any merge across
    # characters, so no token ever holds a partial character.
    chars = sorted({c for text in corpus for c in text if ord(c) > 127})
    corpus += chars * 200
    tok.train_from_iterator(corpus, trainer=trainer)
    check_whole_characters(tok)
    return tok


def check_whole_characters(tok) -> None:
    """Every dataset string must tokenize into tokens that each decode to whole UTF-8 characters, so Chinese
    answers stream as whole characters even where a detokenizer emits one token at a time."""
    for text in scenes.all_texts():
        for tid in tok.encode(text).ids:
            piece = tok.decode([tid])
            if "\ufffd" in piece:
                raise RuntimeError(f"{text!r}: token {tid} ({tok.id_to_token(tid)!r}) splits a character")


def write_tokenizer_files(tok, out: Path) -> dict[str, int]:
    tok.save(str(out / "tokenizer.json"))
    ids = {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}
    added = {
        str(ids[t]): {
            "content": t,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for t in SPECIAL_TOKENS
    }
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added,
        "additional_special_tokens": [t for t in SPECIAL_TOKENS if t not in ("<|endoftext|>", "<|im_end|>")],
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 4096,
        "split_special_tokens": False,
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2, ensure_ascii=False) + "\n")
    (out / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    return ids


# ----------------------------------------------------------------------------------------------------------------
# Model


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


def write_side_configs(out: Path, ids: dict[str, int]) -> None:
    preprocessor = {
        "image_processor_type": "Qwen2VLImageProcessor",
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
        "size": {"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS},
    }
    (out / "preprocessor_config.json").write_text(json.dumps(preprocessor, indent=2) + "\n")
    generation = {
        "bos_token_id": ids["<|endoftext|>"],
        "pad_token_id": ids["<|endoftext|>"],
        "eos_token_id": [ids["<|im_end|>"], ids["<|endoftext|>"]],
        "do_sample": False,
        "max_new_tokens": 64,
    }
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")


# ----------------------------------------------------------------------------------------------------------------
# Pixels: the runtime processor (orin_vlm_node.processing) so training sees what inference sees.


class Pixels:
    """Turns HWC uint8 RGB images into (pixel_values (N,1536) f32, grid_thw (n,3) long, tokens per image)."""

    def __init__(self, model_dir: Path, allow_fallback: bool) -> None:
        try:
            from orin_vlm_node.processing import ImageProcessor

            self._proc = ImageProcessor.from_pretrained(str(model_dir))
            self.kind = "orin_vlm_node.processing.ImageProcessor"
        except ImportError:
            if not allow_fallback:
                raise
            from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

            self._hf = Qwen2VLImageProcessorPil.from_pretrained(str(model_dir))
            self._proc = None
            self.kind = "transformers Qwen2VLImageProcessorPil (fallback)"

    def __call__(self, images: list[np.ndarray]) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
        if self._proc is not None:
            batch = self._proc.preprocess(images, color="rgb")
            return batch.pixel_values, batch.grid_thw, list(batch.num_tokens)
        from PIL import Image

        out = self._hf([Image.fromarray(im) for im in images], return_tensors="pt")
        grid = out["image_grid_thw"]
        return out["pixel_values"].float(), grid, [int(t * h * w) // 4 for t, h, w in grid.tolist()]


# ----------------------------------------------------------------------------------------------------------------
# Batches


class Encoder:
    """Prompt/answer token ids exactly as the runtime builds them (template text, then pad expansion)."""

    def __init__(self, tok, ids: dict[str, int]) -> None:
        self.tok = tok
        self.ids = ids
        self._cache: dict[str, tuple[list[int], list[int]]] = {}  # text -> (token ids, first character of each)

    def _encoded(self, text: str) -> tuple[list[int], list[int]]:
        if text not in self._cache:
            enc = self.tok.encode(text)
            self._cache[text] = (enc.ids, [a for a, _ in enc.offsets])
        return self._cache[text]

    def _enc(self, text: str) -> list[int]:
        return self._encoded(text)[0]

    def answer_starts(self, answer: str) -> list[int]:
        """The first character of each token of ``answer(answer)``, and ``len(answer)`` for its <|im_end|>."""
        return self._encoded(answer)[1] + [len(answer)]

    def prompt(self, question: str, n_image_tokens: int | None) -> list[int]:
        vision = "<|vision_start|><|image_pad|><|vision_end|>" if n_image_tokens is not None else ""
        ids = self._enc(f"<|im_start|>user\n{vision}{question}<|im_end|>\n<|im_start|>assistant\n")
        if n_image_tokens is None:
            return list(ids)
        pad = self.ids["<|image_pad|>"]
        i = ids.index(pad)
        return ids[:i] + [pad] * n_image_tokens + ids[i + 1 :]

    def answer(self, answer: str) -> list[int]:
        return self._enc(answer) + [self.ids["<|im_end|>"]]


SHAPE_BACKGROUND = len(scenes.SHAPES)  # dense label of a token that shows no shape (kind classes 0..4)
COLOR_BACKGROUND = len(scenes.COLORS)  # (colour classes 0..5)
MIN_COVER = 0.25  # a token is labelled with a shape when the shape covers at least this fraction of it
SIDES = ("left", "right", "top", "bottom")
IGNORE = -100  # cross_entropy's ignore_index: tokens without a side label


def shape_cover(scene: scenes.Scene, grid_thw: list[int]) -> np.ndarray:
    """(n_shapes, n_tokens): the fraction of every image token (merged 2x2 patches, raster order) each shape covers.

    The label map is at the picture's own resolution; area-resampling each shape's mask to the token grid gives
    the fractions (the processor's resize maps the picture onto the same grid).
    """
    import cv2

    th, tw = grid_thw[1] // 2, grid_thw[2] // 2
    return np.stack(
        [
            cv2.resize((scene.labels == i + 1).astype(np.float32), (tw, th), interpolation=cv2.INTER_AREA).reshape(-1)
            for i in range(len(scene.shapes))
        ]
    )


def token_labels(scene: scenes.Scene, grid_thw: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per image token: the kind and colour of the shape covering most of it (background where no shape covers
    MIN_COVER of it) and, in the two-shape pair layouts, that shape's side (index into SIDES; IGNORE elsewhere)."""
    cover = shape_cover(scene, grid_thw)
    best = cover.argmax(0)
    shown = cover.max(0) >= MIN_COVER
    kinds = np.array([scenes.SHAPES.index(s.kind) for s in scene.shapes])[best]
    colors = np.array([list(scenes.COLORS).index(s.color) for s in scene.shapes])[best]
    sides = np.full(best.shape, IGNORE)
    if scene.sides is not None:
        sides = np.array([SIDES.index(side) for side in scene.sides])[best]
    return (
        torch.from_numpy(np.where(shown, kinds, SHAPE_BACKGROUND)),
        torch.from_numpy(np.where(shown, colors, COLOR_BACKGROUND)),
        torch.from_numpy(np.where(shown, sides, IGNORE)),
    )


def token_centres(grid_thw: list[int]) -> torch.Tensor:
    """(n_tokens, 2) x and y of every image token's centre, scaled to [-1, 1] across the picture (raster order)."""
    th, tw = grid_thw[1] // 2, grid_thw[2] // 2
    ys, xs = torch.meshgrid((torch.arange(th) + 0.5) / th * 2 - 1, (torch.arange(tw) + 0.5) / tw * 2 - 1, indexing="ij")
    return torch.stack([xs.reshape(-1), ys.reshape(-1)], dim=1)


@dataclass
class DenseTargets:
    """What every image token of a batch should tell: shape kind, colour (token_labels) and where it is."""

    kinds: torch.Tensor  # (n_tokens,) long, SHAPE_BACKGROUND where no shape
    colors: torch.Tensor  # (n_tokens,) long, COLOR_BACKGROUND where no shape
    sides: torch.Tensor  # (n_tokens,) long, IGNORE outside shapes of pair layouts
    centres: torch.Tensor  # (n_tokens, 2) float in [-1, 1]


def dense_targets(scene_list: list[scenes.Scene], grid: torch.Tensor) -> DenseTargets:
    """Targets of every pictured scene, concatenated in the order of the vision tower's tokens."""
    pictured = [sc for sc in scene_list if sc.labels is not None]
    grids = grid.tolist()
    kinds, colors, sides = zip(*(token_labels(sc, g) for sc, g in zip(pictured, grids, strict=True)), strict=True)
    return DenseTargets(
        kinds=torch.cat(kinds),
        colors=torch.cat(colors),
        sides=torch.cat(sides),
        centres=torch.cat([token_centres(g) for g in grids]),
    )


class DenseHeads(torch.nn.Module):
    """Training-only linear probes on the vision tower's merged tokens (the features the decoder reads): shape
    kind, colour, position and (in pair layouts) side of every token. They give the vision tower a gradient at
    every token instead of the language model's few answer tokens (a plain ViT learns shapes far too slowly from
    the latter alone), and make "where" a categorical feature of each token, like its colour: with position
    only implicit the decoder answered every position question with one constant; not saved."""

    BACKGROUND_WEIGHT = 0.25  # background tokens are many and easy; shape tokens carry the signal

    def __init__(self, dim: int) -> None:
        super().__init__()
        kind_w = torch.ones(SHAPE_BACKGROUND + 1)
        kind_w[SHAPE_BACKGROUND] = self.BACKGROUND_WEIGHT
        color_w = torch.ones(COLOR_BACKGROUND + 1)
        color_w[COLOR_BACKGROUND] = self.BACKGROUND_WEIGHT
        self.register_buffer("kind_weight", kind_w)
        self.register_buffer("color_weight", color_w)
        self.kind = torch.nn.Linear(dim, SHAPE_BACKGROUND + 1)
        self.color = torch.nn.Linear(dim, COLOR_BACKGROUND + 1)
        self.where = torch.nn.Linear(dim, 2)
        self.side = torch.nn.Linear(dim, len(SIDES))

    def loss(self, tokens: torch.Tensor, t: DenseTargets, side_weight: float) -> torch.Tensor:
        """tokens (n_tokens, dim)."""
        ce = torch.nn.functional.cross_entropy
        loss = (
            ce(self.kind(tokens), t.kinds, weight=self.kind_weight)
            + ce(self.color(tokens), t.colors, weight=self.color_weight)
            + torch.nn.functional.mse_loss(self.where(tokens), t.centres)
        )
        if side_weight and (t.sides != IGNORE).any():  # batches without a pair layout have no side label
            loss = loss + side_weight * ce(self.side(tokens), t.sides, ignore_index=IGNORE)
        return loss

    @torch.no_grad()
    def accuracy(self, tokens: torch.Tensor, t: DenseTargets) -> tuple[float, float, float, float]:
        """Kind and colour accuracy over tokens that show a shape, side accuracy over those with a side, mean
        absolute position error."""
        on = t.kinds != SHAPE_BACKGROUND
        sided = t.sides != IGNORE
        k = (self.kind(tokens[on]).argmax(-1) == t.kinds[on]).float().mean().item()
        c = (self.color(tokens[on]).argmax(-1) == t.colors[on]).float().mean().item()
        side = (self.side(tokens[sided]).argmax(-1) == t.sides[sided]).float().mean().item()
        return k, c, side, (self.where(tokens) - t.centres).abs().mean().item()


@dataclass
class PointerQuery:
    """One supervised attention row: in batch row ``row``, the token at ``pos`` should look at ``targets``."""

    row: int
    pos: int
    targets: torch.Tensor  # (k,) long: sequence indices of the subject's image tokens


def pointer_queries(
    drawn: list[tuple[scenes.Sample, scenes.Scene]], batch: dict[str, torch.Tensor], enc: Encoder
) -> list[PointerQuery]:
    """Where the decoder should look while it answers: from every token that predicts an answer token, to the
    image tokens of the shape that part of the answer is about (``Scene.subjects``: "On the left." decides its
    axis at the first token but its side only at the third; a description names the left shape, then the right
    one). A shape's tokens are those it covers at least MIN_COVER of, or its most covered token when it is
    smaller. Counting and chat have no subject."""
    queries = []
    grids = iter(batch["image_grid_thw"].tolist() if "image_grid_thw" in batch else [])
    for row, (sample, scene) in enumerate(drawn):
        if sample.image is None:
            continue
        grid = next(grids)
        if not scene.subjects:
            continue
        image_pos = (batch["input_ids"][row] == enc.ids["<|image_pad|>"]).nonzero().squeeze(1)
        shape_tokens = [
            image_pos[torch.as_tensor(np.flatnonzero(c >= MIN_COVER) if c.max() >= MIN_COVER else [c.argmax()])]
            for c in shape_cover(scene, grid)
        ]
        first = int((batch["labels"][row] != IGNORE).nonzero()[0])  # the answer's first token
        for t, char in enumerate(enc.answer_starts(sample.answer)):
            shape = [i for start, i in scene.subjects if start <= char][-1]
            queries.append(PointerQuery(row, first + t - 1, shape_tokens[shape]))
    return queries


class AttentionPointer:
    """Teaches the first head of one decoder layer where to look: a question about "the triangle" is answered
    by reading the triangle's image tokens, but the language-model loss alone never taught the decoder that
    binding (it answered colour and position questions identically for every shape of a picture). The loss is
    the negative log of the attention mass the head puts on the subject's tokens, computed from the layer's
    own projections, norms and M-RoPE on the inputs captured by a forward pre-hook. (Supervising, instead or as
    well, a head that looks from the shape's name in the question learned no binding in side-by-side runs.)"""

    def __init__(self, attn: torch.nn.Module) -> None:
        self.attn = attn
        self.inputs: tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]] | None = None

        def capture(_module, _args, kwargs) -> None:  # a plain function: save()'s deepcopy shares, not copies, it
            self.inputs = (kwargs["hidden_states"], kwargs["position_embeddings"])

        attn.register_forward_pre_hook(capture, with_kwargs=True)

    def loss(self, queries: list[PointerQuery]) -> torch.Tensor:
        from transformers.models.qwen3_vl.modeling_qwen3_vl import apply_rotary_pos_emb

        a = self.attn
        h, (cos, sin) = self.inputs  # h (B, L, hidden); cos, sin (B, L, head_dim)
        b, length, _ = h.shape
        q = a.q_norm(a.q_proj(h).view(b, length, -1, a.head_dim))[:, :, :1].transpose(1, 2)  # (B, 1, L, hd)
        k = a.k_norm(a.k_proj(h).view(b, length, -1, a.head_dim))[:, :, :1].transpose(1, 2)  # kv head of head 0
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        losses = []
        for qr in queries:
            scores = (k[qr.row, 0, : qr.pos + 1] @ q[qr.row, 0, qr.pos]) * a.scaling  # (pos + 1,) causal keys
            logp = torch.log_softmax(scores, dim=0)
            losses.append(-torch.logsumexp(logp[qr.targets], dim=0))
        return torch.stack(losses).mean()


def make_batch(samples: list[scenes.Sample], enc: Encoder, pixels: Pixels) -> dict[str, torch.Tensor]:
    images = [s.image for s in samples if s.image is not None]
    pv, grid, ntok = pixels(images) if images else (None, None, [])
    seqs, labels = [], []
    k = 0
    for s in samples:
        n = None
        if s.image is not None:
            n = ntok[k]
            k += 1
        p = enc.prompt(s.question, n)
        a = enc.answer(s.answer)
        seqs.append(p + a)
        labels.append([-100] * len(p) + a)
    length = max(len(x) for x in seqs)
    pad = enc.ids["<|endoftext|>"]
    input_ids = torch.full((len(seqs), length), pad, dtype=torch.long)
    label_t = torch.full((len(seqs), length), -100, dtype=torch.long)
    mask = torch.zeros((len(seqs), length), dtype=torch.long)
    for i, (x, y) in enumerate(zip(seqs, labels, strict=True)):
        input_ids[i, : len(x)] = torch.tensor(x)
        label_t[i, : len(y)] = torch.tensor(y)
        mask[i, : len(x)] = 1
    batch = {
        "input_ids": input_ids,
        "attention_mask": mask,
        "labels": label_t,
        "mm_token_type_ids": (input_ids == enc.ids["<|image_pad|>"]).long(),
    }
    if pv is not None:
        batch["pixel_values"] = pv
        batch["image_grid_thw"] = grid
    return batch


# ----------------------------------------------------------------------------------------------------------------
# Evaluation with transformers (the reference; the acceptance tests use our engine)


@torch.no_grad()
def hf_answer(
    model, enc: Encoder, pixels: Pixels, question: str, image: np.ndarray | None, max_new_tokens: int = 32
) -> str:
    """Greedy answer from transformers' generate, decoded without special tokens."""
    kwargs: dict[str, torch.Tensor] = {}
    n = None
    if image is not None:
        pv, grid, ntok = pixels([image])
        n = ntok[0]
        kwargs = {"pixel_values": pv.to(model.dtype), "image_grid_thw": grid}
    ids = torch.tensor([enc.prompt(question, n)])
    eos = [enc.ids["<|im_end|>"], enc.ids["<|endoftext|>"]]
    out = model.generate(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        mm_token_type_ids=(ids == enc.ids["<|image_pad|>"]).long(),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=eos,
        pad_token_id=enc.ids["<|endoftext|>"],
        **kwargs,
    )
    new = [t for t in out[0, ids.shape[1] :].tolist() if t not in eos]
    return enc.tok.decode(new)


def evaluate(model, enc: Encoder, pixels: Pixels, samples: list[scenes.Sample]) -> dict[str, float]:
    """Exact-match accuracy overall and per (qtype, lang)."""
    model.eval()
    hits: dict[str, list[int]] = defaultdict(list)
    for s in samples:
        ok = int(hf_answer(model, enc, pixels, s.question, s.image).strip() == s.answer)
        hits["overall"].append(ok)
        hits[f"{s.qtype}/{s.lang}"].append(ok)
        hits[s.qtype].append(ok)
    return {k: float(np.mean(v)) for k, v in sorted(hits.items())}


# ----------------------------------------------------------------------------------------------------------------
# Training


def cosine_lr(step: int, peak: float, warmup: int, total: int, min_ratio: float) -> float:
    """Linear warm-up to ``peak``, then cosine decay to ``min_ratio * peak`` at ``total``."""
    if step < warmup:
        return peak * (step + 1) / warmup
    t = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * t)))


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Stage 2 (question answering) learning rate."""
    return cosine_lr(step, cfg.lr, cfg.warmup_steps, cfg.schedule_steps or cfg.steps, cfg.min_lr_ratio)


def save(model, out: Path, ids: dict[str, int]) -> None:
    """bf16 copy of the weights in HF format (the training copy stays float32)."""
    import copy

    half = copy.deepcopy(model).to(torch.bfloat16)
    half.generation_config.do_sample = False
    half.save_pretrained(str(out))
    write_side_configs(out, ids)  # save_pretrained rewrites generation_config.json; keep ours


# Disjoint index ranges of train_rng(seed, index) for the three streams a run draws from.
EASY_OFFSET = 10**9  # stage 2 curriculum (rejection sampling: 1,000 indices per sample)
VISION_OFFSET = 10**12  # stage 1 pictures


def is_easy(sample: scenes.Sample, scene: scenes.Scene) -> bool:
    """Curriculum: scenes with a single shape asked about its colour, its kind or described."""
    return sample.qtype in ("color", "shape", "describe") and len(scene.shapes) == 1


def draw(cfg: TrainConfig, step: int, i: int) -> tuple[scenes.Sample, scenes.Scene]:
    """Stage 2 training sample ``i`` of ``step``: during the first ``easy_steps`` only easy ones (rejection
    sampling in a seed range of its own), then the full mixture."""
    index = step * cfg.batch_size + i
    if step >= cfg.easy_steps:
        return scenes.sample_with_scene(scenes.train_rng(cfg.seed, index))
    for j in range(1000):
        drawn = scenes.sample_with_scene(scenes.train_rng(cfg.seed, EASY_OFFSET + index * 1000 + j))
        if is_easy(*drawn):
            return drawn
    raise RuntimeError("no easy sample drawn")  # p(easy) is about 0.25: unreachable


def draw_picture(cfg: TrainConfig, step: int, i: int) -> tuple[scenes.Sample, scenes.Scene]:
    """Stage 1 picture ``i`` of ``step``: the training mixture's scenes (all layouts), chat skipped."""
    index = (step * cfg.batch_size + i) * 100
    for j in range(100):
        drawn = scenes.sample_with_scene(scenes.train_rng(cfg.seed, VISION_OFFSET + index + j))
        if drawn[0].image is not None:
            return drawn
    raise RuntimeError("no picture drawn")  # p(chat) is 0.1: unreachable


def init_vision(visual: torch.nn.Module) -> None:
    """Fan-in scaled normal init (std 1/sqrt(fan_in)) of the vision tower's linear and patch-embedding weights.

    transformers initialises every matrix with std 0.02, which at width 96 makes each block start as a near
    no-op; the fan-in scale learned the dense objective markedly faster in side-by-side runs.
    """
    for m in visual.modules():
        if isinstance(m, (torch.nn.Linear, torch.nn.Conv3d)):
            torch.nn.init.normal_(m.weight, std=m.weight[0].numel() ** -0.5)


def vision_tokens(visual: torch.nn.Module, pv: torch.Tensor, grid: torch.Tensor) -> torch.Tensor:
    """Merged image tokens (n_tokens, text_hidden) exactly as the decoder receives them."""
    return visual(pv, grid_thw=grid).pooler_output


def pretrain_vision(cfg: TrainConfig, model, heads: DenseHeads, pixels: Pixels, t0: float) -> None:
    """Stage 1: train the vision tower (with the dense heads) on per-token shape kind and colour."""
    visual = model.model.visual
    params = list(visual.parameters()) + list(heads.parameters())
    opt = torch.optim.AdamW(params, lr=cfg.vision_lr, betas=(0.9, cfg.beta2), weight_decay=cfg.weight_decay)
    warmup = max(1, cfg.vision_steps // 20)
    probe = [draw_picture(cfg, 10**6, i) for i in range(64)]  # a fixed probe batch, outside the training range
    probe_pv, probe_grid, _ = pixels([s.image for s, _ in probe])
    probe_targets = dense_targets([sc for _, sc in probe], probe_grid)
    visual.train()
    for step in range(cfg.vision_steps):
        drawn = [draw_picture(cfg, step, i) for i in range(cfg.batch_size)]
        pv, grid, _ = pixels([s.image for s, _ in drawn])
        targets = dense_targets([sc for _, sc in drawn], grid)
        for g in opt.param_groups:
            g["lr"] = cosine_lr(step, cfg.vision_lr, warmup, cfg.vision_steps, cfg.min_lr_ratio)
        loss = heads.loss(vision_tokens(visual, pv, grid), targets, cfg.vision_side_weight)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
        opt.step()
        if step % 100 == 0 or step == cfg.vision_steps - 1:
            with torch.no_grad():
                k, c, side, where = heads.accuracy(vision_tokens(visual, probe_pv, probe_grid), probe_targets)
            print(
                f"vision step {step} loss {loss.item():.4f} probe kind {k:.3f} colour {c:.3f} side {side:.3f} "
                f"where {where:.3f} "
                f"t {time.time() - t0:.0f}s",
                flush=True,
            )


def train(cfg: TrainConfig, out: Path, allow_fallback: bool, eval_every: int, eval_n: int, save_every: int = 0) -> None:
    from transformers import Qwen3VLForConditionalGeneration

    torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    tok = build_tokenizer(cfg)
    ids = write_tokenizer_files(tok, out)
    write_side_configs(out, ids)
    config = build_config(cfg, ids, tok.get_vocab_size())
    config.save_pretrained(str(out))
    pixels = Pixels(out, allow_fallback)
    enc = Encoder(tok, ids)
    model = Qwen3VLForConditionalGeneration(config)
    model.config._attn_implementation = "sdpa"
    n_params = sum(p.numel() for p in model.parameters())
    print(f"params {n_params / 1e6:.2f} M, vocab {tok.get_vocab_size()}, pixels via {pixels.kind}", flush=True)
    init_vision(model.model.visual)
    heads = DenseHeads(cfg.text_hidden)
    pretrain_vision(cfg, model, heads, pixels, t0)
    # Stage 2 keeps the dense loss on the tokens the decoder reads, captured from the vision tower's forward.
    captured: list[torch.Tensor] = []
    model.model.visual.register_forward_hook(lambda _m, _i, out: captured.append(out.pooler_output))
    pointer = AttentionPointer(model.model.language_model.layers[cfg.pointer_layer].self_attn)
    groups: dict[tuple[bool, bool], list[torch.nn.Parameter]] = defaultdict(list)
    for n, p in model.named_parameters():
        groups[(".visual." in f".{n}", p.ndim >= 2 and "embed_tokens" not in n)].append(p)
    groups[(True, False)] += list(heads.parameters())
    opt = torch.optim.AdamW(
        [
            {
                "params": ps,
                "weight_decay": cfg.weight_decay if decay else 0.0,
                "lr_scale": cfg.vision_lr_scale if vision else 1.0,
            }
            for (vision, decay), ps in sorted(groups.items())
        ],
        lr=cfg.lr,
        betas=(0.9, cfg.beta2),
        eps=1e-8,
    )
    eval_set = scenes.held_out_samples(eval_n)
    ema = None
    for step in range(cfg.steps):
        model.train()
        drawn = [draw(cfg, step, i) for i in range(cfg.batch_size)]
        batch = make_batch([s for s, _ in drawn], enc, pixels)
        for g in opt.param_groups:
            g["lr"] = lr_at(step, cfg) * g["lr_scale"]
        captured.clear()
        loss = model(**batch).loss
        if "image_grid_thw" in batch and cfg.aux_weight:
            (tokens,) = captured
            targets = dense_targets([sc for _, sc in drawn], batch["image_grid_thw"])
            loss = loss + cfg.aux_weight * heads.loss(tokens, targets, cfg.side_weight)
        queries = pointer_queries(drawn, batch, enc) if cfg.pointer_weight else []
        mass = float("nan")  # geometric mean of the attention mass on the subjects
        if queries:
            pointer_loss = pointer.loss(queries)
            loss = loss + cfg.pointer_weight * pointer_loss
            mass = math.exp(-pointer_loss.item())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_([p for g in opt.param_groups for p in g["params"]], cfg.grad_clip)
        opt.step()
        ema = loss.item() if ema is None else 0.95 * ema + 0.05 * loss.item()
        if step % 25 == 0 or step == cfg.steps - 1:
            print(
                f"step {step} loss {loss.item():.4f} ema {ema:.4f} lr {lr_at(step, cfg):.2e} "
                f"pointer mass {mass:.2f} t {time.time() - t0:.0f}s",
                flush=True,
            )
        if eval_every and step and step % eval_every == 0:
            acc = evaluate(model, enc, pixels, eval_set)
            print(f"eval@{step} {json.dumps(acc)}", flush=True)
        if save_every and (step + 1) % save_every == 0:
            snap = out.parent / f"{out.name}_step{step + 1}"
            snap.mkdir(exist_ok=True)
            for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "preprocessor_config.json"):
                (snap / f).write_bytes((out / f).read_bytes())
            save(model, snap, ids)
            print(f"saved {snap} t {time.time() - t0:.0f}s", flush=True)
    train_s = time.time() - t0
    save(model, out, ids)
    meta = {
        "train_config": asdict(cfg),
        "train_seconds": round(train_s, 1),
        "params": n_params,
        "pixels": pixels.kind,
        "torch": torch.__version__,
    }
    print(json.dumps(meta), flush=True)
    (Path("/tmp") / "default_model_train_meta.json").write_text(json.dumps(meta, indent=2))


def eval_checkpoint(out: Path, n: int, allow_fallback: bool) -> dict[str, float]:
    """Load the saved (bf16) checkpoint in float32, as the engine does on the CPU, and score it."""
    from tokenizers import Tokenizer
    from transformers import Qwen3VLForConditionalGeneration

    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    ids = {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}
    model = Qwen3VLForConditionalGeneration.from_pretrained(str(out), dtype=torch.float32)
    acc = evaluate(model, Encoder(tok, ids), Pixels(out, allow_fallback), scenes.held_out_samples(n))
    print(f"checkpoint eval (n={n}) {json.dumps(acc)}", flush=True)
    return acc


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=REPO_ROOT / "orin_vlm_node" / "default_model")
    for f in fields(TrainConfig):  # one flag per recipe field: --vision-steps sets vision_steps, ...
        ap.add_argument(f"--{f.name.replace('_', '-')}", type=type(f.default), default=f.default)
    ap.add_argument("--save-every", type=int, default=0, help="also save <out>_step<N> snapshots every N steps")
    ap.add_argument("--eval-every", type=int, default=0, help="score on held-out samples every N steps (0: off)")
    ap.add_argument("--eval-n", type=int, default=200)
    ap.add_argument("--eval-only", action="store_true", help="only score the checkpoint in --out")
    ap.add_argument(
        "--allow-hf-pixels",
        action="store_true",
        help="fall back to transformers' PIL image processor if orin_vlm_node.processing is missing",
    )
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    if not args.eval_only:
        cfg = TrainConfig(**{f.name: getattr(args, f.name) for f in fields(TrainConfig)})
        train(cfg, args.out, args.allow_hf_pixels, args.eval_every, args.eval_n, args.save_every)
    eval_checkpoint(args.out, args.eval_n, args.allow_hf_pixels)


if __name__ == "__main__":
    main()
