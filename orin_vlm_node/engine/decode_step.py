"""The decode step: one token of each of up to ``max_batch`` sequences in, (B, vocab) logits out, split
into a host half and a device half.

``prepare(seq, token, rope_delta)`` is the host half, called once per sequence of the step: it reserves
the sequence's next KV slot (may raise PoolExhausted before any change, so the engine can evict and
retry, or leave that sequence out) and stages the token. ``run()`` is the device half: the logits of the
staged tokens, in staging order. Two implementations, chosen in one place (:func:`build_decode_step`):

More in docs/modules.md, ``orin_vlm_node/engine/decode_step.py``.
"""

from __future__ import annotations

import functools
from typing import Protocol

import torch

from ..cuda import DecodeGraph, LaunchModes
from ..kvcache import KVCache, SequencesAttention, StepAttention
from ..model.positions import decode_positions

SMALLEST_BUCKET = 256  # tokens


def doubling_buckets(limit: int, smallest: int) -> tuple[int, ...]:
    """Powers of two times ``smallest`` below ``limit``, then ``limit``: (256, 512, 1024, 1500) for 1500."""
    widths = []
    width = smallest
    while width < limit:
        widths.append(width)
        width *= 2
    widths.append(limit)
    return tuple(widths)


def context_buckets(max_context_tokens: int, smallest: int = SMALLEST_BUCKET) -> tuple[int, ...]:
    """Attention widths in tokens a static step has graphs for."""
    return doubling_buckets(max_context_tokens, smallest)


def batch_buckets(max_batch: int) -> tuple[int, ...]:
    """Batch sizes a static step has graphs for: 1, 2, 4, ... below ``max_batch``, then ``max_batch``."""
    return doubling_buckets(max_batch, 1)


class DecodeStep(Protocol):
    """What the scheduler calls for every batch of generated tokens."""

    overlap: bool  # whether the scheduler stages device tokens and reads them while the next step runs

    def prepare(self, seq: int, token_id: int | torch.Tensor, rope_delta: int) -> None:
        """Host half: stage ``token_id`` of ``seq`` in this step: reserve KV slot ``length(seq)`` for it at
        RoPE position slot + rope_delta. ``token_id`` may be a () device tensor when ``overlap``."""
        ...

    def discard(self) -> None:
        """Forget the rows staged since the last ``run()`` (their callers release the KV slots they reserved)."""
        ...

    def run(self) -> torch.Tensor:
        """Device half: (B, vocab) logits of the staged tokens, in the order they were staged."""
        ...

    def describe(self) -> dict:
        """How decoding runs (for diagnostics)."""
        ...


class DynamicDecodeStep:
    """The ordinary decode step: ``cache.step`` and fresh input tensors every token; any number of
    sequences, each token a row of one forward. Nothing to overlap: on the CPU every op runs as it is
    called."""

    overlap = False

    def __init__(self, model: torch.nn.Module, cache: KVCache):
        self.model = model
        self.cache = cache
        self._tokens: list[int] = []
        self._positions: list[int] = []
        self._steps: list[StepAttention] = []

    def prepare(self, seq: int, token_id: int | torch.Tensor, rope_delta: int) -> None:
        slot = self.cache.length(seq)
        self._steps.append(self.cache.step(seq, 1))
        self._tokens.append(int(token_id))
        self._positions.append(slot + rope_delta)

    def discard(self) -> None:
        self._tokens, self._positions, self._steps = [], [], []

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
        return {"step": "dynamic", "overlap": self.overlap}


class StaticDecodeStep:
    """Fixed buffers for up to ``max_batch`` sequences, one attention per (batch bucket, context bucket),
    and that bucket's graph runner.

    With ``use_cuda_graph`` on a CUDA device each bucket's forward is captured once and replayed; otherwise
    (CPU, graphs disabled, a failed capture) it runs eagerly over the same buffers. ``overlap`` (default:
    on CUDA) lets the scheduler stage device tokens and read them while the next step runs.
    ``capture_stream``: the side stream the graphs are captured on, the process's one (``cuda.graph``);
    ``launches``: how the kernels in them launch (``cuda.LaunchModes``; None: no kernels of ours).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        cache: KVCache,
        device: torch.device,
        use_cuda_graph: bool,
        max_batch: int = 1,
        buckets: tuple[int, ...] | None = None,
        overlap: bool | None = None,
        capture_stream: torch.cuda.Stream | None = None,
        launches: LaunchModes | None = None,
    ):
        self.model = model
        self.overlap = device.type == "cuda" if overlap is None else overlap
        self.cache = cache
        self.device = device
        self.max_batch = max_batch
        self.buckets = buckets or context_buckets(cache.config.max_context_tokens)
        self.batch_buckets = batch_buckets(max_batch)
        self.buffers = cache.new_static_decode_buffers(max_batch)
        self.input_ids = torch.zeros(max_batch, dtype=torch.long, device=device)  # (max_batch,)
        self.positions = torch.zeros(max_batch, dtype=torch.long, device=device)  # (max_batch,): all 3 streams
        self._rows = {b: torch.arange(b, device=device) for b in self.batch_buckets}  # logits of every row
        self._attention = {
            (b, w): cache.static_decode_attention(self.buffers.rows(b), w)
            for b in self.batch_buckets
            for w in self.buckets
        }
        pool = torch.cuda.graph_pool_handle() if use_cuda_graph and device.type == "cuda" else None
        self._runners = {
            key: DecodeGraph(
                functools.partial(self.forward, *key),
                device,
                use_cuda_graph=use_cuda_graph,
                pool=pool,
                stream=capture_stream,
                launches=launches,
            )
            for key in self._attention
        }
        self.staged = 0  # rows prepared since the last run()
        self.width = self.buckets[0]  # the context bucket of the staged rows

    def prepare(self, seq: int, token_id: int | torch.Tensor, rope_delta: int) -> None:
        """The token goes to KV slot ``s = length(seq)`` and RoPE position ``s + rope_delta`` (all three
        M-RoPE streams), so positions keep running behind slots after an image. A device token is copied
        on the device, in stream order: after the work that chose it, without the host reading it."""
        row = self.staged
        if row == self.max_batch:
            raise RuntimeError(f"a decode step takes at most {self.max_batch} sequences")
        slot = self.cache.length(seq)
        self.cache.prepare_static_decode(seq, self.buffers, row)
        if isinstance(token_id, torch.Tensor):
            self.input_ids[row].copy_(token_id)
        else:
            self.input_ids[row].fill_(token_id)
        self.positions[row].fill_(slot + rope_delta)
        width = next(w for w in self.buckets if w > slot)
        self.width = width if row == 0 else max(self.width, width)
        self.staged = row + 1

    def discard(self) -> None:
        self.staged = 0

    def forward(self, batch: int, width: int) -> torch.Tensor:
        """Device half, eager, for the first ``batch`` rows over the first ``width`` slots: reads only the
        fixed buffers. (batch, vocab) logits."""
        positions = self.positions[:batch].unsqueeze(0).expand(3, -1)  # (3, batch)
        rows = self._rows[batch] if batch > 1 else None
        return self.model.forward(self.input_ids[:batch], positions, self._attention[batch, width], logits_index=rows)

    def run(self) -> torch.Tensor:
        """(B, vocab) logits of the staged tokens; with a graph a view of the graph's static output, valid
        until the next ``run()``."""
        staged = self.staged
        if not staged:
            raise RuntimeError("run() without prepare()")
        batch = next(b for b in self.batch_buckets if b >= staged)
        if batch > staged:
            self.buffers.pad(staged)  # rows past the bucket are never read
        self.staged = 0
        return self._runners[batch, self.width].run()[:staged]

    def describe(self) -> dict:
        graphs = [r.describe() for r in self._runners.values()]
        eager = {g["eager_reason"] for g in graphs if g["eager_reason"]}
        return {
            "step": "static",
            "buckets": list(self.buckets),
            "batch_buckets": list(self.batch_buckets),
            "graphs": "off (" + "; ".join(sorted(eager)) + ")" if eager else "on",
            "graphs_captured": sum(g["captured"] for g in graphs),
            # each captured graph's way of launching (batch x context bucket), timed both ways with auto
            "dependent_launch": {
                f"{b}x{w}": r.dependent_launch for (b, w), r in self._runners.items() if r.dependent_launch
            },
            "overlap": self.overlap,
        }


def build_decode_step(
    model: torch.nn.Module,
    cache: KVCache,
    device: torch.device,
    use_cuda_graph: bool,
    max_batch: int,
    capture_stream: torch.cuda.Stream | None = None,
    launches: LaunchModes | None = None,
) -> DecodeStep:
    """The one place that decides how decode runs, for batches of up to ``max_batch`` sequences.

    On CUDA the static step (CUDA graphs when ``use_cuda_graph``, one per batch and context bucket, captured on
    ``capture_stream``, their kernels launched as ``launches`` says); on CPU, where a graph gains nothing, the
    dynamic step."""
    if device.type == "cuda":
        return StaticDecodeStep(
            model, cache, device, use_cuda_graph, max_batch, capture_stream=capture_stream, launches=launches
        )
    return DynamicDecodeStep(model, cache)
