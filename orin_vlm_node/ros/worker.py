"""The node's worker: the one caller of the engine's mutating methods (generate, reconfigure, reset).

Why: generation takes seconds, so ROS callbacks only enqueue work (prompts in the
:class:`~.request_queue.RequestQueue`, engine changes and session resets here) or flag a cancellation.
The worker thread takes the prompts (the channels in turn) and runs each on a thread of its own, at most
one per channel (a channel's answers never interleave on its topics) and at most ``Engine.max_batch`` at
once: those decode together in the engine's batch. Engine changes are applied between requests
(``Engine.reconfigure`` waits for the running ones). Each answer goes out through its channel's
:class:`Outputs`. ``Engine.cancel`` is the only engine call made from a ROS callback (it is thread-safe).

No rclpy import: the node passes its publishing functions in.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from ..engine import Engine
from ..engine.events import Finished, Request, TextDelta, Turn
from .request_queue import PendingPrompt, RequestQueue
from .status import backend_summary, request_note

log = logging.getLogger("orin_vlm_node.ros")

_UNSENDABLE = re.compile("[\x00\ud800-\udfff]")


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
        self._runners: list[threading.Thread] = []
        self._slot_free = threading.Condition(self._lock)  # a running prompt ended
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
            self._drop(item, why)
        self.cancel_running()
        self.queue.wake()
        deadline = time.monotonic() + timeout_s
        if self._thread is not None:
            self._thread.join(timeout=timeout_s)
        with self._lock:
            runners = list(self._runners)
        for runner in runners:
            runner.join(timeout=max(0.0, deadline - time.monotonic()))
        for item in self.queue.drain():  # accepted by a callback that ran while the worker stopped
            self._drop(item, why)
        with self._lock:
            abandoned = list(self._running.values())
        for item in abandoned:
            error = f"{why}: the request did not stop within {timeout_s:g} s and was abandoned"
            self.outputs[item.channel].status("error", item.request_id, finish_reason="error", error=error)

    def _drop(self, item: PendingPrompt, why: str) -> None:
        self.outputs[item.channel].status("dropped", item.request_id, note=why, **item.image_fields())

    def _broadcast(self, event: str, **fields: Any) -> None:
        """A node-wide event (not about one prompt) on every channel's status."""
        for outputs in self.outputs.values():
            outputs.status(event, None, **fields)

    # -- the thread ---------------------------------------------------------------------------------
    def _loop(self) -> None:
        while not self._stopping.is_set():
            self._apply_pending()
            with self._lock:
                busy = set(self._running)
                if len(busy) >= self.engine.max_batch:  # every slot taken: wait for one to end
                    self._slot_free.wait(timeout=0.5)
                    continue
            item = self.queue.get(timeout=0.5, skip=busy)
            if item is None:
                continue
            if self._stopping.is_set():  # taken just as the node began to stop
                self._drop(item, self._stop_reason)
                continue
            self._apply_pending()
            with self._lock:
                self._running[item.channel] = item
                self._runners = [r for r in self._runners if r.is_alive()]
                runner = threading.Thread(target=self._serve, args=(item,), name=f"orin_vlm_{item.request_id}",
                                          daemon=True)  # fmt: skip
                self._runners.append(runner)
            runner.start()

    def _serve(self, item: PendingPrompt) -> None:
        """One prompt on its own thread, start to terminal event."""
        try:
            self._run(item)
        except Exception as exc:  # a bug must cost one request, never the node
            log.error("request %s failed: %r", item.request_id, exc)
            error = f"internal error: {exc!r}"
            self.outputs[item.channel].status("error", item.request_id, finish_reason="error", error=error)
        finally:
            with self._lock:
                del self._running[item.channel]
                self._cancelled.discard(item.request_id)
                self._slot_free.notify_all()
            self.queue.wake()  # its channel may be served again

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
        log.info("reconfigured: %s", changes)
        self._broadcast("reconfigured", changes=changes, note=backend_summary(self.engine.describe()))

    def _run(self, item: PendingPrompt) -> None:
        with self._lock:
            cancelled = item.request_id in self._cancelled
        if cancelled:
            self._drop(item, "cancelled by ~/cancel before it started")
            return
        queue_wait = time.monotonic() - item.accepted_at
        outputs = self.outputs[item.channel]
        outputs.status("started", item.request_id, **item.image_fields())
        try:
            finished = self._generate(item, outputs)
        finally:
            outputs.end_tokens()
        metrics = {**finished.metrics, "queue_wait_s": queue_wait}
        with self._lock:
            self._last_metrics = metrics
            self._completed[item.channel] += 1
        if finished.finish_reason == "error":
            outputs.status("error", item.request_id, finish_reason="error",
                           error=finished.error or "generation failed", metrics=metrics,
                           note=request_note(metrics, item.note), **item.image_fields())  # fmt: skip
            return
        outputs.response(wire_text(finished.text))
        stopped = self._stopping.is_set() and finished.finish_reason == "cancelled"
        note = request_note(metrics, self._stop_reason if stopped else item.note)
        outputs.status("finished", item.request_id, finish_reason=finished.finish_reason, error=finished.error,
                       metrics=metrics, note=note, **item.image_fields())  # fmt: skip

    def _generate(self, item: PendingPrompt, outputs: Outputs) -> Finished:
        request = Request(
            turn=Turn(text=item.text, images=item.frames.images),
            sampling=item.sampling,
            system_prompt=item.system_prompt,
            session_id=self._session_id(item.channel),
            request_id=item.request_id,
        )
        finished: Finished | None = None
        cancel_sent = False
        for event in self.engine.generate(request):
            if not cancel_sent and item.request_id in self._cancelled:
                # ~/cancel may have come before the engine knew this id: repeat it now that it does.
                self.engine.cancel(item.request_id)
                cancel_sent = True
            if isinstance(event, TextDelta):
                if event.text:
                    outputs.tokens(wire_text(event.text))
            elif isinstance(event, Finished):
                finished = event
        if finished is None:
            raise RuntimeError("engine stream ended without a Finished event")
        return finished
