"""The decode loop of one request: sample a token, stream its text, decide whether to stop, feed it back.

It owns what only matters token by token: the sampler (with its seeded generator), the ids the
repetition and presence penalties look at, the incremental detokenizer (never splits a UTF-8
character) and the stop-string matcher (holds back text that may still become a stop string). What it
does not own comes in as two callbacks from the engine: ``feed(token)`` runs the decode step (and may
raise PoolExhausted) and ``interrupt()`` says whether the request must stop early (context full,
cancelled). The generated ids and text stay readable after an exception, so the engine can settle the
request's KV with what was produced.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence

import torch

from ..kvcache import PoolExhausted
from ..processing import IncrementalDetokenizer, Tokenizer
from .metrics import RequestMetrics
from .sampling import ResolvedSampling, Sampler
from .stop_strings import StopStringMatcher

log = logging.getLogger("orin_vlm_node.engine")


class DecodeLoop:
    """Tokens after prefill until EOS, a stop string, ``max_new_tokens``, an interrupt or a full pool."""

    def __init__(
        self,
        params: ResolvedSampling,
        tokenizer: Tokenizer,
        context_ids: Sequence[int],
        device: torch.device,
        metrics: RequestMetrics,
    ):
        self.params = params
        self.generated: list[int] = []
        self.text_parts: list[str] = []
        self.reason = "error"
        self._sampler = Sampler(params, device=device)
        self._penalized = params.repetition_penalty != 1.0 or params.presence_penalty != 0.0
        self._context = torch.tensor(list(context_ids), dtype=torch.long, device=device) if self._penalized else None
        self._eos = set(tokenizer.eos_token_ids)
        self._detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=True)
        self._stops = StopStringMatcher(params.stop)
        self._metrics = metrics

    @property
    def text(self) -> str:
        return "".join(self.text_parts)

    def run(
        self, logits: torch.Tensor, feed: Callable[[int], torch.Tensor], interrupt: Callable[[], str | None]
    ) -> Iterator[tuple[str, tuple[int, ...]]]:
        """Yield (text, token ids) pieces from the prefill's ``logits`` on; :attr:`reason` says why it ended."""
        delta_ids: list[int] = []
        while True:
            token = self._sample(logits)
            if token in self._eos and not self.params.ignore_eos:
                self.reason = "stop"
                break
            delta_ids.append(token)
            piece = self._stops.push(self._detok.push(token))
            if piece:
                self.text_parts.append(piece)
                yield piece, tuple(delta_ids)
                delta_ids = []
            if self._stops.stopped:
                self.reason = "stop"
                break
            stop = "length" if len(self.generated) >= self.params.max_new_tokens else interrupt()
            if stop:
                self.reason = stop
                break
            try:
                logits = feed(token)
            except PoolExhausted as exc:
                log.warning("%s", exc)
                self.reason = "kv_pool_exhausted"
                break
        if not self._stops.stopped:
            tail = self._stops.push(self._detok.flush()) + self._stops.flush()
            if tail:
                self.text_parts.append(tail)
                yield tail, tuple(delta_ids)

    def _sample(self, logits: torch.Tensor) -> int:
        generated = None
        context = None
        if self._penalized:
            generated = torch.tensor(self.generated, dtype=torch.long, device=logits.device)
            context = torch.cat([self._context, generated])
        token = int(self._sampler.sample(logits[-1], context, generated))
        if not self.generated:
            self._metrics.mark_first_token()
        self.generated.append(token)
        return token
