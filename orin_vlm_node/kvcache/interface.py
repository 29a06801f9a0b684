"""The one seam between model code and KV storage.

The model never computes cache addresses and never branches on paged vs contiguous: for each forward
step the KV backend hands it a :class:`StepAttention`, and every decoder layer calls it with the new
tokens' (already rotated) q, k, v. The backend writes k/v to the slots of this step and returns the
attention output over everything the sequence has cached (prefix + these tokens, causally). A batched
decode step, one token of each of several sequences, hands the model a :class:`SequencesAttention`
that gives each row to its own sequence's step.

Positions are split on purpose (dual position tracking): RoPE positions are applied by the model
before the call; KV slot indices (cache placement and the causal mask) live only in the backend.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass(frozen=True)
class KVSink:
    """Where one layer's new K/V rows of a step go, for code that produces them and can store them itself
    (the GPU's q/k norm + RoPE kernel writes each rotated key and copies each value straight into the pool:
    no write launch, no copy of the strided heads). Row ``i`` of the step (token ``i``) goes to slot
    ``slot_mapping[i]``, at ``pool[slot // page_size, slot % page_size]``; a negative slot is a padding row
    and stores nothing. The rows are stored as they are: the pools have the producer's dtype."""

    k_pool: torch.Tensor  # (num_blocks, page_size, num_kv_heads, head_dim)
    v_pool: torch.Tensor  # same layout
    slot_mapping: torch.Tensor  # (L,) int64


class StepAttention(Protocol):
    """Attention of one forward step of one sequence.

    ``q``: (L, num_heads, head_dim); ``k``, ``v``: (L, num_kv_heads, head_dim), L new tokens whose
    KV slots are ``start .. start+L-1`` for the sequence this step belongs to. Returns
    (L, num_heads, head_dim) in q's dtype: softmax(q k^T * head_dim^-0.5 + causal mask over slots) v
    with GQA (kv head j serves q heads j*g .. j*g+g-1), softmax in fp32.

    A step may also offer ``kv_sink(layer, dtype) -> KVSink | None`` (the paged static decode step does):
    a caller that stored the layer's k and v through the sink it returned then calls with ``k = v = None``.
    """

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None) -> torch.Tensor: ...


class SequencesAttention:
    """One decode step of several sequences in one forward: row ``i`` of q, k, v is the new token of the
    sequence whose step is ``steps[i]``.

    Only attention is per sequence; the model's projections and MLPs run once over all rows, which is
    what makes a batch cheaper than its members one after another (a decode step reads every weight once,
    whatever the number of rows).
    """

    def __init__(self, steps: list[StepAttention]) -> None:
        self.steps = steps

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # q (B, nq, hd), k and v (B, nkv, hd) -> (B, nq, hd)
        return torch.cat([step(layer, q[i : i + 1], k[i : i + 1], v[i : i + 1]) for i, step in enumerate(self.steps)])
