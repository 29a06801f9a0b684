"""Attention supervision: teach one decoder head to look at the image tokens of the shape an answer is about."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from support import synthetic_scenes as scenes

from .batches import Encoder
from .dense_targets import IGNORE, MIN_COVER, shape_cover


@dataclass
class PointerQuery:
    """One supervised attention row: in batch row ``row``, the token at ``pos`` should look at ``targets``."""

    row: int
    pos: int
    targets: torch.Tensor  # (k,) long: sequence indices of the subject's image tokens
    shape: int = -1  # which of the scene's shapes the targets show (-1: not one shape of a picture)


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
            queries.append(PointerQuery(row, first + t - 1, shape_tokens[shape], shape))
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
        rows = torch.tensor([qr.row for qr in queries])
        pos = torch.tensor([qr.pos for qr in queries])
        scores = (q[:, 0] @ k[:, 0].transpose(1, 2))[rows, pos] * a.scaling  # (B, L, L) -> (n, L)
        keys = torch.arange(length)
        scores = scores.masked_fill(keys[None, :] > pos[:, None], float("-inf"))  # causal: keys up to the query
        targets = torch.zeros_like(scores, dtype=torch.bool)
        for i, qr in enumerate(queries):
            targets[i, qr.targets] = True
        logp = torch.log_softmax(scores, dim=1)
        return -torch.logsumexp(logp.masked_fill(~targets, float("-inf")), dim=1).mean()
