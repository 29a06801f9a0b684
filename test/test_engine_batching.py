"""Continuous batching: requests that decode together give each the tokens it gets alone.

Requests are batched by consuming their streams in turn from one thread (each ``next`` may run one
scheduler step for everybody), which makes the interleaving deterministic; one test uses real threads.
The reference is the same engine serving each request alone (fp32 on the CPU, greedy).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from orin_vlm_node.engine import Engine, EngineConfig, Finished, Request, SamplingParams, TextDelta, Turn
from support.checkpoints import cached_tiny_checkpoint

torch.set_num_threads(1)


def _image(h: int, w: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)


def _greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_new_tokens=n, ignore_eos=True, **kw)


# Mixed lengths, an image, a stop string: (request, tokens it may produce).
MIXED = [
    Request(Turn("Describe the scene."), _greedy(24)),
    Request(Turn("What is on the table?", (_image(64, 96, 1),)), _greedy(9)),
    Request(Turn("Count the boxes. " * 12), _greedy(17)),
    Request(Turn("Where is the robot?"), _greedy(30)),
]


@pytest.fixture(scope="module")
def engine():
    return Engine(EngineConfig(model_path=str(cached_tiny_checkpoint()), device="cpu", prefill_chunk_tokens=16))


def _copy(request: Request, **changes) -> Request:
    fields = {"turn": request.turn, "sampling": request.sampling, "session_id": request.session_id} | changes
    return Request(**fields)


def _alone(engine: Engine, request: Request) -> Finished:
    final = list(engine.generate(_copy(request)))[-1]
    assert isinstance(final, Finished), final
    return final


def _together(streams: list[Iterator], on_event=None) -> list[tuple[list[TextDelta], Finished]]:
    """Consume the streams in turn, one event each, until every one has finished."""
    deltas: list[list[TextDelta]] = [[] for _ in streams]
    finals: list[Finished | None] = [None] * len(streams)
    while any(f is None for f in finals):
        for i, stream in enumerate(streams):
            if finals[i] is not None:
                continue
            event = next(stream)
            if on_event is not None:
                on_event(i, event)
            if isinstance(event, Finished):
                finals[i] = event
            else:
                deltas[i].append(event)
    return list(zip(deltas, finals, strict=True))


def test_a_batch_gives_every_request_its_tokens_alone(engine):
    alone = [_alone(engine, r) for r in MIXED]
    results = _together([engine.generate(_copy(r)) for r in MIXED])
    for (deltas, final), reference in zip(results, alone, strict=True):
        assert final.finish_reason == reference.finish_reason == "length"
        assert final.token_ids == reference.token_ids
        assert final.text == reference.text == "".join(d.text for d in deltas)
    assert max(final.metrics["batch_size"] for _, final in results) == 4  # they did decode together
    assert engine.describe()["kv_blocks_used"] == 0  # nothing kept: every sequence was released


def test_stop_strings_and_eos_end_one_member_and_the_rest_go_on(engine):
    free = _alone(engine, Request(Turn("Say something."), SamplingParams(temperature=0.0, max_new_tokens=20)))
    stop = free.text[len(free.text) // 2 :][:3] or free.text  # a string the greedy answer will reach
    requests = [
        Request(Turn("Say something."), SamplingParams(temperature=0.0, max_new_tokens=20, stop=(stop,))),
        MIXED[0],
        MIXED[3],
    ]
    alone = [_alone(engine, r) for r in requests]
    results = _together([engine.generate(_copy(r)) for r in requests])
    assert results[0][1].finish_reason == "stop" and stop not in results[0][1].text
    for (_, final), reference in zip(results, alone, strict=True):
        assert (final.finish_reason, final.token_ids, final.text) == (
            reference.finish_reason,
            reference.token_ids,
            reference.text,
        )


def test_cancelling_one_member_leaves_the_others_unchanged(engine):
    alone = [_alone(engine, r) for r in MIXED[:3]]
    ids = ["keep-a", "cancel-me", "keep-b"]
    streams = [engine.generate(_copy(r, request_id=i)) for r, i in zip(MIXED[:3], ids, strict=True)]

    def on_event(i: int, event) -> None:
        if i == 1 and isinstance(event, TextDelta) and len(event.token_ids) and event.text:
            engine.cancel("cancel-me")

    results = _together(streams, on_event)
    assert results[1][1].finish_reason == "cancelled" and len(results[1][1].token_ids) < 9
    for i in (0, 2):
        assert results[i][1].token_ids == alone[i].token_ids
    assert engine.describe()["kv_blocks_used"] == 0


def test_closing_a_stream_mid_batch_frees_it_and_the_others_finish(engine):
    alone = _alone(engine, MIXED[0])
    closed, kept = engine.generate(_copy(MIXED[3])), engine.generate(_copy(MIXED[0]))
    next(closed), next(kept), next(closed)
    closed.close()  # the caller went away: its request is cancelled and its KV settled
    rest = list(kept)
    assert rest[-1].token_ids == alone.token_ids
    assert engine.describe()["kv_blocks_used"] == 0


def test_max_batch_bounds_the_batch_and_the_rest_wait_their_turn(engine):
    engine.reconfigure(max_batch=2)
    try:
        alone = [_alone(engine, r) for r in MIXED[:3]]
        results = _together([engine.generate(_copy(r)) for r in MIXED[:3]])
        assert [final.token_ids for _, final in results] == [a.token_ids for a in alone]
        assert max(final.metrics["batch_size"] for _, final in results) == 2
    finally:
        engine.reconfigure(max_batch=4)


def test_turns_of_one_conversation_never_overlap(engine):
    first, second = Request(Turn("Hello."), _greedy(6)), Request(Turn("And then?"), _greedy(6))
    sequential = [_alone(engine, _copy(r, session_id="seq")) for r in (first, second)]
    conversation = engine.session_token_ids("seq")  # read now: the engine keeps one session (max_sessions=1)
    results = _together([engine.generate(_copy(r, session_id="conv")) for r in (first, second)])
    assert [final.token_ids for _, final in results] == [f.token_ids for f in sequential]
    assert engine.session_token_ids("conv") == conversation
    engine.reset()


def test_threads_batch_and_reconfigure_waits_for_them(engine):
    alone = [_alone(engine, r) for r in MIXED]
    finals: dict[int, Finished] = {}
    started = threading.Barrier(len(MIXED) + 1)

    def ask(i: int) -> None:
        stream = engine.generate(_copy(MIXED[i]))
        started.wait()
        finals[i] = list(stream)[-1]

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(MIXED))]
    for t in threads:
        t.start()
    started.wait()
    engine.reconfigure(prefill_chunk_tokens=32)  # waits for whatever was admitted, then applies
    for t in threads:
        t.join(timeout=120)
    try:
        assert sorted(finals) == list(range(len(MIXED)))
        assert [finals[i].token_ids for i in range(len(MIXED))] == [a.token_ids for a in alone]
    finally:
        engine.reconfigure(prefill_chunk_tokens=16)


def test_a_member_that_cannot_get_kv_ends_alone_with_pool_exhausted(tmp_path):
    # 12 blocks of 16 tokens: enough for one long answer, not for three at once.
    small = Engine(
        EngineConfig(model_path=str(cached_tiny_checkpoint()), device="cpu", kv_pool_blocks=12, page_size=16,
                     max_context_tokens=160, prefix_caching=False)
    )  # fmt: skip
    requests = [Request(Turn(f"Tell a long story number {i}."), _greedy(120)) for i in range(3)]
    alone = [_alone(small, r) for r in requests]
    assert all(a.finish_reason == "length" for a in alone)
    results = _together([small.generate(_copy(r)) for r in requests])
    reasons = [final.finish_reason for _, final in results]
    assert "kv_pool_exhausted" in reasons and "length" in reasons
    for (_, final), reference in zip(results, alone, strict=True):
        # Whatever a member produced before it ran out is what it produces alone.
        assert final.token_ids == reference.token_ids[: len(final.token_ids)]
    assert small.describe()["kv_blocks_used"] == 0
