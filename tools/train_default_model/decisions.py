"""The tokens where a grounding answer decides something, weighed apart from the rest of the answer.

A grounding answer is mostly syntax (``{"bbox_2d": [``, commas, quotes) that the model writes right after a
few hundred steps, so the answer's mean cross-entropy hardly weighs the few tokens that decide what it says:
whether an object follows (after the opening ``[`` and after each ``}``) and which of the asked labels names
the object just located (the label's first token). Teacher-forced on held-out scenes, these were the tokens
the model got wrong (a label matched by colour, a list closed early or continued with a duplicate).
"""

from __future__ import annotations

import torch

from support import synthetic_scenes as scenes

from .batches import Encoder
from .dense_targets import IGNORE

_LABEL_OPENS = '"label": "'


def decision_characters(answer: str) -> set[int]:
    """Where ``answer`` (a grounding answer) decides: after the list's ``[``, after each object's ``}``, and
    the first character of each label."""
    chars = {1}
    chars.update(i + 1 for i, ch in enumerate(answer) if ch == "}")
    start = answer.find(_LABEL_OPENS)
    while start >= 0:
        chars.add(start + len(_LABEL_OPENS))
        start = answer.find(_LABEL_OPENS, start + 1)
    return chars


def decision_positions(
    drawn: list[tuple[scenes.Sample, scenes.Scene]], batch: dict[str, torch.Tensor], enc: Encoder
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows, positions) of the answer tokens of the batch's grounding answers that hold a decision character."""
    rows, positions = [], []
    for row, (sample, _) in enumerate(drawn):
        if sample.qtype != "ground":
            continue
        first = int((batch["labels"][row] != IGNORE).nonzero()[0])  # the answer's first token
        starts = enc.answer_starts(sample.answer)  # the last entry is <|im_end|>'s
        decisions = decision_characters(sample.answer)
        for t, (begin, end) in enumerate(zip(starts[:-1], starts[1:], strict=True)):
            if any(begin <= c < end for c in decisions):
                rows.append(row)
                positions.append(first + t)
    return torch.tensor(rows, dtype=torch.long), torch.tensor(positions, dtype=torch.long)


def decision_loss(
    logits: torch.Tensor, drawn: list[tuple[scenes.Sample, scenes.Scene]], batch: dict[str, torch.Tensor], enc: Encoder
) -> torch.Tensor | None:
    """Mean cross-entropy of the decision tokens (``logits``: (batch, seq, vocab), position p predicts p + 1);
    None when the batch holds no grounding answer."""
    rows, positions = decision_positions(drawn, batch, enc)
    if not len(rows):
        return None
    return torch.nn.functional.cross_entropy(logits[rows, positions - 1].float(), batch["labels"][rows, positions])
