"""One request from start to ``Finished``: prepare the turn, take a KV sequence, prefill, decode, settle.

Runs under the engine's lock (``Engine._serve``), on the engine's model, KV cache, session store and
decode step. Whatever way it ends -- finished, cancelled, an exception, the consumer closing the stream
-- :meth:`RequestRun.settle` leaves the KV as the session invariants say (:mod:`.session`): a kept
session holds its whole conversation, a turn that never reached prefill is undone, everything else is
released.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch

from ..kvcache import PoolExhausted
from .decode_loop import DecodeLoop
from .events import Event, Finished, Request, TextDelta
from .images import encode_needed
from .metrics import RequestMetrics, peak_memory_mb, reset_peak_memory
from .prompt import PreparedTurn
from .sampling import resolve_sampling
from .session import Session, SessionSnapshot

if TYPE_CHECKING:
    from ..model.vision import VisionFeatures
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

    @property
    def generated(self) -> list[int]:
        return self.loop.generated if self.loop is not None else []

    @property
    def text(self) -> str:
        return self.loop.text if self.loop is not None else ""

    def events(self) -> Iterator[Event]:
        """``TextDelta``s, then exactly one ``Finished`` (also kept in :attr:`finished`)."""
        reset_peak_memory(self.engine.device)
        reason, error = "error", None
        try:
            logits = self.start()
            for text, ids in self.decode(logits):
                yield TextDelta(self.rid, text, ids)
            reason = self.loop.reason
        except GeneratorExit:
            # The consumer closed the iterator mid-stream: no event can be sent, but the KV must be freed.
            self.settle("cancelled")
            raise
        except _Cancelled:
            reason = "cancelled"
        except PoolExhausted as exc:
            log.warning("request %s: %s", self.rid, exc)
            reason = "kv_pool_exhausted"
        except ValueError as exc:  # bad input (a ProcessingError or ContextLimitExceeded among them)
            reason, error = "error", str(exc)
        except Exception as exc:  # noqa: BLE001 - any failure must end as an event, never kill the node
            log.exception("request %s failed", self.rid)
            reason, error = "error", f"{type(exc).__name__}: {exc}"
        self.finished = self.finish(reason, error)
        yield self.finished

    def start(self) -> torch.Tensor:
        """Prepare the turn, take a KV sequence, prefill; (1, vocab) logits of the last prompt token."""
        e, request = self.engine, self.request
        params = resolve_sampling(e.generation_defaults, self.config.sampling, request.sampling)
        session = self.session = e.session_store.get(request.session_id)
        turn = e.turns.prepare(
            request.turn,
            request.system_prompt,
            session,
            self.config.max_context_tokens,
            plain_text=not self.config.prompt_special_tokens,
        )
        self.metrics.prompt_tokens = turn.total_tokens
        self._check_cancelled()
        hit = self._take_sequence(turn)
        self.metrics.prefix_hit_tokens = turn.history + hit
        self.metrics.mark_prefill_start()
        skip_pads = sum(1 for t in turn.new_ids[:hit] if t == e.tokenizer.special.image_pad)
        vision = encode_needed(e.model, turn.images, skip_pads, e.vision_cache) if turn.images is not None else None
        logits = self._prefill(turn, hit, vision)
        self.metrics.prefill_tokens = len(turn.new_ids) - hit
        self.metrics.mark_prefill_done()
        self.prefill_done = True
        self.session = self._commit_turn(turn)
        self.loop = DecodeLoop(params, e.tokenizer, self.session.token_ids, logits.device, self.metrics)
        return logits

    def _prefill(self, turn: PreparedTurn, hit: int, vision: VisionFeatures | None) -> torch.Tensor:
        """Tokens ``hit:`` of the turn into the KV cache, ``prefill_chunk_tokens`` at a time (each piece
        attends to everything before it, so the result is the one-piece prefill's); logits of the last.

        Why pieces: the torch attention of a piece of L tokens over T slots holds an L x T score matrix per
        head, which for a long prompt in one piece would be gigabytes. A cancel is honoured between pieces.
        """
        e = self.engine
        ids, pad = turn.new_ids, e.tokenizer.special.image_pad
        size = self.config.prefill_chunk_tokens or len(ids)
        vision_row = 0  # feature rows of the image pads before the current piece
        logits = None
        for start in range(hit, len(ids), size):
            self._check_cancelled()
            stop = min(start + size, len(ids))
            pads = sum(1 for t in ids[start:stop] if t == pad)
            rows = vision.rows(vision_row, vision_row + pads) if vision is not None and pads else None
            vision_row += pads
            attn = self.with_eviction(lambda n=stop - start: e.cache.step(self.seq, n))
            chunk = torch.tensor(ids[start:stop], dtype=torch.long, device=e.device)
            logits = e.model.forward(chunk, turn.positions[:, start:stop].to(e.device), attn, vision=rows)
        if logits is None:
            raise RuntimeError("prefill of an empty turn")
        return logits

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

    def decode(self, logits: torch.Tensor) -> Iterator[tuple[str, tuple[int, ...]]]:
        """The decode loop over the engine's decode step; the session holds every token fed back."""
        e, session, seq, limit = self.engine, self.session, self.seq, self.config.max_context_tokens

        def feed(token: int) -> torch.Tensor:
            step = e.decode_step
            self.with_eviction(lambda: step.prepare(seq, token, session.rope_delta))
            logits = step.run()
            session.append([token], [None])
            return logits

        def interrupt() -> str | None:
            if e.cache.length(seq) + 1 > limit:
                return "length"
            return "cancelled" if e.is_cancelled(self.rid) else None

        yield from self.loop.run(logits, feed, interrupt)

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
