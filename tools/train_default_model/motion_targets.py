"""Per-token targets of a clip's frame groups: where the moving shape is and which way it moves there.

Why: a frame group is one temporal patch of two frames, so the vision tower sees a shape's motion inside each
token's patch (its edge gone from one side, new on the other). Told per token which way the shape under it
moves, the tower makes the direction a feature of those tokens, as colour and kind are; the decoder then
answers "which way did the circle move?" by reading the circle's tokens, as it answers its colour.
"""

from __future__ import annotations

import cv2
import numpy as np
import torch

from support import scene_videos as videos

from .batches import Encoder
from .dense_targets import IGNORE, MIN_COVER
from .pointer import PointerQuery

BACKGROUND, STILL = 0, 1  # classes 2.. : moving in videos.DIRECTIONS order (dense_targets.MOTION_CLASSES)


def group_targets(
    clip: videos.Clip, size: tuple[int, int], temporal: int, factor: int
) -> tuple[np.ndarray, np.ndarray]:
    """(groups * th * tw,) class of every token of ``clip``'s frame groups at frame ``size`` (raster order per
    group): the moving shape where it moves within the group's frames, either shape where it stands still
    (a still shape; a group of one frame repeated), background elsewhere; and which tokens show the moving
    shape."""
    th, tw = size[0] // factor, size[1] // factor
    labels = list(clip.labels) + [clip.labels[-1]] * (-len(clip.labels) % temporal)
    out, shown = [], []
    for g in range(0, len(labels), temporal):
        pair = labels[g : g + temporal]
        moves = any(not np.array_equal(pair[0], other) for other in pair[1:])

        def cover(value: int, pair=pair) -> np.ndarray:
            mask = np.maximum.reduce([(lab == value).astype(np.float32) for lab in pair])
            return cv2.resize(mask, (tw, th), interpolation=cv2.INTER_AREA).reshape(-1)

        classes = np.full(th * tw, BACKGROUND, dtype=np.int64)
        classes[cover(2) >= MIN_COVER] = STILL
        moving = cover(1) >= MIN_COVER
        classes[moving] = 2 + videos.DIRECTIONS.index(clip.direction) if moves else STILL
        out.append(classes)
        shown.append(moving)
    return np.concatenate(out), np.concatenate(shown)


def motion_targets(
    clips: list[videos.Clip], sizes: list[tuple[int, int]], temporal: int, factor: int, batch: dict, enc: Encoder
) -> tuple[torch.Tensor, list[PointerQuery]]:
    """Targets of every token of a batch of clips, in the order the vision tower returns them; and where the
    decoder should look while it answers: from every token that predicts an answer token to the moving shape's
    tokens in every frame group (the pointer loss, as for a question about a picture's shape)."""
    classes, queries = [], []
    for row, (clip, size) in enumerate(zip(clips, sizes, strict=True)):
        target, shown = group_targets(clip, size, temporal, factor)
        classes.append(target)
        if not shown.any():  # a small shape covering no token enough: nothing to point at
            continue
        pads = (batch["input_ids"][row] == enc.ids["<|video_pad|>"]).nonzero().squeeze(1)
        looked_at = pads[torch.from_numpy(np.flatnonzero(shown))]
        first = int((batch["labels"][row] != IGNORE).nonzero()[0])  # the answer's first token
        queries += [PointerQuery(row, first + t - 1, looked_at) for t in range(len(enc.answer(clip.answer)))]
    return torch.from_numpy(np.concatenate(classes)), queries
