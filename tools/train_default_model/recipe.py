"""What determines the trained weights: the recipe (``TrainConfig``), the learning-rate schedule and which
samples each step draws. Same recipe and seed -> same weights on the same torch build."""

from __future__ import annotations

import math
from dataclasses import dataclass

from support import scene_formats as formats
from support import scene_videos as videos
from support import synthetic_scenes as scenes


@dataclass
class TrainConfig:
    """Everything that determines the trained weights (recorded in the model card)."""

    seed: int = 0
    init_from: str = ""  # a checkpoint to fine-tune (its tokenizer and weights; stage 1 skipped); "" = from scratch
    vision_steps: int = 1400  # stage 1: dense vision pre-training (per-token shape kind, colour, position)
    vision_lr: float = 2e-3
    aux_weight: float = 0.5  # stage 2: weight of the dense vision loss next to the language-model loss
    vision_side_weight: float = 0.0  # stage 1 weight of the side label within the dense loss (>0 hurt kinds)
    side_weight: float = 0.5  # the same in stage 2
    pointer_weight: float = 1.0  # stage 2: attention supervision of answers about a shape (AttentionPointer)
    pointer_layer: int = 2  # the decoder layer whose first head is taught where to look
    subject_weight: float = 0.0  # stage 2: the pointer layer's output names the kind and colour it looked at
    steps: int = 2200  # stage 2: question answering
    schedule_steps: int = 0  # length of the cosine schedule; 0 = steps (stopping early = --steps K --schedule-steps H)
    start_step: int = 0  # resuming a run from its snapshot after this many stage-2 steps (--init-from the snapshot)
    batch_size: int = 32
    lr: float = 1e-3
    min_lr_ratio: float = 0.05
    warmup_steps: int = 100
    weight_decay: float = 0.01
    beta2: float = 0.98
    vision_lr_scale: float = 1.0  # learning rate of the vision tower relative to --lr
    grounding_rate: float = 0.0  # stage 2: share of grounding requests (after the curriculum)
    shape_list_rate: float = 0.0  # stage 2: share of "List the shapes as JSON." questions
    near_miss_rate: float = 0.0  # stage 2: grounding requests that also ask for a right-colour, wrong-kind shape
    box_weight: float = 0.0  # weight of each token's shape box within the dense loss
    shape_kind_weight: float = 0.0  # weight of each shape's kind, read from the mean of its tokens (dense loss)
    decision_weight: float = 0.0  # stage 2: extra weight of a grounding answer's deciding tokens (decisions.py)
    presence_weight: float = 0.0  # stage 2: a grounding prompt's label tokens tell whether the picture shows them
    presence_layer: int = 2  # ... after this many decoder layers (the layers above read it)
    bin_weight: float = 0.0  # weight of each token's shape box edges as bins within the dense loss
    number_tokens: bool = False  # the integers 0..1000 as tokens of their own (added to a fine-tuned tokenizer)
    number_sigma: float = 0.0  # >0: number targets spread over their neighbours (grid units; numbers.py)
    easy_steps: int = 200  # curriculum: single-shape colour/shape/describe questions first
    video_every: int = 0  # stage 2: every this-many-th step is a batch of clips asked which way a shape moved
    video_pointer_weight: float = 1.0  # the pointer loss on clip steps (to the moving shape's tokens)
    grad_clip: float = 1.0
    vocab_size: int = 768
    text_hidden: int = 128
    text_layers: int = 4
    text_heads: int = 4
    text_kv_heads: int = 2
    text_intermediate: int = 384
    image_tokens_min: int = 4  # a picture is resized to between this many image tokens (32x32 px each) ...
    image_tokens_max: int = 16  # ... and this many (preprocessor_config.json)
    vision_hidden: int = 96
    vision_depth: int = 4
    vision_heads: int = 4
    vision_intermediate: int = 288
    threads: int = 1  # 1: the committed run's numerics; more threads may change the last bits


def cosine_lr(step: int, peak: float, warmup: int, total: int, min_ratio: float) -> float:
    """Linear warm-up to ``peak``, then cosine decay to ``min_ratio * peak`` at ``total``."""
    if step < warmup:
        return peak * (step + 1) / warmup
    t = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * t)))


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Stage 2 (question answering) learning rate. A resumed run (``start_step``) continues the schedule and
    warms up to it again over ``warmup_steps``: its optimizer's moments start from zero."""
    lr = cosine_lr(step, cfg.lr, cfg.warmup_steps, cfg.schedule_steps or cfg.steps, cfg.min_lr_ratio)
    if cfg.start_step:
        lr *= min(1.0, (step - cfg.start_step + 1) / cfg.warmup_steps)
    return lr


# Disjoint index ranges of train_rng(seed, index) for the four streams a run draws from.
EASY_OFFSET = 10**9  # stage 2 curriculum (rejection sampling: 1,000 indices per sample)
VISION_OFFSET = 10**12  # stage 1 pictures
VIDEO_OFFSET = 10**13  # stage 2 clips


def is_easy(sample: scenes.Sample, scene: scenes.Scene) -> bool:
    """Curriculum: scenes with a single shape asked about its colour, its kind or described."""
    return sample.qtype in ("color", "shape", "describe") and len(scene.shapes) == 1


def draw(cfg: TrainConfig, step: int, i: int) -> tuple[scenes.Sample, scenes.Scene]:
    """Stage 2 training sample ``i`` of ``step``: during the first ``easy_steps`` only easy ones (rejection
    sampling in a seed range of its own), then the full mixture: grounding requests, shape lists and the plain
    questions."""
    index = step * cfg.batch_size + i
    if step >= cfg.easy_steps:
        rng = scenes.train_rng(cfg.seed, index)
        u = rng.random() if cfg.grounding_rate or cfg.shape_list_rate else 1.0  # plain questions only: no draw
        if u < cfg.grounding_rate:
            task = formats.grounding_task(rng, near_miss=cfg.near_miss_rate)
            return task.sample, task.scene
        if u < cfg.grounding_rate + cfg.shape_list_rate:
            return formats.shape_list_sample(rng)
        return scenes.sample_with_scene(rng)
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


def is_video_step(cfg: TrainConfig, step: int) -> bool:
    """Whether stage-2 ``step`` trains on clips (after the curriculum)."""
    return cfg.video_every > 0 and step >= cfg.easy_steps and step % cfg.video_every == cfg.video_every - 1


def draw_clip(cfg: TrainConfig, step: int, i: int) -> videos.Clip:
    """Clip ``i`` of a clip step ``step``."""
    return videos.motion_clip(scenes.train_rng(cfg.seed, VIDEO_OFFSET + step * cfg.batch_size + i))
