"""Per-image-token targets (shape kind, colour, side, position, the shape's box) and the training-only probes
that learn them: the dense signal that teaches the small vision tower to see shapes."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from support import synthetic_scenes as scenes
from support.scene_formats import pixel_box
from support.scene_videos import DIRECTIONS

SHAPE_BACKGROUND = len(scenes.SHAPES)  # dense label of a token that shows no shape (kind classes 0..4)
COLOR_BACKGROUND = len(scenes.COLORS)  # (colour classes 0..5)
MIN_COVER = 0.25  # a token is labelled with a shape when the shape covers at least this fraction of it
SIDES = ("left", "right", "top", "bottom")
MOTION_CLASSES = 2 + len(DIRECTIONS)  # background, still, moving in each direction
BOX_BINS = 20  # each box edge also as one of 20 bins across the picture (50 units of the 0..1000 grid)
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


def token_labels(
    scene: scenes.Scene, grid_thw: list[int]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per image token: the kind and colour of the shape covering most of it (background where no shape covers
    MIN_COVER of it), in the two-shape pair layouts that shape's side (index into SIDES; IGNORE elsewhere), and
    that shape's pixel box (x1, y1, x2, y2) scaled to [-1, 1] across the picture (NaN on background)."""
    cover = shape_cover(scene, grid_thw)
    h, w = scene.labels.shape
    scale = np.array([w, h, w, h], dtype=np.float32)
    boxes = np.stack(
        [np.array(pixel_box(scene.labels, i), dtype=np.float32) / scale * 2 - 1 for i in range(len(cover))]
    )
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
        torch.from_numpy(np.where(shown[:, None], boxes[best], np.nan)),
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
    boxes: torch.Tensor  # (n_tokens, 4) float in [-1, 1], NaN where no shape
    shape_pool: torch.Tensor  # (n_shapes, n_tokens): each shape's cover of every token, rows summing to 1
    shape_kinds: torch.Tensor  # (n_shapes,) long: each shape's kind


def dense_targets(scene_list: list[scenes.Scene], grid: torch.Tensor) -> DenseTargets:
    """Targets of every pictured scene, concatenated in the order of the vision tower's tokens."""
    pictured = [sc for sc in scene_list if sc.labels is not None]
    grids = grid.tolist()
    kinds, colors, sides, boxes = zip(
        *(token_labels(sc, g) for sc, g in zip(pictured, grids, strict=True)), strict=True
    )
    covers = [torch.from_numpy(shape_cover(sc, g)) for sc, g in zip(pictured, grids, strict=True)]
    pool = torch.block_diag(*covers)  # (n_shapes, n_tokens): a shape covers tokens of its own picture only
    return DenseTargets(
        kinds=torch.cat(kinds),
        colors=torch.cat(colors),
        sides=torch.cat(sides),
        centres=torch.cat([token_centres(g) for g in grids]),
        boxes=torch.cat(boxes),
        shape_pool=pool / pool.sum(1, keepdim=True).clamp_min(1e-6),
        shape_kinds=torch.tensor([scenes.SHAPES.index(s.kind) for sc in pictured for s in sc.shapes]),
    )


class DenseHeads(torch.nn.Module):
    """Training-only linear probes on the vision tower's merged tokens (the features the decoder reads): shape
    kind, colour, position, (in pair layouts) side and the box of the shape it shows, for every token. They give the
    vision tower a gradient at every token instead of the language model's few answer tokens (a plain ViT learns
    shapes far too slowly from the latter alone), and make "where" a categorical feature of each token, like its
    colour: with position only implicit the decoder answered every position question with one constant; not saved.
    """

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
        self.motion = torch.nn.Linear(dim, MOTION_CLASSES)  # a clip's tokens (motion_targets)
        self.box = torch.nn.Linear(dim, 4)
        self.box_bins = torch.nn.Linear(dim, 4 * BOX_BINS)
        self.presence = torch.nn.Linear(dim, 1)  # on a grounding prompt's label tokens: shown or not (presence.py)
        self.subject = torch.nn.Linear(dim, len(scenes.SHAPES) + len(scenes.COLORS))  # training.subject_loss

    def motion_loss(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """tokens (n_tokens, dim) of frame groups, targets (n_tokens,) (``motion_targets``)."""
        weight = torch.ones(MOTION_CLASSES, device=tokens.device)
        weight[0] = self.BACKGROUND_WEIGHT
        return torch.nn.functional.cross_entropy(self.motion(tokens), targets, weight=weight)

    def loss(
        self,
        tokens: torch.Tensor,
        t: DenseTargets,
        side_weight: float,
        box_weight: float,
        bin_weight: float = 0.0,
        shape_weight: float = 0.0,
    ) -> torch.Tensor:
        """tokens (n_tokens, dim). The box loss makes where a shape starts and ends a feature of its tokens,
        which a grounding answer writes out as coordinates. The shape loss asks the kind of the mean of each
        shape's tokens (weighted by how much of each it covers): most shapes cover less than one token, and
        the per-token label alone taught their kinds slowly (a shape's tokens together read 0.36 of kinds
        right after 800 steps, 0.61 with this loss)."""
        ce = torch.nn.functional.cross_entropy
        loss = (
            ce(self.kind(tokens), t.kinds, weight=self.kind_weight)
            + ce(self.color(tokens), t.colors, weight=self.color_weight)
            + torch.nn.functional.mse_loss(self.where(tokens), t.centres)
        )
        on = ~t.boxes[:, 0].isnan()
        if box_weight and on.any():
            loss = loss + box_weight * torch.nn.functional.mse_loss(self.box(tokens[on]), t.boxes[on])
        if bin_weight and on.any():
            bins = ((t.boxes[on] + 1) / 2 * BOX_BINS).floor().clamp(0, BOX_BINS - 1).long().reshape(-1)
            logits = self.box_bins(tokens[on]).reshape(-1, BOX_BINS)
            loss = loss + bin_weight * ce(logits, bins)
        if shape_weight and len(t.shape_kinds):
            loss = loss + shape_weight * ce(self.kind(t.shape_pool @ tokens), t.shape_kinds)
        if side_weight and (t.sides != IGNORE).any():  # batches without a pair layout have no side label
            loss = loss + side_weight * ce(self.side(tokens), t.sides, ignore_index=IGNORE)
        return loss

    @torch.no_grad()
    def accuracy(self, tokens: torch.Tensor, t: DenseTargets) -> tuple[float, float, float, float, float, float]:
        """Kind and colour accuracy over tokens that show a shape, side accuracy over those with a side, mean
        absolute position error, mean absolute box error over tokens that show a shape (in [-1, 1] units), and
        the kind accuracy of each shape's tokens together (their log-probabilities summed by cover)."""
        on = t.kinds != SHAPE_BACKGROUND
        sided = t.sides != IGNORE
        k = (self.kind(tokens[on]).argmax(-1) == t.kinds[on]).float().mean().item()
        c = (self.color(tokens[on]).argmax(-1) == t.colors[on]).float().mean().item()
        side = (self.side(tokens[sided]).argmax(-1) == t.sides[sided]).float().mean().item()
        box = (self.box(tokens[on]) - t.boxes[on]).abs().mean().item()
        logp = torch.log_softmax(self.kind(tokens)[:, :SHAPE_BACKGROUND], -1)
        shape = ((t.shape_pool @ logp).argmax(-1) == t.shape_kinds).float().mean().item()
        return k, c, side, (self.where(tokens) - t.centres).abs().mean().item(), box, shape
