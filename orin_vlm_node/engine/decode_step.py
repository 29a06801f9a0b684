"""The decode step: one token of each of up to ``max_batch`` sequences in, (B, vocab) logits out, split
into a host half and a device half.

``prepare(seq, token, rope_delta)`` is the host half, called once per sequence of the step: it reserves
the sequence's next KV slot (may raise PoolExhausted before any change, so the engine can evict and
retry, or leave that sequence out) and stages the token. ``run()`` is the device half: the logits of the
staged tokens, in staging order. Two implementations, chosen in one place (:func:`build_decode_step`):

* :class:`DynamicDecodeStep` (CPU, and batches of several sequences on CUDA): fresh tensors and the
  cache's ordinary ``step`` every token; its work follows the tokens held. Several sequences go through
  the model as the rows of one forward (their attention per sequence, :class:`~..kvcache.SequencesAttention`).
* :class:`StaticDecodeStep` (CUDA, one sequence): everything that changes from one token to the next (input
  token, RoPE position, KV slot, block-table row) lives in tensors allocated once and refilled in place by
  ``prepare``, so ``run`` can be captured as a CUDA graph and replayed. ``prepare`` always goes through
  ``KVCache.prepare_static_decode``, which allocates the block and uploads the table row before any
  replay (docs/architecture.md, "Paging under CUDA graphs").

A graph has fixed shapes, so one graph attending over the whole ``max_context_tokens`` would cost every
token as much as the longest conversation. The static step therefore keeps one attention (and one
graph) per *context bucket*: widths of 256, 512, 1024, ... tokens up to the context limit. ``prepare``
picks the smallest bucket that holds the sequence, so a token's attention work is proportional to the
tokens held (within a factor of two). Graphs are captured lazily, the first time a bucket is used, and
share one memory pool.
"""

from __future__ import annotations

import functools
from typing import Protocol

import torch

from ..cuda import DecodeGraph
from ..kvcache import KVCache, SequencesAttention, StepAttention
from ..model.positions import decode_positions

SMALLEST_BUCKET = 256  # tokens


def context_buckets(max_context_tokens: int, smallest: int = SMALLEST_BUCKET) -> tuple[int, ...]:
    """Attention widths in tokens: powers of two from ``smallest`` below the limit, then the limit."""
    widths = []
    width = smallest
    while width < max_context_tokens:
        widths.append(width)
        width *= 2
    widths.append(max_context_tokens)
    return tuple(widths)


class DecodeStep(Protocol):
    """What the scheduler calls for every batch of generated tokens."""

    max_batch: int  # sequences one step takes

    def prepare(self, seq: int, token_id: int, rope_delta: int) -> None:
        """Host half: stage ``token_id`` of ``seq`` in this step: reserve KV slot ``length(seq)`` for it at
        RoPE position slot + rope_delta."""
        ...

    def run(self) -> torch.Tensor:
        """Device half: (B, vocab) logits of the staged tokens, in the order they were staged."""
        ...

    def describe(self) -> dict:
        """How decoding runs (for diagnostics)."""
        ...


class DynamicDecodeStep:
    """The ordinary decode step: ``cache.step`` and fresh input tensors every token; any number of
    sequences, each token a row of one forward."""

    max_batch = 1 << 30

    def __init__(self, model: torch.nn.Module, cache: KVCache):
        self.model = model
        self.cache = cache
        self._tokens: list[int] = []
        self._positions: list[int] = []
        self._steps: list[StepAttention] = []

    def prepare(self, seq: int, token_id: int, rope_delta: int) -> None:
        slot = self.cache.length(seq)
        self._steps.append(self.cache.step(seq, 1))
        self._tokens.append(token_id)
        self._positions.append(slot + rope_delta)

    def run(self) -> torch.Tensor:
        if not self._steps:
            raise RuntimeError("run() without prepare()")
        tokens, positions, steps = self._tokens, self._positions, self._steps
        self._tokens, self._positions, self._steps = [], [], []
        device = self.model.device
        ids = torch.tensor(tokens, dtype=torch.long, device=device)  # (B,)
        if len(steps) == 1:
            return self.model.forward(ids, decode_positions(positions[0], 0, device=device), steps[0])
        rope = torch.tensor(positions, dtype=torch.long, device=device).unsqueeze(0).expand(3, -1)  # (3, B)
        rows = torch.arange(len(steps), device=device)
        return self.model.forward(ids, rope, SequencesAttention(steps), logits_index=rows)

    def describe(self) -> dict:
        return {"step": "dynamic"}


class StaticDecodeStep:
    """Fixed buffers, one attention per context bucket, and the bucket's graph runner.

    With ``use_graphs`` on a CUDA device each bucket's forward is captured once and replayed; otherwise
    (CPU, graphs disabled, a failed capture) it runs eagerly over the same buffers. One sequence per step.
    """

    max_batch = 1

    def __init__(
        self,
        model: torch.nn.Module,
        cache: KVCache,
        device: torch.device,
        use_graphs: bool,
        buckets: tuple[int, ...] | None = None,
    ):
        self.model = model
        self.cache = cache
        self.device = device
        self.buckets = buckets or context_buckets(cache.config.max_context_tokens)
        self.buffers = cache.new_static_decode_buffers()
        self.input_ids = torch.zeros(1, dtype=torch.long, device=device)  # (1,)
        self.positions = torch.zeros((3, 1), dtype=torch.long, device=device)  # (3, 1)
        self._attention = {w: cache.static_decode_attention(self.buffers, w) for w in self.buckets}
        graphs = use_graphs and device.type == "cuda"
        pool = torch.cuda.graph_pool_handle() if graphs else None
        self._runners = {
            w: DecodeGraph(functools.partial(self.forward, w), device, enabled=graphs, pool=pool) for w in self.buckets
        }
        self.width = self.buckets[0]

    def prepare(self, seq: int, token_id: int, rope_delta: int) -> None:
        """The token goes to KV slot ``s = length(seq)`` and RoPE position ``s + rope_delta`` (all three
        M-RoPE streams), so positions keep running behind slots after an image."""
        slot = self.cache.length(seq)
        self.cache.prepare_static_decode(seq, self.buffers)
        self.input_ids.fill_(token_id)
        self.positions.fill_(slot + rope_delta)
        self.width = next(w for w in self.buckets if w > slot)

    def forward(self, width: int) -> torch.Tensor:
        """Device half, eager, over the first ``width`` slots: reads only the fixed buffers."""
        return self.model.forward(self.input_ids, self.positions, self._attention[width])

    def run(self) -> torch.Tensor:
        """Logits of the prepared token; with a graph this is the graph's static output, valid until the
        next ``run()``."""
        return self._runners[self.width].run()

    def describe(self) -> dict:
        graphs = {w: r.describe() for w, r in self._runners.items()}
        eager = {g["eager_reason"] for g in graphs.values() if g["eager_reason"]}
        return {
            "step": "static",
            "buckets": list(self.buckets),
            "graphs": "off (" + "; ".join(sorted(eager)) + ")" if eager else "on",
            "graphs_captured": sum(g["captured"] for g in graphs.values()),
        }


def build_decode_steps(
    model: torch.nn.Module, cache: KVCache, device: torch.device, use_graphs: bool
) -> tuple[DecodeStep, DecodeStep]:
    """The one place that decides how decode runs: (the step of one sequence, the step of several).

    On CUDA one sequence takes the static step (CUDA graphs when ``use_graphs``) and a batch the dynamic
    one, eagerly (graphs per batch size are not captured yet); on CPU, where a graph gains nothing, the
    dynamic step does both."""
    dynamic = DynamicDecodeStep(model, cache)
    if device.type == "cuda":
        return StaticDecodeStep(model, cache, device, use_graphs), dynamic
    return dynamic, dynamic
