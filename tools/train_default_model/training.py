"""The two training stages: dense vision pre-training, then question answering with the dense and pointer losses
(and, every ``video_every`` steps, a batch of clips asked which way a shape moved). A fine-tune (``init_from``)
starts from a checkpoint's tokenizer and weights and runs stage 2 only."""

from __future__ import annotations

import json
import math
import time
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from orin_vlm_node.processing import VideoProcessor
from support import scene_formats as formats
from support import synthetic_scenes as scenes

from .batches import Encoder, Pixels, make_batch, make_video_batch
from .checkpoint_files import SIDE_FILES, build_config, save, write_side_configs
from .decisions import decision_loss
from .dense_targets import DenseHeads, dense_targets
from .evaluation import evaluate, evaluate_formats
from .motion_targets import motion_targets
from .numbers import (
    NUMBER_MAX,
    add_number_tokens,
    init_number_embeddings,
    number_ids,
    padded_vocab,
    smoothed_number_loss,
)
from .pointer import AttentionPointer, pointer_queries
from .presence import presence_targets
from .recipe import TrainConfig, cosine_lr, draw, draw_clip, draw_picture, is_video_step, lr_at
from .vocabulary import build_tokenizer, write_tokenizer_files


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
        loss = heads.loss(
            vision_tokens(visual, pv, grid),
            targets,
            cfg.vision_side_weight,
            cfg.box_weight,
            cfg.bin_weight,
            cfg.shape_kind_weight,
        )
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
        opt.step()
        if step % 100 == 0 or step == cfg.vision_steps - 1:
            with torch.no_grad():
                probe_tokens = vision_tokens(visual, probe_pv, probe_grid)
                k, c, side, where, box, shape = heads.accuracy(probe_tokens, probe_targets)
            print(
                f"vision step {step} loss {loss.item():.4f} probe kind {k:.3f} shape {shape:.3f} colour {c:.3f} "
                f"side {side:.3f} where {where:.3f} box {box:.3f} t {time.time() - t0:.0f}s",
                flush=True,
            )


def write_checkpoint_skeleton(cfg: TrainConfig, out: Path):
    """Tokenizer, side configs and config.json into ``out``; returns (tokenizer, special ids, model config)."""
    out.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(cfg)
    ids = write_tokenizer_files(tok, out)
    write_side_configs(out, ids, cfg)
    config = build_config(cfg, ids, tok.get_vocab_size())
    config.save_pretrained(str(out))
    return tok, ids, config


def with_number_tokens(cfg: TrainConfig, tok, model, out: Path):
    """Give a fine-tuned checkpoint one token per integer 0..1000: the tokenizer in ``out`` rewritten, the
    (tied) embedding grown to the padded vocabulary, the number rows initialised; (tokenizer, number ids)."""
    if str(NUMBER_MAX) in tok.get_vocab():  # a checkpoint that has them already keeps its trained rows
        return tok, number_ids(tok)
    tok = add_number_tokens(tok)
    tok.save(str(out / "tokenizer.json"))
    ids = number_ids(tok)
    model.resize_token_embeddings(padded_vocab(tok.get_vocab_size()), mean_resizing=False)
    init_number_embeddings(model.get_input_embeddings().weight.data, ids, cfg.seed)
    model.config.save_pretrained(str(out))
    return tok, ids


def qa_optimizer(cfg: TrainConfig, model, heads: DenseHeads) -> torch.optim.AdamW:
    """AdamW over four groups: vision or not (``lr_scale``) x matrix or not (weight decay on matrices only)."""
    groups: dict[tuple[bool, bool], list[torch.nn.Parameter]] = defaultdict(list)
    for n, p in model.named_parameters():
        groups[(".visual." in f".{n}", p.ndim >= 2 and "embed_tokens" not in n)].append(p)
    groups[(True, False)] += list(heads.parameters())
    return torch.optim.AdamW(
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


@dataclass
class QuestionAnswering:
    """Stage 2: the language-model loss plus the dense loss on the tokens the decoder reads (captured from the
    vision tower's forward) plus the pointer loss on one decoder head."""

    cfg: TrainConfig
    model: torch.nn.Module
    heads: DenseHeads
    enc: Encoder
    pixels: Pixels
    videos: VideoProcessor
    numbers: torch.Tensor | None  # (1001,) token id of each integer 0..1000 when they are tokens
    captured: list[torch.Tensor] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.model.model.visual.register_forward_hook(lambda _m, _i, out: self.captured.append(out.pooler_output))
        layers = self.model.model.language_model.layers
        self.pointer = AttentionPointer(layers[self.cfg.pointer_layer].self_attn)
        self.opt = qa_optimizer(self.cfg, self.model, self.heads)

    def step(self, step: int) -> tuple[float, float]:
        """One optimizer step; returns (loss, geometric mean of the attention mass on the subjects)."""
        cfg = self.cfg
        self.model.train()
        clips, drawn = [], []
        if is_video_step(cfg, step):  # the motion loss on the clips' tokens, the pointer to the moving shape
            clips = [draw_clip(cfg, step, i) for i in range(cfg.batch_size)]
            batch, layouts = make_video_batch(clips, self.enc, self.videos)
        else:
            drawn = [draw(cfg, step, i) for i in range(cfg.batch_size)]
            batch = make_batch([s for s, _ in drawn], self.enc, self.pixels)
        for g in self.opt.param_groups:
            g["lr"] = lr_at(step, cfg) * g["lr_scale"]
        self.captured.clear()
        hidden = bool(cfg.presence_weight or cfg.subject_weight)
        out = self.model(**batch, output_hidden_states=hidden)
        loss = out.loss
        if cfg.number_sigma and self.numbers is not None:
            loss = loss + smoothed_number_loss(out.logits, batch["labels"], self.numbers, cfg.number_sigma)
        decided = decision_loss(out.logits, drawn, batch, self.enc) if cfg.decision_weight and drawn else None
        if decided is not None:
            loss = loss + cfg.decision_weight * decided
        if cfg.presence_weight and drawn:
            rows, positions, present = presence_targets(drawn, batch, self.enc)
            if len(rows):
                said = self.heads.presence(out.hidden_states[cfg.presence_layer][rows, positions]).squeeze(1)
                loss = loss + cfg.presence_weight * torch.nn.functional.binary_cross_entropy_with_logits(said, present)
        queries, pointer_weight = (pointer_queries(drawn, batch, self.enc), cfg.pointer_weight) if drawn else ([], 0.0)
        if clips:
            (tokens,) = self.captured
            c = self.videos.config
            sizes = [v.size for v in layouts]
            targets, queries = motion_targets(clips, sizes, c.temporal_patch_size, c.factor, batch, self.enc)
            pointer_weight = cfg.video_pointer_weight
            loss = loss + cfg.aux_weight * self.heads.motion_loss(tokens, targets)
        if "image_grid_thw" in batch and cfg.aux_weight:
            (tokens,) = self.captured
            targets = dense_targets([sc for _, sc in drawn], batch["image_grid_thw"])
            loss = loss + cfg.aux_weight * self.heads.loss(
                tokens, targets, cfg.side_weight, cfg.box_weight, cfg.bin_weight, cfg.shape_kind_weight
            )
        if cfg.subject_weight and drawn and queries:
            said = out.hidden_states[cfg.pointer_layer + 1]
            loss = loss + cfg.subject_weight * subject_loss(self.heads, said, queries, drawn)
        mass = float("nan")
        if queries and pointer_weight:
            pointer_loss = self.pointer.loss(queries)
            loss = loss + pointer_weight * pointer_loss
            mass = math.exp(-pointer_loss.item())
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_([p for g in self.opt.param_groups for p in g["params"]], cfg.grad_clip)
        self.opt.step()
        return loss.item(), mass


def subject_loss(heads: DenseHeads, hidden: torch.Tensor, queries, drawn) -> torch.Tensor:
    """At every answer-predicting token, the output of the pointer's layer names the kind and colour of the shape
    the pointer looks at: the pointer alone taught where to look, not that the colour is what to carry back."""
    rows = torch.tensor([q.row for q in queries])
    positions = torch.tensor([q.pos for q in queries])
    shapes = [drawn[q.row][1].shapes[q.shape] for q in queries]
    kinds = torch.tensor([scenes.SHAPES.index(s.kind) for s in shapes])
    colours = torch.tensor([list(scenes.COLORS).index(s.color) for s in shapes])
    logits = heads.subject(hidden[rows, positions])  # (n_queries, n_kinds + n_colours)
    n = len(scenes.SHAPES)
    ce = torch.nn.functional.cross_entropy
    return ce(logits[:, :n], kinds) + ce(logits[:, n:], colours)


def copy_checkpoint_skeleton(cfg: TrainConfig, base: Path, out: Path):
    """A fine-tune keeps its base's tokenizer, template and model config (copied into ``out``); the side configs
    are the recipe's (a fine-tune may read pictures at another resolution); (tokenizer, special ids)."""
    from tokenizers import Tokenizer

    from .vocabulary import SPECIAL_TOKENS

    out.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "config.json"):
        (out / name).write_bytes((base / name).read_bytes())
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    ids = {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}
    write_side_configs(out, ids, cfg)
    return tok, ids


def keep_base_config(cfg: TrainConfig, out: Path, text_config) -> None:
    """A fine-tune's ``config.json`` is its base's, with its vocabulary's size (number tokens may grow it):
    saving from a float32 copy would mark the sub-configs float32 where the base says bfloat16."""
    if cfg.init_from:
        config = json.loads((Path(cfg.init_from) / "config.json").read_text())
        config["text_config"]["vocab_size"] = text_config.vocab_size
        (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def save_snapshot(model, out: Path, steps_done: int, ids: dict[str, int], cfg: TrainConfig) -> Path:
    """``<out>_step<N>``: a complete checkpoint of the weights after ``steps_done`` stage-2 steps."""
    snap = out.parent / f"{out.name}_step{steps_done}"
    snap.mkdir(exist_ok=True)
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", *SIDE_FILES):
        (snap / f).write_bytes((out / f).read_bytes())
    save(model, snap, ids, cfg)
    return snap


def train(cfg: TrainConfig, out: Path, allow_fallback: bool, eval_every: int, eval_n: int, save_every: int = 0) -> None:
    """Both stages, then the bf16 checkpoint into ``out``; prints progress and the run's metadata."""
    from transformers import Qwen3VLForConditionalGeneration

    torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    t0 = time.time()
    if cfg.init_from:
        tok, ids = copy_checkpoint_skeleton(cfg, Path(cfg.init_from), out)
        model = Qwen3VLForConditionalGeneration.from_pretrained(cfg.init_from, dtype=torch.float32)
    else:
        tok, ids, config = write_checkpoint_skeleton(cfg, out)
        model = Qwen3VLForConditionalGeneration(config)
    numbers = None
    if cfg.number_tokens:
        tok, numbers = with_number_tokens(cfg, tok, model, out)
    pixels = Pixels(out, allow_fallback)
    enc = Encoder(tok, ids)
    model.config._attn_implementation = "sdpa"
    n_params = sum(p.numel() for p in model.parameters())
    print(f"params {n_params / 1e6:.2f} M, vocab {tok.get_vocab_size()}, pixels via {pixels.kind}", flush=True)
    heads = DenseHeads(cfg.text_hidden)
    if not cfg.init_from:
        init_vision(model.model.visual)
        pretrain_vision(cfg, model, heads, pixels, t0)
    qa = QuestionAnswering(cfg, model, heads, enc, pixels, VideoProcessor.from_pretrained(out), numbers)
    eval_set = scenes.held_out_samples(eval_n)
    ema = None
    for step in range(cfg.start_step, cfg.steps):
        loss, mass = qa.step(step)
        ema = loss if ema is None else 0.95 * ema + 0.05 * loss
        if step % 25 == 0 or step == cfg.steps - 1:
            print(
                f"step {step} loss {loss:.4f} ema {ema:.4f} lr {lr_at(step, cfg):.2e} "
                f"pointer mass {mass:.2f} t {time.time() - t0:.0f}s",
                flush=True,
            )
        if eval_every and step and step % eval_every == 0:
            scores = evaluate(model, enc, pixels, eval_set)
            scores.update(
                evaluate_formats(model, enc, pixels, formats.held_out_grounding(50), formats.held_out_shape_lists(20))
            )
            print(f"eval@{step} {json.dumps(scores)}", flush=True)
        if save_every and (step + 1) % save_every == 0:
            snap = save_snapshot(model, out, step + 1, ids, cfg)
            keep_base_config(cfg, snap, model.config.text_config)
            print(f"saved {snap} t {time.time() - t0:.0f}s", flush=True)
    train_s = time.time() - t0
    save(model, out, ids, cfg)
    keep_base_config(cfg, out, model.config.text_config)
    meta = {
        "train_config": asdict(cfg),
        "train_seconds": round(train_s, 1),
        "params": n_params,
        "pixels": pixels.kind,
        "torch": torch.__version__,
    }
    print(json.dumps(meta), flush=True)
