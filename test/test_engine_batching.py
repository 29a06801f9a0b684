"""Continuous batching: requests that decode together give each the tokens it gets alone.

Requests are batched by consuming their streams in turn from one thread (each ``next`` may run one
scheduler step for everybody), which makes the interleaving deterministic; one test uses real threads.
The reference is the same engine serving each request alone (fp32 on the CPU, greedy). Every test runs
twice: with the CPU's decode step, and with the static step overlapping as on a GPU (the scheduler stages
the device tokens of step N and reads them after launching step N+1).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from orin_vlm_node.cuda import CudaPagedAttention
from orin_vlm_node.engine import Engine, EngineConfig, Finished, Request, SamplingParams, TextDelta, Turn
from orin_vlm_node.engine.assemble import MAX_BATCH
from orin_vlm_node.engine.decode_step import StaticDecodeStep
from support.checkpoints import cached_tiny_checkpoint

torch.set_num_threads(1)


def _image(h: int, w: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)


def _greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_new_tokens=n, ignore_eos=True, **kw)


# Mixed lengths, an image, a stop string: (request, tokens it may produce).
MIXED = [
    Request(Turn("Describe the scene."), _greedy(24)),
    Request(Turn("What is on the table?", (_image(64, 96, 1),)), _greedy(14)),
    Request(Turn("Count the boxes. " * 12), _greedy(17)),
    Request(Turn("Where is the robot?"), _greedy(30)),
]


@pytest.fixture(scope="module", params=["dynamic", "overlap"])
def overlap(request) -> bool:
    return request.param == "overlap"


def _engine(overlap: bool, **fields) -> Engine:
    engine = Engine(EngineConfig(model_path=str(cached_tiny_checkpoint()), device="cpu", **fields))
    if overlap:
        engine.parts.decode_step = StaticDecodeStep(
            engine.parts.model, engine.parts.cache, torch.device("cpu"), False, max_batch=MAX_BATCH, overlap=True
        )
    return engine


@pytest.fixture(scope="module")
def engine(overlap):
    return _engine(overlap, prefill_chunk_tokens=16)


def _copy(request: Request, **changes) -> Request:
    fields = {"turn": request.turn, "sampling": request.sampling, "session_id": request.session_id} | changes
    return Request(**fields)


def _alone(engine: Engine, request: Request) -> Finished:
    final = list(engine.generate(_copy(request)))[-1]
    assert isinstance(final, Finished) and final.finish_reason in ("stop", "length"), final
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


def test_the_static_step_and_the_kernels_batch_as_on_a_gpu(harness):
    """What a GPU runs, here on the CPU: the static decode step (fixed buffers, batch buckets 1/2/4, so 3
    members replay the bucket of 4 with a padding row) and the kernels of ``kernels/`` in the harness for
    every KV write, prefill and batched decode launch. Each request of the batch gets its tokens alone."""
    engine = Engine(EngineConfig(model_path=str(cached_tiny_checkpoint()), device="cpu", prefill_chunk_tokens=16))
    engine.parts.cache.set_attention_impl(CudaPagedAttention(harness))
    step = engine.parts.decode_step = StaticDecodeStep(
        engine.parts.model, engine.parts.cache, torch.device("cpu"), False, max_batch=4
    )
    alone = [_alone(engine, r) for r in MIXED]
    batches = []  # sequences of each step
    run = step.run
    step.run = lambda: batches.append(step.staged) or run()
    results = _together([engine.generate(_copy(r)) for r in MIXED])
    for (_, final), reference in zip(results, alone, strict=True):
        assert final.token_ids == reference.token_ids
    assert {1, 2, 3, 4} <= set(batches)


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


def _small(blocks: int, overlap: bool, **kw) -> Engine:
    """An engine whose pool of ``blocks`` blocks of 16 tokens runs out when several requests grow together."""
    fields = {"page_size": 16, "max_context_tokens": 160, "prefill_chunk_tokens": 16} | kw
    return _engine(overlap, kv_pool_blocks=blocks, **fields)


STORIES = [Request(Turn(f"Tell a long story number {i}."), _greedy(100)) for i in range(2)] + [
    Request(Turn("Count the boxes. " * 12), _greedy(60))  # a long prompt: its prefill pieces need blocks too
]


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_when_the_pool_runs_out_the_youngest_is_preempted_and_resumes_with_its_tokens(prefix_caching, overlap):
    # 12 blocks of 16 tokens: enough for each answer alone, not for three at once.
    small = _small(12, overlap, prefix_caching=prefix_caching)
    alone = [_alone(small, r) for r in STORIES]
    assert all(a.finish_reason == "length" and a.metrics["preemptions"] == 0 for a in alone)
    results = _together([small.generate(_copy(r)) for r in STORIES])
    for (deltas, final), reference in zip(results, alone, strict=True):
        assert (final.finish_reason, final.token_ids) == ("length", reference.token_ids)
        assert final.text == reference.text == "".join(d.text for d in deltas)  # streamed once, nothing repeated
    preemptions = [final.metrics["preemptions"] for _, final in results]
    assert preemptions[0] == 0 and sum(preemptions) > 0  # the oldest is never preempted for a younger one
    assert all(final.metrics["preempted_tokens"] > 0 for _, final in results if final.metrics["preemptions"])
    assert small.describe()["kv_blocks_used"] == 0


def test_preempted_turns_of_a_conversation_with_images_resume_and_the_conversation_goes_on(overlap):
    # 14 blocks: each turn of the conversation (the younger request, with an image) runs beside an answer
    # for someone else and the pool cannot hold both; the other one fits beside the conversation's history.
    small = _small(14, overlap, max_sessions=1, max_context_tokens=200)
    conversation = [
        Request(Turn("What is on the table?", (_image(64, 96, 1),)), _greedy(90), session_id="a"),
        Request(Turn("And in this one?", (_image(48, 64, 2),)), _greedy(30), session_id="a"),
    ]
    others = [_copy(STORIES[0], sampling=_greedy(90)), _copy(STORIES[1], sampling=_greedy(40))]
    sequential = [_alone(small, r).token_ids for r in conversation]
    expected = small.session_token_ids("a")
    small.reset()
    others_alone = [_alone(small, r).token_ids for r in others]
    for turn, other, other_alone, tokens in zip(conversation, others, others_alone, sequential, strict=True):
        (_, first), (_, second) = _together([small.generate(_copy(other)), small.generate(_copy(turn))])
        assert (first.finish_reason, first.token_ids, first.metrics["preemptions"]) == ("length", other_alone, 0)
        assert (second.finish_reason, second.token_ids) == ("length", tokens)
        assert second.metrics["preemptions"] > 0
    assert small.session_token_ids("a") == expected


class _CancelWhenPreempted(logging.Handler):
    """Cancels a request the moment the engine logs its preemption (while it waits to be recomputed)."""

    def __init__(self, engine: Engine, request_id: str) -> None:
        super().__init__(logging.INFO)
        self.engine, self.request_id, self.fired = engine, request_id, False

    def emit(self, record: logging.LogRecord) -> None:
        if not self.fired and f"request {self.request_id} preempted" in record.getMessage():
            self.fired = self.engine.cancel(self.request_id)


def test_a_request_cancelled_while_preempted_ends_and_its_turn_is_undone(overlap):
    small = _small(12, overlap, max_sessions=1)
    earlier = _alone(small, Request(Turn("Hello."), _greedy(5), session_id="talk"))
    before = small.session_token_ids("talk")
    requests = [
        Request(Turn("Tell a long story number 1."), _greedy(100), request_id="old"),
        Request(Turn("Now a long story."), _greedy(100), session_id="talk", request_id="young"),
    ]
    alone = _alone(small, _copy(requests[0]))
    hook = _CancelWhenPreempted(small, "young")
    logger = logging.getLogger("orin_vlm_node.engine")
    logger.addHandler(hook)
    level = logger.level
    logger.setLevel(logging.INFO)
    try:
        (_, old), (deltas, young) = _together([small.generate(r) for r in requests])
    finally:
        logger.removeHandler(hook)
        logger.setLevel(level)
    assert earlier.finish_reason == "length" and hook.fired
    assert (old.finish_reason, old.token_ids) == ("length", alone.token_ids)
    assert (young.finish_reason, young.metrics["preemptions"]) == ("cancelled", 1)
    assert young.text == "".join(d.text for d in deltas)  # what was streamed before the preemption stays said
    assert small.session_token_ids("talk") == before  # the conversation goes on from before the cancelled turn
    small.reset()
    assert small.describe()["kv_blocks_used"] == 0


def test_a_request_that_cannot_get_kv_beside_a_conversation_in_use_ends_pool_exhausted_and_the_rest_finish(
    overlap,
):
    # 10 blocks (one 160-token context): a conversation's history holds most of them while its next turn
    # waits; the other request cannot grow to its 128 tokens beside that history, and a conversation in
    # use is never dropped to make room, so that request alone ends kv_pool_exhausted.
    small = _small(10, overlap, max_sessions=1, prefix_caching=False)
    first_turn = Request(Turn("Tell a long story."), _greedy(70), session_id="talk")
    requests = [STORIES[0], Request(Turn("Go on."), _greedy(20), session_id="talk")]
    reference = _alone(small, _copy(STORIES[0]))  # alone (no conversation kept) it fits
    _alone(small, first_turn)
    turn = _alone(small, _copy(requests[1]))
    conversation = small.session_token_ids("talk")
    small.reset()
    _alone(small, first_turn)
    results = _together([small.generate(_copy(r)) for r in requests])
    (deltas, first), (_, second) = results
    assert reference.finish_reason == "length" and first.finish_reason == "kv_pool_exhausted"
    assert first.token_ids == reference.token_ids[: len(first.token_ids)] and first.text == "".join(
        d.text for d in deltas
    )
    assert (second.finish_reason, second.token_ids) == ("length", turn.token_ids)
    assert second.metrics["preemptions"] == 1
    assert small.session_token_ids("talk") == conversation
