"""Coordinates as single tokens: the default model's vocabulary holds every integer 0..1000 as one token.

Qwen3-VL writes a box as four integers on a 0..1000 grid. Spelled digit by digit, a 4-layer, 128-wide decoder
has to turn a position into a hundreds digit, then a tens digit that depends on it: it learns generic numbers.
With one token per integer the coordinate is one choice among 1001 neighbouring values, their embeddings start
as smooth functions of the value (neighbours look alike, in what the decoder reads and what it writes), and
the loss spreads each target over its neighbours, so a near miss costs little and a far one much.
"""

from __future__ import annotations

import json
import math

import torch

NUMBER_MAX = 1000  # Qwen3-VL's grid: 0..1000
FREQUENCIES = tuple(0.5 * 1.6**k for k in range(8))  # half-turns over the grid (incommensurate: no aliases)


def add_number_tokens(tok):
    """``tok`` with the integers 10..1000 as tokens of their own (0..9 are byte tokens already).

    Merges build them from digits: all two-digit merges rank before any three-digit one, and every three-digit
    number has a merge from each split its two-digit merges can leave (``12|3`` and ``1|23``), so whichever pair
    merges first, the number ends as one token. A tokenizer that has them already is returned as it is.
    """
    from tokenizers import Tokenizer

    data = json.loads(tok.to_str())
    vocab: dict[str, int] = data["model"]["vocab"]
    merges: list[list[str]] = data["model"]["merges"]
    if str(NUMBER_MAX) in vocab:
        return tok

    def add(text: str, *pairs: tuple[str, str]) -> None:
        vocab[text] = max(vocab.values()) + 1
        merges.extend([list(p) for p in pairs])

    for n in range(10, 100):
        s = str(n)
        add(s, (s[0], s[1]))
    for n in range(100, 1000):
        s = str(n)
        add(s, (s[:2], s[2]), *([(s[0], s[1:])] if s[1] != "0" else []))
    add(str(NUMBER_MAX), ("100", "0"))
    return Tokenizer.from_str(json.dumps(data))


def number_ids(tok) -> torch.Tensor:
    """(NUMBER_MAX + 1,) the token id of each integer 0..NUMBER_MAX; ValueError when one is not a single token."""
    ids = []
    for n in range(NUMBER_MAX + 1):
        encoded = tok.encode(str(n), add_special_tokens=False).ids
        if len(encoded) != 1:
            raise ValueError(f"{n} is not one token: {encoded}")
        ids.append(encoded[0])
    return torch.tensor(ids)


def padded_vocab(size: int, multiple: int = 64) -> int:
    """The embedding rows a tokenizer of ``size`` entries gets (rounded up, as Qwen's checkpoints are)."""
    return -(-size // multiple) * multiple


def init_number_embeddings(embedding: torch.Tensor, ids: torch.Tensor, seed: int) -> None:
    """Rows ``ids`` of ``embedding`` (V, H) become smooth functions of their value: cosine/sine features of the
    value at several frequencies, projected by a random orthonormal map, at the norm of the other rows."""
    n = torch.arange(len(ids), dtype=torch.float64) / NUMBER_MAX
    angles = math.pi * n[:, None] * torch.tensor(FREQUENCIES, dtype=torch.float64)[None, :]
    features = torch.cat([angles.cos(), angles.sin()], dim=1)  # (1001, 2F)
    gen = torch.Generator().manual_seed(seed)
    basis, _ = torch.linalg.qr(torch.randn(embedding.shape[1], features.shape[1], generator=gen, dtype=torch.float64))
    rows = features @ basis.T  # (1001, H)
    others = torch.ones(embedding.shape[0], dtype=torch.bool)
    others[ids] = False
    norm = embedding[others].norm(dim=1).mean()
    with torch.no_grad():
        embedding[ids] = (rows / rows.norm(dim=1, keepdim=True) * norm).to(embedding.dtype)


def smoothed_number_loss(logits: torch.Tensor, labels: torch.Tensor, ids: torch.Tensor, sigma: float) -> torch.Tensor:
    """Cross-entropy of the positions that predict a number token against a Gaussian (``sigma`` grid units)
    over the numbers around the one written; logits (B, L, V) and labels (B, L) as the model's own loss takes
    them (labels not yet shifted). Zero when the batch writes no number."""
    value_of = torch.full((logits.shape[-1],), -1, dtype=torch.long)
    value_of[ids] = torch.arange(len(ids))
    targets = labels[:, 1:]
    values = torch.where(targets >= 0, value_of[targets.clamp(min=0)], -1)
    rows = values >= 0
    if not rows.any():
        return logits.sum() * 0.0
    logp = torch.log_softmax(logits[:, :-1][rows].float(), dim=-1)[:, ids]  # (N, 1001)
    grid = torch.arange(len(ids), dtype=torch.float32)
    soft = torch.softmax(-0.5 * ((grid[None, :] - values[rows][:, None].float()) / sigma) ** 2, dim=-1)
    return -(soft * logp).sum(-1).mean()
