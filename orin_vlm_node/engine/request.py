"""One request from start to ``Finished``: prepare the turn, take a KV sequence, prefill, decode, settle.

More in docs/modules.md, ``orin_vlm_node/engine/request.py``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from ..kvcache import PoolExhausted
from ..processing import token_spans
from .decode_loop import DecodeLoop
from .events import Finished, Request, TextDelta
from .images import encode_needed
from .metrics import RequestMetrics, peak_memory_mb, reset_peak_memory
from .output_format import Constraint
from .prompt import ConversationFull, PreparedTurn
from .sampling import ResolvedSampling, resolve_sampling
from .session import Session, SessionSnapshot

if TYPE_CHECKING:
    from ..model.vision import VisionFeatures
    from .cancellation import Cancellations
    from .config import EngineConfig
    from .decode_step import DecodeStep
    from .parts import EngineParts

log = logging.getLogger("orin_vlm_node.engine")


class _Cancelled(Exception):
    """The request was cancelled before its prefill finished."""


class _Prefill:
    """Tokens to compute into a sequence's KV from slot ``base + next``, ``prefill_chunk_tokens`` at a time.

    Why pieces: the torch attention of a piece of L tokens over T slots holds an L x T score matrix per
    head, which for a long prompt in one piece would be gigabytes; and between two pieces the other
    requests of the batch decode a token, so a long prompt does not stall their answers. Each piece
    attends to everything before it, so the result is the one-piece prefill's.
    """

    def __init__(
        self, ids: list[int], images: range, positions: torch.Tensor, vision: VisionFeatures | None, hit: int
    ) -> None:
        # the previous answer's last tokens, the turn's prompt, then (recomputing after a preemption) the
        # tokens generated since: only the image pads inside ``images`` (the prompt's) take image rows
        self.ids = ids
        self.images = images
        self.positions = positions  # (3, len(ids)) RoPE positions
        self.vision = vision  # features of the prompt's image pads from ``hit`` on
        self.next = hit  # the first token not in the KV
        self.computed = 0  # tokens pushed through the model
        self._vision_row = 0  # feature rows of the image pads before ``next``

    @property
    def done(self) -> bool:
        return self.next >= len(self.ids)

    def piece(self, run: RequestRun) -> torch.Tensor:
        """Compute the next piece; its logits. PoolExhausted before anything changed."""
        e = run.parts
        size = run.config.prefill_chunk_tokens or len(self.ids)
        start, stop = self.next, min(self.next + size, len(self.ids))
        visual = e.turns.visual_pads
        # A generated image-pad id is text: it never shares a piece with image rows (the model takes every
        # pad of a piece given vision rows for one); a piece only ends early where that can happen.
        first, end = self.images.start, self.images.stop
        if start < first < stop and any(t in visual for t in self.ids[start:first]):
            stop = first
        if start < end < stop:
            stop = end
        pads = sum(1 for t in self.ids[max(start, first) : min(stop, end)] if t in visual)
        rows = self.vision.rows(self._vision_row, self._vision_row + pads) if self.vision is not None and pads else None
        attn = run.with_eviction(lambda: e.cache.step(run.seq, stop - start))
        chunk = torch.tensor(self.ids[start:stop], dtype=torch.long, device=e.device)
        logits = e.model.forward(chunk, self.positions[:, start:stop].to(e.device), attn, vision=rows)
        self.next, self._vision_row, self.computed = stop, self._vision_row + pads, self.computed + stop - start
        return logits


class RequestRun:
    """The state of one running request and the steps it goes through."""

    def __init__(self, request: Request, cancellations: Cancellations):
        self.request = request
        self.rid: str = request.request_id or ""
        self._cancellations = cancellations
        self.parts: EngineParts | None = None  # what it runs on, from its admission (:meth:`admit`)
        self.config: EngineConfig | None = None
        self._sessions_in_use: Callable[..., set[str]] | None = None
        self.metrics = RequestMetrics()
        self.session: Session | None = None  # the continuing one; after prefill the turn's (throwaway without an id)
        self.seq: int | None = None
        self.snapshot: SessionSnapshot | None = None  # a continuing session before this turn
        self.prefill_done = False
        self.loop: DecodeLoop | None = None
        self.finished: Finished | None = None
        self._turn: PreparedTurn | None = None
        self._params: ResolvedSampling | None = None
        self._constraint: Constraint | None = None  # the output format's matcher, compiled when prepared
        self._prefill: _Prefill | None = None  # the tokens still to compute into the KV, piece by piece

    @property
    def generated(self) -> list[int]:
        return self.loop.generated if self.loop is not None else []

    @property
    def text(self) -> str:
        return self.loop.text if self.loop is not None else ""

    # -- the phases the scheduler drives ------------------------------------------------------------
    def admit(self, parts: EngineParts, sessions_in_use: Callable[..., set[str]]) -> None:
        """The request starts running on ``parts``; ``sessions_in_use(ignore=None)`` names the sessions whose
        requests run or wait (never evicted to make room)."""
        self.parts, self.config, self._sessions_in_use = parts, parts.config, sessions_in_use

    def advance_prefill(self) -> torch.Tensor | None:
        """One piece of the prefill (the first call also prepares the turn, takes the KV sequence and
        encodes the images not cached); (1, vocab) logits of the last token once all are in, else None.

        After a :meth:`preempt` the same pieces recompute what the turn had in the KV (prompt and the
        tokens generated so far, ending with the one sampled but not yet fed): those last logits are
        what the next decode step would have given. PoolExhausted leaves everything as it was, so the
        piece can be tried again once another request made room.
        """
        if self._turn is None:
            reset_peak_memory(self.parts.device)
            self._prepare()
        self._check_cancelled()
        if self._prefill is None:
            self._prefill = self._begin_prefill()
        prefill = self._prefill
        logits = prefill.piece(self)
        if not prefill.done:
            return None
        self._prefill = None
        if self.prefill_done:  # a recompute after preemption: the pending token is in the KV now
            self.fed(prefill.ids[-1])
            return logits
        e, turn = self.parts, self._turn
        self.metrics.prefill_tokens = prefill.computed
        self.metrics.mark_prefill_done()
        self.prefill_done = True
        self.session = self._commit_turn(turn)
        self.loop = DecodeLoop(
            self._params, e.tokenizer, self.session.token_ids, logits.device, self.metrics, self._constraint,
            self.request.token_probs,
        )  # fmt: skip
        return logits

    def sample(self, logits: torch.Tensor) -> torch.Tensor:
        """The next token chosen from the logits of the last position fed, as a () device tensor (launched,
        not read: :meth:`take` gets it once the host has)."""
        return self.loop.sample(logits)

    def take(self, token: int, staged: bool) -> tuple[list[TextDelta], bool]:
        """The token :meth:`sample` chose, read by the host: the text to stream and whether to feed it (False:
        the answer ended, :attr:`loop` ``.reason`` says why). ``staged``: it is in a decode step already
        (overlap), its KV slot reserved."""
        e, seq, limit = self.parts, self.seq, self.config.max_context_tokens

        def interrupt() -> str | None:
            if not staged and e.cache.length(seq) + 1 > limit:
                return "length"
            return "cancelled" if self._cancellations.is_cancelled(self.rid) else None

        pieces, go_on = self.loop.take(token, interrupt)
        return [TextDelta(self.rid, text, ids) for text, ids in pieces], go_on

    @property
    def may_stage_unread(self) -> bool:
        """Whether a token sampled but not yet read may go into the next decode step: not the answer's last
        by ``max_new_tokens`` and with a slot left under ``max_context_tokens`` (else :meth:`take` ends the
        answer with it, as it would have unstaged)."""
        return not self.loop.last_by_length and self.parts.cache.length(self.seq) + 1 <= self.config.max_context_tokens

    def stage(self, step: DecodeStep, token: int | torch.Tensor) -> None:
        """Stage ``token`` in the decode step (its KV slot reserved; idle sessions evicted for room). May raise
        PoolExhausted before any change."""
        self.with_eviction(lambda: step.prepare(self.seq, token, self.session.rope_delta))

    def unstage(self) -> None:
        """Release the KV slot :meth:`stage` reserved, for a step that is taken back before it runs."""
        cache = self.parts.cache
        cache.truncate(self.seq, cache.length(self.seq) - 1)

    def fed(self, token: int) -> None:
        """``token`` went through the model: the session holds it."""
        self.session.append([token], [None])

    def end_early(self, reason: str) -> list[TextDelta]:
        """The answer ends before its next token could be fed (the pool is exhausted): the held-back text."""
        return [TextDelta(self.rid, text, ids) for text, ids in self.loop.end(reason)]

    @property
    def holds_turn_kv(self) -> bool:
        """Whether the KV holds tokens of this turn (what :meth:`preempt` would free)."""
        return self.seq is not None and self.parts.cache.length(self.seq) > self._base

    def preempt(self) -> int:
        """Free the KV this turn added (its session's earlier turns stay); the tokens freed. The next
        :meth:`advance_prefill` starts recomputing them."""
        cache, freed = self.parts.cache, 0
        if self.seq is not None:
            freed = cache.length(self.seq) - self._base
            cache.truncate(self.seq, self._base)
        self._prefill = None
        self.metrics.preemptions += 1
        self.metrics.preempted_tokens += freed
        return freed

    @property
    def _base(self) -> int:
        """KV slots of the session's earlier turns: never freed by a preemption."""
        return self.snapshot.kv_length if self.snapshot is not None else 0

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

    def _prepare(self) -> None:
        """Sampling, session and the turn's tokens, positions and images (once per request)."""
        e, request = self.parts, self.request
        self._params = resolve_sampling(e.generation_defaults, self.config.sampling, request.sampling)
        if request.output is not None:  # an invalid format ends the request before any prefill
            self._constraint = e.grammars.compile(request.output)
        self.session = e.session_store.get(request.session_id)
        try:
            self._turn = self._prepare_turn(self.session)
        except ConversationFull as full:
            # The conversation starts over with this turn (when the turn fits alone; else its error, the
            # conversation kept): refusing every later prompt until someone calls reset would leave a robot
            # that talks in multi-turn mode unanswered once its conversation is long enough.
            self._turn = self._prepare_turn(None)
            log.info("request %s: %s; the conversation starts over with this prompt", self.rid, full)
            e.session_store.drop(self.session.session_id)  # the session is this request's alone while it runs
            self.session = None
            self.metrics.forgotten_tokens = full.history
        self.metrics.prompt_tokens = self._turn.total_tokens
        self.metrics.video_frames = sum(v.frames_used for v in self._turn.videos)
        self.metrics.video_tokens = sum(v.tokens for v in self._turn.videos)

    def _prepare_turn(self, session: Session | None) -> PreparedTurn:
        return self.parts.turns.prepare(
            self.request.turn,
            self.request.system_prompt,
            session,
            self.config.max_context_tokens,
            prompt_special_tokens=self.config.prompt_special_tokens,
        )

    def _begin_prefill(self) -> _Prefill:
        """What this turn must compute into the KV: the turn's tokens, and after a preemption the tokens
        generated since; the KV sequence (taken the first time), the cached prefix served, the images'
        features for the image tokens still to compute."""
        e, turn = self.parts, self._turn
        ids, extra, positions = list(turn.new_ids), list(turn.extra_keys), turn.positions
        if self.prefill_done:  # recompute after preemption: generated tokens are text, RoPE runs with the slot
            gen = self.generated
            start = self._base + len(ids)
            ids += gen
            extra += [None] * len(gen)
            text = torch.arange(start, start + len(gen), dtype=torch.long) + self.session.rope_delta
            positions = torch.cat([positions, text.expand(3, -1)], dim=1)
        first = self.seq is None
        if first and self.session is not None:  # a continuing conversation: its sequence, as it was
            self.seq = self.session.seq
            self.snapshot = self.session.snapshot(e.cache.length(self.seq))
        elif first:
            self.seq = self.with_eviction(e.cache.new_sequence)
        hit = 0
        if self._base == 0 and self._prefix_caching:
            hit = e.cache.attach_prefix(self.seq, ids, extra)
        if first:
            self.metrics.prefix_hit_tokens = turn.history + hit
            self.metrics.mark_prefill_start()
        vision = None
        if turn.images is not None:
            skip = sum(1 for t in ids[turn.text_before : min(hit, len(turn.new_ids))] if t in e.turns.visual_pads)
            vision = encode_needed(e.model, turn.images, skip, e.vision_cache)
        if hit >= len(ids):
            raise RuntimeError("prefill of an empty turn")
        return _Prefill(ids, range(turn.text_before, len(turn.new_ids)), positions, vision, hit)

    def _check_cancelled(self) -> None:
        if self._cancellations.is_cancelled(self.rid):
            raise _Cancelled()

    def _commit_turn(self, turn: PreparedTurn) -> Session:
        """After prefill the sequence holds the turn: the session (a new one if needed) says so."""
        session, request = self.session, self.request
        if session is None:
            session = Session(session_id=request.session_id or "", seq=self.seq)
            if request.session_id:
                self.parts.session_store.keep(session)
        session.append(turn.new_ids, turn.extra_keys)
        session.pending_ids = []
        session.rope_delta = turn.next_position - len(session.token_ids)
        session.messages, session.answer = turn.messages, ""
        session.turns += 1
        if self._prefix_caching:
            self.parts.cache.register_prefix(self.seq, session.token_ids, session.extra_keys)
        return session

    def finish(self, reason: str, error: str | None) -> Finished:
        """Metrics, what the KV keeps, the Finished event. A cleanup failure clears the cache (never a leak)."""
        e, m = self.parts, self.metrics
        m.generated_tokens = len(self.generated)
        m.mark_end()
        try:
            m.blocks_in_use = len(e.cache.block_table(self.seq)) if self.seq is not None else 0
            self.settle(reason)
            e.session_store.trim(busy=self._sessions_in_use(ignore=self))
        except Exception as exc:  # noqa: BLE001
            log.exception("request %s: cleanup failed; clearing the KV cache", self.rid)
            e.session_store.forget_all()
            e.cache.clear()
            if error is None:
                reason, error = "error", f"cleanup failed: {exc}"
        m.peak_memory_mb = peak_memory_mb(e.device)
        generated = tuple(self.generated)
        output = self._constraint.result(self.text) if self._constraint is not None and error is None else None
        probs = self.loop.token_probs() if self.loop is not None and error is None else None
        spans = token_spans(e.tokenizer, generated[: len(probs)]) if probs is not None else None
        return Finished(self.rid, reason, self.text, generated, m.as_dict(), error, output, probs, spans)  # type: ignore[arg-type]

    def settle(self, reason: str) -> None:
        """Decide what the KV keeps after the request (see Session for the invariants)."""
        e, seq, session = self.parts, self.seq, self.session
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
        elif e.cache.length(seq) < len(session.token_ids):  # ended while preempted: its turn is not all in the KV
            log.warning("request %s ended before its preempted turn was recomputed: the conversation "
                        "goes on from before this turn", self.rid)  # fmt: skip
            if self.snapshot is not None:
                session.restore(self.snapshot, e.cache)
            else:
                e.session_store.drop(session.session_id)
        else:
            if e.cache.length(seq) > len(session.token_ids):  # unwritten reserved slots must not stay
                e.cache.truncate(seq, len(session.token_ids))
            last = self.generated[-1] if self.generated else None
            session.close_answer(last, self.text, e.tokenizer.eos_token_ids, e.tokenizer.special.im_end)
            if self._prefix_caching:
                e.cache.register_prefix(seq, session.token_ids, session.extra_keys)

    @property
    def _prefix_caching(self) -> bool:
        return self.config.prefix_caching and self.parts.cache.supports_prefix_caching

    def with_eviction(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn``; on PoolExhausted free the least recently used idle session and retry (a session whose
        request runs or waits is not idle: this one's among them)."""
        while True:
            try:
                return fn()
            except PoolExhausted:
                if not self.parts.session_store.evict_one(busy=self._sessions_in_use()):
                    raise
