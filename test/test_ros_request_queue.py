"""The node's bounded prompt queue: FIFO order, drop-oldest overflow, shrinking, wake-ups, threads, and
channels taken in turn with a bound each."""

from __future__ import annotations

import threading
import time

import pytest

from orin_vlm_node.engine.events import SamplingParams
from orin_vlm_node.ros.request_queue import PendingPrompt, RequestQueue


def prompt(i: int, channel: str = "") -> PendingPrompt:
    return PendingPrompt(
        request_id=f"{channel}req-{i}", text=f"q{i}", sampling=SamplingParams(), system_prompt=None, channel=channel
    )


def ids(items: list[PendingPrompt]) -> list[str]:
    return [item.request_id for item in items]


def test_fifo_within_the_bound():
    q = RequestQueue(3)
    assert [q.put(prompt(i)) for i in range(3)] == [[], [], []]
    assert len(q) == 3
    assert ids([q.get(0.0) for _ in range(3)]) == ["req-0", "req-1", "req-2"]
    assert q.get(0.0) is None


def test_overflow_drops_the_oldest_waiting():
    q = RequestQueue(2)
    q.put(prompt(0))
    q.put(prompt(1))
    assert ids(q.put(prompt(2))) == ["req-0"]
    assert ids(q.put(prompt(3))) == ["req-1"]
    assert ids(q.drain()) == ["req-2", "req-3"]
    assert len(q) == 0


def test_shrinking_the_bound_drops_oldest_first():
    q = RequestQueue(5)
    for i in range(5):
        q.put(prompt(i))
    assert ids(q.set_max_size(2)) == ["req-0", "req-1", "req-2"]
    assert q.max_size == 2 and ids(q.drain()) == ["req-3", "req-4"]


@pytest.mark.parametrize("size", [0, -1])
def test_bound_must_be_positive(size):
    with pytest.raises(ValueError, match="max_queue must be >= 1"):
        RequestQueue(size)
    with pytest.raises(ValueError, match="max_queue must be >= 1"):
        RequestQueue(1).set_max_size(size)


def test_get_waits_for_put_from_another_thread():
    q = RequestQueue(1)
    timer = threading.Timer(0.05, lambda: q.put(prompt(7)))
    timer.start()
    got = q.get(timeout=5.0)
    timer.join()
    assert got is not None and got.request_id == "req-7"


def test_wake_interrupts_a_waiting_get():
    q = RequestQueue(1)
    timer = threading.Timer(0.05, q.wake)
    timer.start()
    t0 = time.monotonic()
    assert q.get(timeout=10.0) is None
    timer.join()
    assert time.monotonic() - t0 < 5.0


def test_concurrent_producers_lose_nothing_silently():
    """Every put item is either consumed or reported as dropped, exactly once."""
    q = RequestQueue(3)
    dropped: list[PendingPrompt] = []
    consumed: list[PendingPrompt] = []
    lock = threading.Lock()

    def produce(base: int) -> None:
        for i in range(50):
            out = q.put(prompt(base + i))
            with lock:
                dropped.extend(out)

    producers = [threading.Thread(target=produce, args=(k * 1000,)) for k in range(4)]
    stop = threading.Event()

    def consume() -> None:
        while not stop.is_set() or len(q):
            item = q.get(timeout=0.01)
            if item is not None:
                consumed.append(item)

    consumer = threading.Thread(target=consume)
    consumer.start()
    for t in producers:
        t.start()
    for t in producers:
        t.join()
    stop.set()
    consumer.join()
    all_ids = ids(dropped) + ids(consumed)
    assert len(all_ids) == 200 and len(set(all_ids)) == 200


def test_channels_are_served_in_turn_so_a_burst_does_not_starve_another():
    q = RequestQueue(4)
    for i in range(3):
        q.put(prompt(i, "arm"))
    q.put(prompt(3, "nav"))
    q.put(prompt(4, "ui"))
    assert len(q) == 5 and q.waiting("arm") == 3 and q.waiting("nav") == 1
    assert ids([q.get(0.0) for _ in range(5)]) == ["armreq-0", "navreq-3", "uireq-4", "armreq-1", "armreq-2"]
    # A channel that just had its turn goes behind the others that are waiting.
    q.put(prompt(5, "arm"))
    q.put(prompt(6, "nav"))
    assert ids([q.get(0.0), q.get(0.0)]) == ["navreq-6", "armreq-5"]


def test_each_channel_has_its_own_bound_and_drain():
    q = RequestQueue(2)
    q.put(prompt(0, "nav"))
    assert [ids(q.put(prompt(i, "arm"))) for i in range(1, 5)] == [[], [], ["armreq-1"], ["armreq-2"]]
    assert q.waiting("nav") == 1, "arm's burst never drops nav's prompt"
    assert ids(q.drain("arm")) == ["armreq-3", "armreq-4"]
    assert ids(q.drain()) == ["navreq-0"]


def test_a_held_queue_keeps_its_items_until_released():
    """The worker holds prompts back while engine changes wait: a prompt put after them stays queued."""
    q = RequestQueue(4)
    q.put(prompt(1))
    assert q.get(timeout=0.0, held=lambda: True) is None
    assert len(q) == 1
    assert ids([q.get(timeout=0.0, held=lambda: False)]) == ["req-1"]
