"""The node's worker: the one thread that computes (every engine call but ``cancel`` and the read-only ones).

Why: generation takes seconds, so ROS callbacks only enqueue work (prompts in the
:class:`~.request_queue.RequestQueue`, engine changes and session resets here) or flag a cancellation.
The worker thread takes the prompts (the channels in turn), at most one per channel (a channel's answers
never interleave on its topics) and at most ``Engine.max_batch`` at once, and advances their answers in
turn, one event each: each answer's next event comes from the engine's batched step, so they decode
together. Engine changes are applied once no answer runs (``Engine.reconfigure`` waits for running
requests; new prompts wait meanwhile). Each answer goes out through its channel's :class:`Outputs`.
``Engine.cancel`` is the only engine call made from a ROS callback (it is thread-safe).

More in docs/modules.md, ``orin_vlm_node/ros/worker.py``.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from ..engine import Engine
from ..engine.description import backend_summary
from ..engine.events import Event, Finished, Request, TextDelta, Turn
from ..engine.grounding import Detection, detections
from .image import PickedFrames
from .request_queue import PendingPrompt, RequestQueue
from .status import request_note

log = logging.getLogger("orin_vlm_node.ros")

CANCELLED_BEFORE_START = "cancelled by ~/cancel before it started"  # a waiting prompt's dropped note
_UNSENDABLE = re.compile("[\x00\ud800-\udfff]")

T = TypeVar("T")


def on_passing_thread(fn: Callable[[], T]) -> T:
    """``fn()`` on a thread that ends when it returns (its result or its exception), so the OpenMP pool its
    torch work created ends too (module docstring): the model loads there, not on the long-lived thread
    that called (the main thread, a ROS callback). The caller waits, interruptibly by a signal."""
    outcome: list = []

    def target() -> None:
        try:
            outcome.append((True, fn()))
        except BaseException as exc:  # handed to the caller, whatever it is
            outcome.append((False, exc))

    thread = threading.Thread(target=target, name="orin_vlm_load", daemon=True)
    thread.start()
    thread.join()
    ok, value = outcome[0]
    if not ok:
        raise value
    return value


def wire_text(text: str) -> str:
    """Text as a ``std_msgs/String`` can carry it: NUL (where the wire cuts a string) and what UTF-8 cannot
    encode (lone surrogates) become U+FFFD. Applied to every delta and to the response alike, character by
    character, so the joined ``tokens`` stay equal to ``response``."""
    return _UNSENDABLE.sub("\ufffd", text)


class Outputs(Protocol):
    """Where the worker's results go (the node's publishers)."""

    def tokens(self, text: str) -> None: ...

    def end_tokens(self) -> None:
        """The answer's deltas are all pushed: publish what is pending before its response or error."""
        ...

    def response(self, text: str) -> None: ...

    def status(self, event: str, request_id: str | None, **fields: Any) -> None: ...

    def detections(
        self, request_id: str, labels: Sequence[str], found: Sequence[Detection], frames: PickedFrames
    ) -> None:
        """A detection request's objects, in the pixels of their frames."""
        ...


@dataclass
class WorkerState:
    """What diagnostics read: the running requests (channel -> request id), the last request's metrics, how
    many completed (per channel)."""

    running: dict[str, str]
    last_metrics: dict[str, float]
    completed: dict[str, int]


class Worker:
    """Runs queued prompts through the engine and applies engine changes between them."""

    def __init__(
        self,
        engine: Engine,
        queue: RequestQueue,
        outputs: Mapping[str, Outputs],
        applied: Mapping[str, Any],
        revert: Callable[[Mapping[str, Any]], None],
        session_id: Callable[[str], str | None],
    ) -> None:
        self.engine = engine
        self.queue = queue
        self.outputs = dict(outputs)  # channel -> where its answers go; node-wide events go to every channel
        self._revert = revert  # puts parameters back to the values the engine really runs
        self._session_id = session_id  # a channel's conversation a prompt joins when it starts (None: none kept)
        self._lock = threading.Lock()
        self._applied = dict(applied)  # engine settings in effect
        self._pending: dict[str, Any] = {}
        self._resets: list[str] = []
        self._running: dict[str, PendingPrompt] = {}  # channel -> its prompt being answered
        self._cancelled: set[str] = set()
        self._last_metrics: dict[str, float] = {}
        self._completed = dict.fromkeys(self.outputs, 0)
        self._stopping = threading.Event()
        self._stop_reason = ""
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Serve the queue on a thread of its own; again after :meth:`stop` (a managed node re-activated).
        Changes queued meanwhile are applied before the first prompt."""
        if self._thread is not None and self._thread.is_alive():
            raise RuntimeError("the worker is already running")
        self._stopping.clear()
        self._thread = threading.Thread(target=self._loop, name="orin_vlm_worker", daemon=True)
        self._thread.start()

    # -- called from ROS callbacks ------------------------------------------------------------------
    def pending_changes(self) -> dict[str, Any]:
        with self._lock:
            return dict(self._pending)

    def queue_changes(self, engine_changes: Mapping[str, Any], reset_sessions: Sequence[str] = ()) -> None:
        """Engine settings (validated already) and sessions to forget, applied before the next prompt."""
        with self._lock:
            self._pending.update(engine_changes)
            self._resets += reset_sessions
        self.queue.wake()

    def cancel(self, channel: str) -> tuple[list[str], int]:
        """``~/cancel`` of ``channel``: drop its waiting prompts, then cancel its running one; (the ids cancelled,
        how many were dropped). The queue goes first: a running prompt cancelled first ends at once, and this
        thread could take the next waiting one before the drain (its ``dropped`` after the ``finished``)."""
        waiting = self.queue.drain(channel)
        for item in waiting:
            self.drop(item, CANCELLED_BEFORE_START)
        return self.cancel_running(channel), len(waiting)

    def cancel_running(self, channel: str | None = None) -> list[str]:
        """Cancel the running prompts (of ``channel`` only, when given); their ids."""
        with self._lock:
            items = [item for ch, item in self._running.items() if channel is None or ch == channel]
            self._cancelled.update(item.request_id for item in items)
        for item in items:
            self.engine.cancel(item.request_id)
        return [item.request_id for item in items]

    def state(self) -> WorkerState:
        with self._lock:
            running = {ch: item.request_id for ch, item in self._running.items()}
            return WorkerState(running, dict(self._last_metrics), dict(self._completed))

    def stop(self, timeout_s: float, why: str) -> None:
        """End every prompt with its terminal event: the waiting ones ``dropped`` (``why``), the running ones
        cancelled (they end with ``finished``, reason ``cancelled``); wait up to ``timeout_s`` for that, and
        report it ourselves (``error``) for each that does not stop in time."""
        self._stop_reason = why
        self._stopping.set()
        for item in self.queue.drain():
            self.drop(item, why)
        self.cancel_running()
        self.queue.wake()
        if self._thread is not None:
            self._thread.join(timeout=timeout_s)
        for item in self.queue.drain():  # accepted by a callback that ran while the worker stopped
            self.drop(item, why)
        with self._lock:
            abandoned = list(self._running.values())
        for item in abandoned:
            error = f"{why}: the request did not stop within {timeout_s:g} s and was abandoned"
            self.outputs[item.channel].status("error", item.request_id, finish_reason="error", error=error)

    def drop(self, item: PendingPrompt, why: str) -> None:
        """End a prompt that never started: its ``dropped`` event, saying ``why``."""
        self.outputs[item.channel].status("dropped", item.request_id, note=why, **item.status_fields())

    def _broadcast(self, event: str, **fields: Any) -> None:
        """A node-wide event (not about one prompt) on every channel's status."""
        for outputs in self.outputs.values():
            outputs.status(event, None, **fields)

    # -- the thread ---------------------------------------------------------------------------------
    def _loop(self) -> None:
        """Take prompts while the batch has room, then advance every running answer by one event, in turn;
        engine changes once no answer runs (the engine applies them only between requests)."""
        answers: dict[str, _Answer] = {}  # channel -> its answer under way
        while answers or not self._stopping.is_set():
            if not answers:
                self._apply_pending()
            while len(answers) < self.engine.max_batch and not self._stopping.is_set():
                item = self.queue.get(timeout=0.0 if answers else 0.5, skip=set(answers), held=self._changes_waiting)
                if item is None:
                    break
                if self._stopping.is_set():  # taken just as the node began to stop
                    self.drop(item, self._stop_reason)
                    break
                answer = self._begin(item)
                if answer is not None:
                    answers[item.channel] = answer
            for channel, answer in list(answers.items()):
                if self._advance(answer):
                    del answers[channel]
                    self._end(answer)

    def _begin(self, item: PendingPrompt) -> _Answer | None:
        """Start answering ``item`` (its ``started`` event); None when it ends before (cancelled meanwhile)."""
        with self._lock:
            cancelled = item.request_id in self._cancelled
        if cancelled:
            self.drop(item, CANCELLED_BEFORE_START)
            return None
        outputs = self.outputs[item.channel]
        request = Request(
            turn=Turn(text=item.text, images=item.frames.images, videos=item.videos.videos),
            sampling=item.sampling,
            system_prompt=item.system_prompt,
            session_id=self._session_id(item.channel),
            request_id=item.request_id,
            output=item.output,
            token_probs=bool(item.detect),  # a detection's scores
        )
        with self._lock:
            self._running[item.channel] = item
        outputs.status("started", item.request_id, **item.status_fields())
        return _Answer(item, outputs, self.engine.generate(request), time.monotonic() - item.accepted_at)

    def _advance(self, answer: _Answer) -> bool:
        """The answer's next event (the engine runs a step when it has none waiting); True when it ended. A
        failure costs this request, never the node."""
        try:
            event = next(answer.events, None)
            if event is None:
                raise RuntimeError("engine stream ended without a Finished event")
            if not answer.cancel_sent and (answer.item.request_id in self._cancelled or self._stopping.is_set()):
                # ~/cancel (or a stop) may have come before the engine knew this id: repeat it now that it does.
                self.engine.cancel(answer.item.request_id)
                answer.cancel_sent = True
            if isinstance(event, TextDelta):
                if event.text:
                    answer.outputs.tokens(wire_text(event.text))
                return False
            if isinstance(event, Finished):
                answer.finished = event
            return answer.finished is not None
        except Exception as exc:
            log.exception("request %s failed", answer.item.request_id)
            answer.error = f"internal error: {exc!r}"
            return True  # _end closes the stream: the engine cancels the request and frees its KV

    def _end(self, answer: _Answer) -> None:
        """The answer's response and terminal event, its channel free again."""
        item, outputs = answer.item, answer.outputs
        try:
            outputs.end_tokens()
            self._report(answer)
        except Exception as exc:
            log.exception("request %s failed", item.request_id)
            outputs.status("error", item.request_id, finish_reason="error", error=f"internal error: {exc!r}")
        finally:
            try:  # ended or failed: the engine forgets the request (and cancels one cut short) now, not at GC
                answer.events.close()
            except Exception as exc:
                log.error("request %s: closing its stream failed: %r", item.request_id, exc)
            with self._lock:
                del self._running[item.channel]
                self._cancelled.discard(item.request_id)
            self.queue.wake()  # its channel may be served again

    def _changes_waiting(self) -> bool:
        """Engine changes or session resets are queued: no prompt starts before they are applied."""
        with self._lock:
            return bool(self._pending or self._resets)

    def _apply_pending(self) -> None:
        """Engine changes between requests: session resets, then reconfiguration."""
        with self._lock:
            resets, self._resets = self._resets, []
            pending, self._pending = self._pending, {}
        for session_id in resets:
            try:
                self.engine.reset(session_id)
            except Exception as exc:
                log.warning("reset of session %s failed: %r", session_id, exc)
        changes = {k: v for k, v in pending.items() if self._applied.get(k) != v}
        if not changes:
            return
        try:
            self.engine.reconfigure(**changes)
        except Exception as exc:
            error = f"reconfigure {changes} failed, parameters reverted: {exc}"
            log.error("%s", error)
            self._broadcast("error", error=error, changes=changes)
            self._revert({k: self._applied[k] for k in changes if k in self._applied})
            return
        self._applied.update(changes)
        self._broadcast("reconfigured", changes=changes, note=backend_summary(self.engine.describe()))

    def _report(self, answer: _Answer) -> None:
        item, outputs, finished = answer.item, answer.outputs, answer.finished
        if finished is None:
            outputs.status("error", item.request_id, finish_reason="error", error=answer.error)
            return
        metrics = {**finished.metrics, "queue_wait_s": answer.queue_wait_s}
        with self._lock:
            self._last_metrics = metrics
            self._completed[item.channel] += 1
        if finished.finish_reason == "error":
            outputs.status("error", item.request_id, finish_reason="error",
                           error=finished.error or "generation failed", metrics=metrics,
                           note=request_note(metrics, item.note), **item.status_fields())  # fmt: skip
            return
        if item.detect and not self._publish_detections(answer):
            return
        outputs.response(wire_text(finished.text))
        stopped = self._stopping.is_set() and finished.finish_reason == "cancelled"
        note = request_note(metrics, self._stop_reason if stopped else item.note)
        outputs.status("finished", item.request_id, finish_reason=finished.finish_reason, error=finished.error,
                       metrics=metrics, note=note, output=finished.output, **item.status_fields())  # fmt: skip

    def _publish_detections(self, answer: _Answer) -> bool:
        """A detection request's objects published; False (an error event, nothing published) when its answer
        is not the grounding JSON (cut by max_new_tokens, cancelled)."""
        item, finished = answer.item, answer.finished
        sizes = [image.shape[:2] for image in item.frames.images]
        try:
            found = detections(finished.text, finished.token_probs or (), finished.token_spans or (), sizes)
        except ValueError as exc:
            answer.outputs.status("error", item.request_id, finish_reason="error", metrics=finished.metrics,
                                  error=f"detection answer unusable ({finished.finish_reason}): {exc}",
                                  **item.status_fields())  # fmt: skip
            return False
        answer.outputs.detections(item.request_id, item.detect, found, item.frames)
        return True


@dataclass(eq=False)
class _Answer:
    """A prompt being answered: its engine stream and what came of it so far."""

    item: PendingPrompt
    outputs: Outputs
    events: Iterator[Event]
    queue_wait_s: float
    cancel_sent: bool = False
    finished: Finished | None = None
    error: str = ""  # why it ended without a Finished event
