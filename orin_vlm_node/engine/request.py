"""One request from start to ``Finished``: prepare the turn, take a KV sequence, prefill, decode, settle.

The scheduler (:mod:`.scheduler`) drives it phase by phase, on the engine's model, KV cache, session
store and decode step, interleaved with the other requests of the batch: :meth:`RequestRun.advance_prefill`
one prompt piece at a time, then per token :meth:`~RequestRun.accept` (sample, stream, decide),
:meth:`~RequestRun.stage` (reserve the KV slot in the batched decode step) and :meth:`~RequestRun.fed`.
Whatever way it ends -- finished, cancelled, an exception, the consumer closing the stream --
:meth:`RequestRun.settle` leaves the KV as the session invariants say (:mod:`.session`): a kept session
holds its whole conversation, a turn that never reached prefill is undone, everything else is released.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch

from ..kvcache import PoolExhausted
from .decode_loop import DecodeLoop
from .events import Finished, Request, TextDelta
from .images import encode_needed
from .metrics import RequestMetrics, peak_memory_mb, reset_peak_memory
from .prompt import PreparedTurn
from .sampling import ResolvedSampling, resolve_sampling
from .session import Session, SessionSnapshot

if TYPE_CHECKING:
    from ..model.vision import VisionFeatures
    from .decode_step import DecodeStep
    from .engine import Engine

log = logging.getLogger("orin_vlm_node.engine")


class _Cancelled(Exception):
    """The request was cancelled before its prefill finished."""


class RequestRun:
    """The state of one running request and the steps it goes through."""

    def __init__(self, engine: Engine, request: Request):
        self.engine = engine
        self.request = request
        self.rid: str = request.request_id or ""
        self.config = engine.config
        self.metrics = RequestMetrics()
        self.session: Session | None = None  # the continuing one; after prefill the turn's (throwaway without an id)
        self.seq: int | None = None
        self.snapshot: SessionSnapshot | None = None  # a continuing session before this turn
        self.prefill_done = False
        self.loop: DecodeLoop | None = None
        self.finished: Finished | None = None
        self._pieces: Iterator[tuple[torch.Tensor, bool]] | None = None  # the prefill, piece by piece
        self._turn: PreparedTurn | None = None
        self._hit = 0  # prompt tokens served from the cache
        self._params: ResolvedSampling | None = None

    @property
    def generated(self) -> list[int]:
        return self.loop.generated if self.loop is not None else []

    @property
    def text(self) -> str:
        return self.loop.text if self.loop is not None else ""

    # -- the phases the scheduler drives ------------------------------------------------------------
    def advance_prefill(self) -> torch.Tensor | None:
        """One piece of the prefill (the first call also prepares the turn and takes the KV sequence);
        (1, vocab) logits of the last prompt token once the whole prompt is in, else None."""
        if self._pieces is None:
            reset_peak_memory(self.engine.device)
            self._pieces = self._start()
        logits, done = next(self._pieces)
        if not done:
            return None
        e = self.engine
        self.metrics.prefill_tokens = len(self._turn.new_ids) - self._hit
        self.metrics.mark_prefill_done()
        self.prefill_done = True
        self.session = self._commit_turn(self._turn)
        self.loop = DecodeLoop(self._params, e.tokenizer, self.session.token_ids, logits.device, self.metrics)
        return logits

    def accept(self, logits: torch.Tensor) -> tuple[list[TextDelta], int | None]:
        """The logits of the last position fed: the text to stream and the token to feed next (None: the
        answer ended, :attr:`loop` ``.reason`` says why)."""
        e, seq, limit = self.engine, self.seq, self.config.max_context_tokens

        def interrupt() -> str | None:
            if e.cache.length(seq) + 1 > limit:
                return "length"
            return "cancelled" if e.is_cancelled(self.rid) else None

        pieces, token = self.loop.accept(logits, interrupt)
        return [TextDelta(self.rid, text, ids) for text, ids in pieces], token

    def stage(self, step: DecodeStep, token: int) -> None:
        """Stage ``token`` in the decode step (its KV slot reserved; idle sessions evicted for room). May raise
        PoolExhausted before any change."""
        self.with_eviction(lambda: step.prepare(self.seq, token, self.session.rope_delta))

    def fed(self, token: int) -> None:
        """``token`` went through the model: the session holds it."""
        self.session.append([token], [None])

    def end_early(self, reason: str) -> list[TextDelta]:
        """The answer ends before its next token could be fed (the pool is exhausted): the held-back text."""
        return [TextDelta(self.rid, text, ids) for text, ids in self.loop.end(reason)]

    def outcome(self, exc: BaseException) -> tuple[str, str | None]:
        """(finish reason, error) of a request that raised ``exc``."""
        if isinstance(exc, _Cancelled):
            return "cancelled", None
        if isinstance(exc, PoolExhausted):
            log.warning("request %s: %s", self.rid, exc)
            return "kv_pool_exhausted", None
        if isinstance(exc, ValueError):  # bad input (a ProcessingError or ContextLimitExceeded among them)
            return "error", str(exc)
        log.error("request %s failed", self.rid, exc_info=exc)
        return "error", f"{type(exc).__name__}: {exc}"

    def _start(self) -> Iterator[tuple[torch.Tensor, bool]]:
        """Prepare the turn, take a KV sequence, encode the images not cached, then prefill piece by piece."""
        e, request = self.engine, self.request
        self._params = resolve_sampling(e.generation_defaults, self.config.sampling, request.sampling)
        session = self.session = e.session_store.get(request.session_id)
        turn = self._turn = e.turns.prepare(
            request.turn,
            request.system_prompt,
            session,
            self.config.max_context_tokens,
            plain_text=not self.config.prompt_special_tokens,
        )
        self.metrics.prompt_tokens = turn.total_tokens
        self._check_cancelled()
        hit = self._hit = self._take_sequence(turn)
        self.metrics.prefix_hit_tokens = turn.history + hit
        self.metrics.mark_prefill_start()
        skip_pads = sum(1 for t in turn.new_ids[:hit] if t == e.tokenizer.special.image_pad)
        vision = encode_needed(e.model, turn.images, skip_pads, e.vision_cache) if turn.images is not None else None
        yield from self._prefill(turn, hit, vision)

    def _prefill(
        self, turn: PreparedTurn, hit: int, vision: VisionFeatures | None
    ) -> Iterator[tuple[torch.Tensor, bool]]:
        """Tokens ``hit:`` of the turn into the KV cache, ``prefill_chunk_tokens`` at a time (each piece
        attends to everything before it, so the result is the one-piece prefill's): each piece's logits, and
        whether it was the last.

        Why pieces: the torch attention of a piece of L tokens over T slots holds an L x T score matrix per
        head, which for a long prompt in one piece would be gigabytes; and between two pieces the other
        requests of the batch decode a token, so a long prompt does not stall their answers. A cancel is
        honoured between pieces.
        """
        e = self.engine
        ids, pad = turn.new_ids, e.tokenizer.special.image_pad
        size = self.config.prefill_chunk_tokens or len(ids)
        vision_row = 0  # feature rows of the image pads before the current piece
        if hit >= len(ids):
            raise RuntimeError("prefill of an empty turn")
        for start in range(hit, len(ids), size):
            self._check_cancelled()
            stop = min(start + size, len(ids))
            pads = sum(1 for t in ids[start:stop] if t == pad)
            rows = vision.rows(vision_row, vision_row + pads) if vision is not None and pads else None
            vision_row += pads
            attn = self.with_eviction(lambda n=stop - start: e.cache.step(self.seq, n))
            chunk = torch.tensor(ids[start:stop], dtype=torch.long, device=e.device)
            logits = e.model.forward(chunk, turn.positions[:, start:stop].to(e.device), attn, vision=rows)
            yield logits, stop == len(ids)

    def _check_cancelled(self) -> None:
        if self.engine.is_cancelled(self.rid):
            raise _Cancelled()

    def _take_sequence(self, turn: PreparedTurn) -> int:
        """The session's sequence (snapshot first), or a new one with a cached prefix; tokens served from cache."""
        cache = self.engine.cache
        if self.session is not None:
            self.seq = self.session.seq
            self.snapshot = self.session.snapshot(cache.length(self.seq))
            return 0
        self.seq = self.with_eviction(cache.new_sequence)
        return cache.attach_prefix(self.seq, turn.new_ids, turn.extra_keys) if self._prefix_caching else 0

    def _commit_turn(self, turn: PreparedTurn) -> Session:
        """After prefill the sequence holds the turn: the session (a new one if needed) says so."""
        session, request = self.session, self.request
        if session is None:
            session = Session(session_id=request.session_id or "", seq=self.seq)
            if request.session_id:
                self.engine.session_store.keep(session)
        session.append(turn.new_ids, turn.extra_keys)
        session.pending_ids = []
        session.rope_delta = turn.next_position - len(session.token_ids)
        session.messages, session.answer = turn.messages, ""
        session.turns += 1
        if self._prefix_caching:
            self.engine.cache.register_prefix(self.seq, session.token_ids, session.extra_keys)
        return session

    def finish(self, reason: str, error: str | None) -> Finished:
        """Metrics, what the KV keeps, the Finished event. A cleanup failure clears the cache (never a leak)."""
        e, m = self.engine, self.metrics
        m.generated_tokens = len(self.generated)
        m.mark_end()
        try:
            m.blocks_in_use = len(e.cache.block_table(self.seq)) if self.seq is not None else 0
            self.settle(reason)
            e.session_store.trim()
        except Exception as exc:  # noqa: BLE001
            log.exception("request %s: cleanup failed; clearing the KV cache", self.rid)
            e.session_store.forget_all()
            e.cache.clear()
            if error is None:
                reason, error = "error", f"cleanup failed: {exc}"
        m.peak_memory_mb = peak_memory_mb(e.device)
        generated = tuple(self.generated)
        return Finished(self.rid, reason, self.text, generated, m.as_dict(), error)  # type: ignore[arg-type]

    def settle(self, reason: str) -> None:
        """Decide what the KV keeps after the request (see Session for the invariants)."""
        e, seq, session = self.engine, self.seq, self.session
        if seq is None:
            return
        kept = e.session_store.kept(session)
        if not self.prefill_done:
            if self.snapshot is not None and kept:
                session.restore(self.snapshot, e.cache)  # the turn never happened
            else:
                e.cache.release(seq)
        elif not kept:
            e.cache.release(seq)
        elif reason in ("error", "kv_pool_exhausted"):
            e.session_store.drop(session.session_id)  # its KV may be partial; free the blocks
        else:
            if e.cache.length(seq) > len(session.token_ids):  # unwritten reserved slots must not stay
                e.cache.truncate(seq, len(session.token_ids))
            last = self.generated[-1] if self.generated else None
            session.close_answer(last, self.text, e.tokenizer.eos_token_ids, e.tokenizer.special.im_end)
            if self._prefix_caching:
                e.cache.register_prefix(seq, session.token_ids, session.extra_keys)

    @property
    def _prefix_caching(self) -> bool:
        return self.config.prefix_caching and self.engine.cache.supports_prefix_caching

    def with_eviction(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn``; on PoolExhausted free the least recently used idle session (never this one) and retry."""
        while True:
            try:
                return fn()
            except PoolExhausted:
                if not self.engine.session_store.evict_one(keep=self.session):
                    raise
