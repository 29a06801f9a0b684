"""The node's worker thread without ROS: text fit for the wire, and a stop that ends every prompt with exactly
one terminal event (dropped for the waiting ones, finished/cancelled for the running one)."""

from __future__ import annotations

import threading
import time
from typing import Any

from orin_vlm_node.engine.events import Finished, SamplingParams, TextDelta
from orin_vlm_node.ros.request_queue import PendingPrompt, RequestQueue
from orin_vlm_node.ros.worker import Worker, on_passing_thread, wire_text

TERMINAL = {"finished", "dropped", "error"}


class Recorder:
    """The worker's Outputs, kept in lists."""

    def __init__(self) -> None:
        self.deltas: list[str] = []
        self.responses: list[str] = []
        self.events: list[dict[str, Any]] = []
        self.lock = threading.Lock()

    def tokens(self, text: str) -> None:
        self.deltas.append(text)

    def end_tokens(self) -> None:
        pass

    def response(self, text: str) -> None:
        self.responses.append(text)

    def status(self, event: str, request_id: str | None, **fields: Any) -> None:
        with self.lock:
            self.events.append({"event": event, "request_id": request_id, **fields})


class ScriptedEngine:
    """Streams ``pieces`` (then the rest of an endless answer when ``endless``) until cancelled."""

    def __init__(
        self, pieces: list[str], endless: bool = False, ignores_cancel: bool = False, max_batch: int = 1
    ) -> None:
        self.pieces, self.endless, self.ignores_cancel = pieces, endless, ignores_cancel
        self.max_batch = max_batch
        self.cancelled: set[str] = set()
        self.started = threading.Event()
        self.running: set[str] = set()
        self.log: list[tuple[str, str, int]] = []  # (what, request or session id, thread ident), in order

    def reset(self, session_id: str) -> None:
        self.log.append(("reset", session_id, threading.get_ident()))

    def cancel(self, request_id: str) -> None:
        self.cancelled.add(request_id)

    def generate(self, request: Any):
        self.started.set()
        self.running.add(request.request_id)
        text = ""
        for piece in self.pieces:
            text += piece
            self.log.append(("delta", request.request_id, threading.get_ident()))
            yield TextDelta(request.request_id, piece, ())
        while self.endless and (self.ignores_cancel or request.request_id not in self.cancelled):
            time.sleep(0.01)
            text += "x"
            yield TextDelta(request.request_id, "x", ())
        reason = "cancelled" if request.request_id in self.cancelled else "stop"
        self.log.append(("finished", request.request_id, threading.get_ident()))
        yield Finished(request.request_id, reason, text, (), {"generated_tokens": len(text)})


def prompt(n: int, channel: str = "") -> PendingPrompt:
    return PendingPrompt(
        request_id=f"{channel}req-{n}", text=f"q {n}", sampling=SamplingParams(), system_prompt=None, channel=channel
    )


def start(engine: ScriptedEngine, queue: RequestQueue, outputs: Recorder | dict[str, Recorder]) -> Worker:
    channels = outputs if isinstance(outputs, dict) else {"": outputs}
    worker = Worker(engine, queue, channels, {}, lambda _applied: None, lambda _channel: None)  # type: ignore[arg-type]
    worker.start()
    return worker


def answer_one(worker: Worker, queue: RequestQueue, outputs: Recorder, item: PendingPrompt) -> None:
    """Queue ``item``, wait for its answer, stop the worker."""
    try:
        queue.put(item)
        wait_until(lambda: any(e["event"] == "finished" for e in outputs.events))
    finally:
        worker.stop(2.0, "test over")


def wait_until(predicate, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_wire_text_replaces_what_a_ros_string_cannot_carry():
    assert wire_text("a\x00b\ud800c") == "a\ufffdb\ufffdc"
    assert wire_text("plain 文字 ✓") == "plain 文字 ✓"


def test_an_answer_with_nul_characters_streams_tokens_that_add_up_to_the_response():
    outputs, queue = Recorder(), RequestQueue(4)
    answer_one(start(ScriptedEngine(["a\x00", "b", "\x00c"]), queue, outputs), queue, outputs, prompt(1))
    assert outputs.responses == ["a\ufffdb\ufffdc"]
    assert "".join(outputs.deltas) == outputs.responses[0]


def test_stop_ends_every_prompt_with_one_terminal_event():
    outputs, queue = Recorder(), RequestQueue(10)
    engine = ScriptedEngine(["start "], endless=True)
    worker = start(engine, queue, outputs)
    for n in range(4):
        queue.put(prompt(n))
    engine.started.wait(10)
    worker.stop(5.0, "node shutting down (SIGTERM received)")
    ends = [e for e in outputs.events if e["event"] in TERMINAL]
    assert sorted(e["request_id"] for e in ends) == [f"req-{n}" for n in range(4)]
    running = next(e for e in ends if e["request_id"] == "req-0")
    assert running["event"] == "finished" and running["finish_reason"] == "cancelled"
    assert running["note"] == "node shutting down (SIGTERM received)"
    assert all(e["event"] == "dropped" and "SIGTERM" in e["note"] for e in ends if e["request_id"] != "req-0")


def test_a_request_that_does_not_stop_in_time_is_reported_when_the_worker_gives_up():
    outputs, queue = Recorder(), RequestQueue(4)
    engine = ScriptedEngine([], endless=True, ignores_cancel=True)
    worker = start(engine, queue, outputs)
    queue.put(prompt(1))
    engine.started.wait(10)
    worker.stop(0.3, "node shutting down (SIGINT received)")
    (end,) = [e for e in outputs.events if e["event"] in TERMINAL]
    assert end["event"] == "error" and end["request_id"] == "req-1" and "did not stop within 0.3 s" in end["error"]
    engine.ignores_cancel = False  # let the daemon thread finish


def test_a_stopped_worker_starts_again_and_serves_the_next_prompts():
    """A managed node deactivated and activated again: the same worker, a new thread, answers as before."""
    outputs, queue = Recorder(), RequestQueue(4)
    worker = start(ScriptedEngine(["hello"]), queue, outputs)
    worker.stop(2.0, "node deactivated")
    worker.start()
    answer_one(worker, queue, outputs, prompt(7))
    assert outputs.responses == ["hello"]
    assert [e["event"] for e in outputs.events] == ["started", "finished"]


def test_channels_answer_side_by_side_one_prompt_each_and_cancel_only_their_own():
    outputs = {"arm": Recorder(), "nav": Recorder()}
    queue, engine = RequestQueue(4), ScriptedEngine(["go "], endless=True, max_batch=2)
    worker = start(engine, queue, outputs)
    try:
        for prompt_ in (prompt(1, "arm"), prompt(2, "arm"), prompt(3, "nav")):
            queue.put(prompt_)
        wait_until(lambda: engine.running == {"armreq-1", "navreq-3"})  # one per channel, both at once
        assert sorted(worker.state().running.items()) == [("arm", "armreq-1"), ("nav", "navreq-3")]
        assert queue.waiting("arm") == 1, "arm's second prompt waits for its first answer"
        assert worker.cancel_running("nav") == ["navreq-3"]
        wait_until(lambda: any(e["event"] == "finished" for e in outputs["nav"].events))
        assert "armreq-1" not in engine.cancelled
    finally:
        worker.stop(5.0, "test over")
    arm_ends = [e for e in outputs["arm"].events if e["event"] in TERMINAL]
    assert {e["request_id"]: e["event"] for e in arm_ends} == {"armreq-1": "finished", "armreq-2": "dropped"}
    assert not [e for e in outputs["nav"].events if e["request_id"] and e["request_id"].startswith("arm")]


def test_cancel_drops_the_channels_waiting_prompts_before_it_cancels_the_running_one():
    """``~/cancel``: each waiting prompt of the channel ends ``dropped`` and never starts, even though the
    cancelled answer ends at once and frees the worker for the next prompt; other channels keep theirs."""
    outputs = {"arm": Recorder(), "nav": Recorder()}
    queue, engine = RequestQueue(8), ScriptedEngine(["go "], endless=True, max_batch=2)
    worker = start(engine, queue, outputs)
    try:
        for prompt_ in (prompt(1, "arm"), prompt(2, "arm"), prompt(3, "arm"), prompt(4, "nav"), prompt(5, "nav")):
            queue.put(prompt_)
        wait_until(lambda: engine.running == {"armreq-1", "navreq-4"})
        assert worker.cancel("arm") == (["armreq-1"], 2)
        wait_until(lambda: any(e["event"] == "finished" for e in outputs["arm"].events))
        assert queue.waiting("nav") == 1
    finally:
        worker.stop(5.0, "test over")
    arm = [(e["event"], e["request_id"]) for e in outputs["arm"].events if e["request_id"]]
    assert arm == [
        ("started", "armreq-1"),
        ("dropped", "armreq-2"),
        ("dropped", "armreq-3"),
        ("finished", "armreq-1"),
    ]
    assert {e["note"] for e in outputs["arm"].events if e["event"] == "dropped"} == {
        "cancelled by ~/cancel before it started"
    }
    assert engine.running == {"armreq-1", "navreq-4"}, "no dropped prompt started; nav's second one waited"


def test_the_answers_of_a_batch_advance_in_turn_on_the_worker_thread_alone():
    """One computing thread (torch's OpenMP pools, worker.py): both channels' answers are advanced by the
    worker thread, one event each in turn, so they decode together."""
    outputs = {"arm": Recorder(), "nav": Recorder()}
    queue, engine = RequestQueue(4), ScriptedEngine(["a", "b", "c"], max_batch=2)
    queue.put(prompt(1, "arm"))
    queue.put(prompt(2, "nav"))
    worker = start(engine, queue, outputs)
    try:
        wait_until(lambda: all(any(e["event"] == "finished" for e in r.events) for r in outputs.values()))
    finally:
        worker.stop(2.0, "test over")
    (ident,) = {ident for _, _, ident in engine.log}  # one thread for both answers
    assert ident != threading.get_ident()
    order = [rid for what, rid, _ in engine.log if what == "delta"]
    assert order == ["armreq-1", "navreq-2"] * 3, "the answers interleave, one event each"
    assert [r.responses for r in outputs.values()] == [["abc"], ["abc"]]


def test_engine_changes_wait_for_the_running_answer_and_hold_back_new_prompts():
    """A session reset queued while an answer runs is applied once it ended, before the next prompt starts
    (the engine applies changes only between requests; waiting for them on the one thread would stall)."""
    outputs, queue = Recorder(), RequestQueue(4)
    engine = ScriptedEngine(["go "], endless=True)
    worker = start(engine, queue, outputs)
    try:
        queue.put(prompt(1))
        wait_until(lambda: "req-1" in engine.running)
        worker.queue_changes({}, reset_sessions=["old-session"])
        queue.put(prompt(2))
        time.sleep(0.7)  # longer than the worker's idle wait: nothing is applied or started meanwhile
        assert "req-2" not in engine.running and not [w for w, *_ in engine.log if w == "reset"]
        worker.cancel_running()
        wait_until(lambda: "req-2" in engine.running)
        worker.cancel_running()
        wait_until(lambda: [e["request_id"] for e in outputs.events if e["event"] == "finished"] == ["req-1", "req-2"])
    finally:
        worker.stop(2.0, "test over")
    steps = [(what, rid) for what, rid, _ in engine.log if what != "delta"]
    assert steps == [("finished", "req-1"), ("reset", "old-session"), ("finished", "req-2")]


def test_on_passing_thread_returns_or_raises_what_the_function_did_on_a_thread_that_ended():
    threads: list[threading.Thread] = []

    def work() -> int:
        threads.append(threading.current_thread())
        return 42

    assert on_passing_thread(work) == 42
    assert threads[0] is not threading.current_thread() and not threads[0].is_alive()

    def fail() -> None:
        raise ValueError("no model here")

    try:
        on_passing_thread(fail)
    except ValueError as exc:
        assert str(exc) == "no model here"
    else:
        raise AssertionError("the exception was not handed to the caller")
