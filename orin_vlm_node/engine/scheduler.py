"""Continuous batching: the requests of several callers decode together, one token each per step.

A decode step reads every weight once whatever its rows, so on a bandwidth-bound Jetson four sequences
cost little more than one. There is no thread of its own: each caller of ``Engine.generate`` consumes its
stream (:meth:`Scheduler.stream`), and one with nothing to read takes the step token and runs a step for
everybody: admit waiting requests up to ``max_batch`` (a conversation's turns never overlap), one prefill
piece of the oldest request prefilling, one batched decode step. Where the decode step overlaps (CUDA) the
host reads token N while the device computes N+1. When the pool runs out the most recently admitted request
holding KV of its turn is preempted and later recomputes it. ``exclusive()`` is how reconfiguration and
resets wait. docs/architecture.md ("The scheduler") has the rules and why.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

from ..kvcache import PoolExhausted
from .events import Event, Finished
from .member import Member
from .sampled_tokens import SampledTokens

if TYPE_CHECKING:
    from .cancellation import Cancellations
    from .decode_step import DecodeStep
    from .parts import EngineParts
    from .request import RequestRun

log = logging.getLogger("orin_vlm_node.engine")


class Scheduler:
    """Waiting and running requests of one engine, and the step that advances them (module docstring)."""

    def __init__(
        self, parts: EngineParts, cancellations: Cancellations, on_finished: Callable[[RequestRun], None]
    ) -> None:
        self._parts = parts  # what an admitted request runs on (swapped by ``use`` while nothing runs)
        self._cancellations = cancellations
        self._on_finished = on_finished  # the engine's bookkeeping of a finished request
        self._cond = threading.Condition()  # guards everything below and every member's events and phase
        self._waiting: deque[Member] = deque()
        self._running: list[Member] = []  # admission order: oldest first
        self._stepping = False  # the step token is held (by a caller running a step, or by exclusive())
        self._paused = 0  # exclusive() calls waiting: admit nothing new
        self._arrivals = 0  # requests submitted so far
        self._finished = 0  # requests finished so far
        self._sampled: SampledTokens[Member] | None = None  # overlap: tokens of the last step, not yet read

    def stream(self, run: RequestRun) -> Iterator[Event]:
        """Submit ``run``; its events as the steps produce them, ending with its ``Finished``. Closing the
        stream early cancels the request (it still ends, and its KV is settled, at the next step)."""
        with self._cond:
            member = Member(run, self._arrivals)
            self._arrivals += 1
            self._waiting.append(member)
        try:
            while True:
                events = self._take_events_or_step_token(member)
                if events is None:
                    self._step_and_release()
                    continue
                yield from events
                if member.done and not events:
                    return
        finally:
            if not member.done:  # the caller closed the stream: cancel, and step until the run is settled
                self._cancellations.cancel(run.rid)
                with self._cond:
                    if member.phase == "waiting" and not member.preempted:  # nothing to settle yet
                        self._waiting.remove(member)
                        member.phase = "done"
                while not member.done:
                    if self._take_events_or_step_token(member, discard=True) is None:
                        self._step_and_release()

    def use(self, parts: EngineParts) -> None:
        """Run the requests admitted from now on with ``parts`` (called inside :meth:`exclusive`)."""
        self._parts = parts

    @contextmanager
    def if_idle(self) -> Iterator[bool]:
        """Whether the engine is idle (no request admitted, no step running); while True, it stays so."""
        with self._cond:
            idle = not self._stepping and not self._active()
            if idle:
                self._stepping = True
        try:
            yield idle
        finally:
            if idle:
                self._release()

    @contextmanager
    def exclusive(self) -> Iterator[None]:
        """Hold the engine alone: wait until no request runs (admitting none meanwhile) and no step runs."""
        with self._cond:
            self._paused += 1
            try:
                self._cond.wait_for(lambda: not self._stepping and not self._active())
                self._stepping = True
            finally:
                self._paused -= 1
        try:
            yield
        finally:
            self._release()

    def sessions_in_use(self, ignore: RequestRun | None = None) -> set[str]:
        """Ids of the sessions whose requests run or wait (``ignore``: one that is finishing): not idle, so
        never evicted to make room."""
        with self._cond:
            members = [*self._running, *self._waiting]
        return {m.run.request.session_id for m in members if m.run.request.session_id and m.run is not ignore}

    def _active(self) -> bool:
        """Whether a request is under way: running, or waiting after a preemption (caller holds the lock)."""
        return bool(self._running) or any(m.preempted for m in self._waiting)

    # -- the step token ------------------------------------------------------------------------------
    def _take_events_or_step_token(self, member: Member, discard: bool = False) -> list[Event] | None:
        """The member's unread events (empty once it is done and all were read), or None when the caller
        now holds the step token and must run a step."""
        with self._cond:
            while True:
                if member.events or member.done:
                    events = list(member.events)
                    member.events.clear()
                    return [] if discard else events
                if not self._stepping:
                    self._stepping = True
                    return None
                self._cond.wait()

    def _step_and_release(self) -> None:
        try:
            self._step()
        finally:
            self._release()

    def _release(self) -> None:
        with self._cond:
            self._stepping = False
            self._cond.notify_all()

    # -- one step ------------------------------------------------------------------------------------
    def _step(self) -> None:
        self._admit()
        prefilling = [m for m in self._running if m.phase == "prefill"]
        if prefilling:
            self._prefill_piece(prefilling[0])
        decoding = [m for m in self._running if m.phase == "decode"]
        if decoding:
            self._decode(decoding)

    def _admit(self) -> None:
        with self._cond:
            if not self._waiting:
                return
            limit = self._parts.config.max_batch
            busy = {m.run.request.session_id for m in self._running if m.run.request.session_id}
            for member in list(self._waiting):
                if len(self._running) >= limit:
                    break
                if member.preempted:
                    # Its memory is still taken until a request finishes, and nothing goes ahead of it;
                    # a cancelled one goes at once (it only ends).
                    if self._finished <= member.readmit_after and not self._cancellations.is_cancelled(member.run.rid):
                        break
                elif self._paused:  # exclusive() waits: finish what is under way, start nothing new
                    continue
                session = member.run.request.session_id
                if session and session in busy:
                    continue
                busy.add(session)
                self._waiting.remove(member)
                member.phase = "prefill"
                member.run.admit(self._parts, self.sessions_in_use)
                self._running.append(member)

    def _prefill_piece(self, member: Member) -> None:
        run = member.run
        while True:
            try:
                logits = run.advance_prefill()
            except PoolExhausted as exc:
                if self._make_room(member, exc) == "retry":
                    continue
                return
            except Exception as exc:  # noqa: BLE001 - any failure ends the request as an event, never the engine
                self._finish(member, *run.outcome(exc))
                return
            break
        if logits is not None:
            self._accept(member, logits)

    def _decode(self, members: list[Member]) -> None:
        """Feed every member's pending token in one step, then sample each member's next token from its row.

        A pending token is on the host (``member.token``: after a prefill, or without overlap) or, with
        overlap, still on the device in :attr:`_sampled`, the tokens sampled from the previous step: those
        are staged as they are, this step is launched, and only then are they read (:meth:`_settle`), so
        the host streams token N while the device computes N+1. A member whose token turns out to end its
        answer had its row computed for nothing; its reserved slot is released when it finishes.
        """
        step = self._parts.decode_step
        sampled, self._sampled = self._sampled, None
        fed, complete = self._stage(step, members, sampled)
        if not complete:  # staging needs the tokens read first (the pool ran out): take the rows back, read them
            for member in fed:
                member.run.unstage()
            step.discard()
            sampled.staged.clear()
            self._settle(sampled)
            self._decode([m for m in self._running if m.phase == "decode"])
            return
        if not fed:
            if sampled is not None:
                self._settle(sampled)
            return
        try:
            logits = step.run()  # (B, vocab), launched
        except Exception as exc:  # noqa: BLE001 - the batch's forward failed: every member of it ends
            for member in fed:
                self._finish(member, *member.run.outcome(exc))
            if sampled is not None:
                self._settle(sampled)
            return
        if sampled is not None:
            self._settle(sampled)  # the previous step's tokens, read while this step runs
        rows = []
        for row, member in enumerate(fed):
            if member.done:  # its token (read just now) ended the answer
                continue
            if member.token is not None:  # a host token: it is in the session once it went through
                member.run.fed(member.token)
                member.token = None
            member.run.metrics.batch_size = max(member.run.metrics.batch_size, len(fed))
            rows.append((member, logits[row : row + 1]))
        chosen = self._sample(rows)
        if chosen is not None and step.overlap:
            self._sampled = chosen
        elif chosen is not None:
            self._settle(chosen)

    def _stage(
        self, step: DecodeStep, members: list[Member], sampled: SampledTokens | None
    ) -> tuple[list[Member], bool]:
        """Stage the members' pending tokens; the members staged, in row order, and whether staging went
        through. It stops when staging fails while ``sampled`` tokens are unread: who may be preempted, and
        what a failed member's answer was, depend on them, so the caller reads them and stages again."""
        fed: list[Member] = []
        for member in members:
            while member.phase == "decode":  # a younger member's preemption may have taken it out
                token = member.token
                if token is None:  # its token is on the device, unread
                    if not member.run.may_stage_unread:
                        break  # reading it will end the answer
                    token = sampled.row(member)
                try:
                    member.run.stage(step, token)
                except PoolExhausted as exc:
                    if sampled is not None:
                        return fed, False
                    if self._make_room(member, exc) == "retry":
                        continue
                except Exception as exc:  # noqa: BLE001
                    if sampled is not None:
                        return fed, False
                    self._finish(member, *member.run.outcome(exc))
                else:
                    fed.append(member)
                    if member.token is None:
                        sampled.staged.add(member)
                break
        return fed, True

    def _make_room(self, member: Member, exc: PoolExhausted) -> str:
        """``member`` needs KV the pool does not have: preempt the most recently admitted request holding
        KV of its turn. "retry" when that was another one; "preempted" when it was ``member`` itself;
        "exhausted" when nobody else holds any, so the request cannot fit and has ended. Tokens sampled on
        the device and not yet read are read first ("retry"): answers they end free their KV, and a
        preempted request must know every token it generated."""
        if self._sampled is not None:
            sampled, self._sampled = self._sampled, None
            self._settle(sampled)
            return "retry"
        holders = [m for m in self._running if m is member or m.run.holds_turn_kv]
        victim = holders[-1]
        if victim is not member:
            self._preempt(victim)
            return "retry"
        if len(holders) > 1:
            self._preempt(member)
            return "preempted"
        if member.run.loop is not None:  # it had answered: the text held back goes out
            log.warning("request %s: %s", member.run.rid, exc)
            self._emit(member, member.run.end_early("kv_pool_exhausted"))
            self._finish(member, "kv_pool_exhausted", None)
        else:
            self._finish(member, *member.run.outcome(exc))
        return "exhausted"

    def _preempt(self, member: Member) -> None:
        freed = member.run.preempt()
        log.info("KV pool full: request %s preempted (%d tokens freed, recomputed when it runs again)",
                 member.run.rid, freed)  # fmt: skip
        with self._cond:
            self._running.remove(member)
            member.phase, member.readmit_after = "waiting", self._finished
            at = next((i for i, m in enumerate(self._waiting) if m.arrival > member.arrival), len(self._waiting))
            self._waiting.insert(at, member)

    def _accept(self, member: Member, logits) -> None:  # logits (1, vocab) of a prefill
        chosen = self._sample([(member, logits)])
        if chosen is not None:
            self._settle(chosen)

    def _sample(self, rows: list[tuple[Member, object]]) -> SampledTokens | None:
        """Launch the choice of each member's next token from its (1, vocab) logits; None when none is left
        (a member whose sampling fails ends with the error)."""
        members, tokens = [], []
        for member, logits in rows:
            try:
                tokens.append(member.run.sample(logits))
            except Exception as exc:  # noqa: BLE001
                self._finish(member, *member.run.outcome(exc))
            else:
                members.append(member)
        return SampledTokens(members, tokens) if members else None

    def _settle(self, sampled: SampledTokens) -> None:
        """Read sampled tokens on the host; each member streams its token's text and goes on or finishes. A
        token already staged (overlap) is in the session from now on; any other is the member's next to
        feed."""
        try:
            tokens = sampled.read()
        except Exception as exc:  # noqa: BLE001 - the device work that chose them failed
            for member in sampled.members:
                if not member.done:
                    self._finish(member, *member.run.outcome(exc))
            return
        for member, token in zip(sampled.members, tokens, strict=True):
            if member.done:
                continue
            run, staged = member.run, member in sampled.staged
            try:
                deltas, go_on = run.take(token, staged)
            except Exception as exc:  # noqa: BLE001
                self._finish(member, *run.outcome(exc))
                continue
            self._emit(member, deltas)
            if not go_on:
                self._finish(member, run.loop.reason, None)
            elif staged:
                run.fed(token)
            else:
                member.phase, member.token = "decode", token

    def _emit(self, member: Member, events: list) -> None:
        if events:
            with self._cond:
                member.events.extend(events)
                self._cond.notify_all()

    def _finish(self, member: Member, reason: str, error: str | None) -> None:
        run = member.run
        finished: Finished = run.finish(reason, error)
        run.finished = finished
        self._on_finished(run)
        with self._cond:
            self._running.remove(member)
            self._finished += 1
            member.events.append(finished)
            member.phase = "done"
            self._cond.notify_all()
