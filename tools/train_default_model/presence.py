"""What a grounding prompt's labels are told while training: whether the picture shows each one.

A grounding answer lists only the asked labels the picture shows. Deciding that while writing each object is
a search over the question and the picture at once; told at each label's own tokens (after ``presence_layer``
decoder layers, so the layers above can read it) whether the picture shows it, the answer reads a decision the
decoder has been shown instead of one it must discover.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator

import torch

from support import synthetic_scenes as scenes

from .batches import Encoder

_QUOTED = re.compile(r'"([^"]+)"')


def _asked(sample: scenes.Sample, row_ids: torch.Tensor, enc: Encoder) -> Iterator[tuple[str, list[int]]]:
    """(label, positions of the prompt tokens that overlap it) for each label a grounding request names."""
    text, starts = enc.prompt_text(sample.question, True)
    expanded = int((row_ids == enc.ids["<|image_pad|>"]).sum()) - 1  # the one pad of ``text`` became this many
    ends = [*starts[1:], len(text)]
    base = text.index(sample.question)
    for m in _QUOTED.finditer(sample.question):
        begin, end = base + m.start(1), base + m.end(1)
        tokens = [i for i, (a, b) in enumerate(zip(starts, ends, strict=True)) if a < end and b > begin]
        yield m.group(1), [i + expanded for i in tokens]


def presence_targets(
    drawn: list[tuple[scenes.Sample, scenes.Scene]], batch: dict[str, torch.Tensor], enc: Encoder
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(rows, positions, present in {0., 1.}): the last prompt token of every label a grounding request
    names, and whether its answer lists that label."""
    rows, positions, present = [], [], []
    for row, (sample, _) in enumerate(drawn):
        if sample.qtype != "ground":
            continue
        shown = {obj["label"] for obj in json.loads(sample.answer)}
        for label, tokens in _asked(sample, batch["input_ids"][row], enc):
            rows.append(row)
            positions.append(tokens[-1])
            present.append(float(label in shown))
    return torch.tensor(rows), torch.tensor(positions), torch.tensor(present)
