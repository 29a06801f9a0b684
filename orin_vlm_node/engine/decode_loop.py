"""The decode loop of one request: sample a token, stream its text, decide whether to stop.

It owns what only matters token by token: the sampler (with its seeded generator), the ids the
repetition and presence penalties look at, the incremental detokenizer (never splits a UTF-8
character), the stop-string matcher (holds back text that may still become a stop string) and the
output format's matcher (which tokens may come next, and when the answer is complete). It does
not run the model, and it splits a token's life in two so the host's share can overlap the device's:
:meth:`DecodeLoop.sample` takes the logits of the last position fed and only *launches* the choice of the
next token (a device tensor, no wait), :meth:`DecodeLoop.take` is given that token once the host has read
it, streams its text and says whether to feed it. ``interrupt()`` says whether the request must stop
early (context full, cancelled). The generated ids and text stay readable after an exception, so the
engine can settle the request's KV with what was produced.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from ..processing import IncrementalDetokenizer, Tokenizer
from ..transfer import host_to_device
from .metrics import RequestMetrics
from .output_format import Constraint
from .sampling import ResolvedSampling, Sampler
from .stop_strings import StopStringMatcher


class DecodeLoop:
    """Tokens after prefill until EOS, a stop string, ``max_new_tokens``, an interrupt or a full pool."""

    def __init__(
        self,
        params: ResolvedSampling,
        tokenizer: Tokenizer,
        context_ids: Sequence[int],
        device: torch.device,
        metrics: RequestMetrics,
        constraint: Constraint | None = None,
        token_probs: bool = False,
    ):
        self.params = params
        self.constraint = constraint  # the output format's matcher: masks each row, takes each token
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
        self._delta_ids: list[int] = []  # tokens sampled since the last text piece went out
        self._probs: list[torch.Tensor] | None = [] if token_probs else None  # (1,) each, read at the end

    @property
    def text(self) -> str:
        return "".join(self.text_parts)

    def sample(self, logits: torch.Tensor) -> torch.Tensor:
        """The next token chosen from the logits of the last position fed ((N, vocab), the last row counts),
        as a () long tensor on their device: launched, not waited for. Penalties look at the tokens taken
        so far, so every token sampled before must have been taken."""
        generated = context = None
        if self._penalized:
            generated = host_to_device(self.generated, logits.device)
            context = torch.cat([self._context, generated])
        row = logits[-1] if self.constraint is None else self.constraint.masked(logits[-1])
        token = self._sampler.sample(row, context, generated)
        if self._probs is not None:  # on the device: read once, when the answer ends
            self._probs.append(torch.softmax(logits[-1].float(), -1).gather(0, token.view(1)))
        return token

    def token_probs(self) -> tuple[float, ...] | None:
        """The model's probability of each token taken (None unless asked for): one read of the device."""
        if self._probs is None:
            return None
        probs = torch.cat(self._probs).tolist() if self._probs else []
        return tuple(probs[: len(self.generated)])

    def take(self, token: int, interrupt: Callable[[], str | None]) -> tuple[list[tuple[str, tuple[int, ...]]], bool]:
        """The token :meth:`sample` chose, read by the host: stream its text, decide whether to stop. Returns
        the (text, token ids) pieces to emit and whether to feed the token (False: the answer ended,
        :attr:`reason` says why; the pieces then end with the text held back until now)."""
        pieces: list[tuple[str, tuple[int, ...]]] = []
        if not self.generated:
            self._metrics.mark_first_token()
        self.generated.append(token)
        if token in self._eos and not self.params.ignore_eos:
            return self._end("stop", pieces), False
        if self.constraint is not None:
            self.constraint.take(token)
        self._delta_ids.append(token)
        piece = self._stops.push(self._detok.push(token))
        if piece:
            self.text_parts.append(piece)
            pieces.append((piece, tuple(self._delta_ids)))
            self._delta_ids = []
        if self._stops.stopped or (self.constraint is not None and self.constraint.done):
            return self._end("stop", pieces), False
        stop = "length" if len(self.generated) >= self.params.max_new_tokens else interrupt()
        if stop:
            return self._end(stop, pieces), False
        return pieces, True

    @property
    def last_by_length(self) -> bool:
        """Whether the next token taken will be the answer's last by ``max_new_tokens``."""
        return len(self.generated) + 1 >= self.params.max_new_tokens

    def end(self, reason: str) -> list[tuple[str, tuple[int, ...]]]:
        """The answer ends before the next token could be fed (``kv_pool_exhausted``): the held-back text."""
        return self._end(reason, [])

    def _end(self, reason: str, pieces: list[tuple[str, tuple[int, ...]]]) -> list[tuple[str, tuple[int, ...]]]:
        self.reason = reason
        if not self._stops.stopped:
            tail = self._stops.push(self._detok.flush()) + self._stops.flush()
            if tail:
                self.text_parts.append(tail)
                pieces.append((tail, tuple(self._delta_ids)))
        return pieces
