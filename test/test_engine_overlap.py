"""Overlapped decode (what the engine does on a GPU) answers exactly as the step-by-step decode does.

With overlap the scheduler stages the token chosen from step N's logits as a device tensor, launches step
N+1, and only then reads token N; an answer that ends at token N had step N+1's row computed for nothing,
and its reserved KV slot must go. Here the static decode step runs on the CPU with ``overlap=True`` and
is compared with the engine's own CPU step (which reads every token before the next step) on what the
host decides only after reading: EOS, stop strings, ``max_new_tokens``, the context limit, cancellation,
the next turn of a kept conversation, and seeded sampling with penalties (fp32, tiny checkpoint).
"""

from __future__ import annotations

import pytest
import torch

from orin_vlm_node.engine import Engine, EngineConfig, Finished, Request, SamplingParams, TextDelta, Turn
from orin_vlm_node.engine.assemble import MAX_BATCH
from orin_vlm_node.engine.decode_step import StaticDecodeStep
from orin_vlm_node.engine.sampled_tokens import SampledTokens
from support.checkpoints import cached_tiny_checkpoint

torch.set_num_threads(1)


def _engine(overlap: bool, **fields) -> Engine:
    config = {"model_path": str(cached_tiny_checkpoint()), "device": "cpu", "max_sessions": 2} | fields
    engine = Engine(EngineConfig(**config))
    if overlap:
        step = StaticDecodeStep(
            engine.parts.model, engine.parts.cache, torch.device("cpu"), False, MAX_BATCH, overlap=True
        )
        engine.parts.decode_step = step
    return engine


@pytest.fixture(scope="module")
def engines() -> tuple[Engine, Engine]:
    return _engine(False), _engine(True)


def _answer(engine: Engine, request: Request) -> tuple[list[TextDelta], Finished]:
    events = list(engine.generate(request))
    assert isinstance(events[-1], Finished), events[-1]
    return events[:-1], events[-1]


def _same(engines: tuple[Engine, Engine], request: Request) -> Finished:
    """The request's answer from both engines: the same events; the overlapped one's answer."""
    (d0, f0), (d1, f1) = (_answer(e, request) for e in engines)
    assert (f1.finish_reason, f1.token_ids, f1.text) == (f0.finish_reason, f0.token_ids, f0.text)
    assert [(d.text, d.token_ids) for d in d1] == [(d.text, d.token_ids) for d in d0]
    assert "".join(d.text for d in d1) == f1.text
    return f1


def test_the_step_is_not_the_default_on_a_cpu_but_overlaps_when_asked(engines):
    sync, overlapped = engines
    assert sync.describe()["decode"]["step"] == "dynamic" and not sync.parts.decode_step.overlap
    assert overlapped.describe()["decode"]["overlap"] is True


@pytest.mark.parametrize(
    "sampling",
    [
        SamplingParams(temperature=0.0, max_new_tokens=40),  # ends at EOS or at 40
        SamplingParams(temperature=0.0, max_new_tokens=7, ignore_eos=True),
        SamplingParams(temperature=0.9, top_k=20, top_p=0.9, seed=11, max_new_tokens=30, ignore_eos=True),
        SamplingParams(temperature=0.0, repetition_penalty=1.3, presence_penalty=0.5, max_new_tokens=30),
        SamplingParams(temperature=0.7, repetition_penalty=1.2, seed=3, max_new_tokens=25),
    ],
    ids=["greedy-eos", "length", "seeded-top-p", "greedy-penalties", "seeded-penalties"],
)
def test_answers_match_the_step_by_step_decode(engines, sampling):
    request = Request(Turn("Describe the scene in front of the robot."), sampling)
    final = _same(engines, request)
    assert final.token_ids
    assert engines[1].describe()["kv_blocks_used"] == 0  # the row computed past the end was released


def test_a_stop_string_ends_the_answer_at_the_same_token(engines):
    free = _answer(engines[0], Request(Turn("Say something."), SamplingParams(temperature=0.0, max_new_tokens=30)))[1]
    stop = free.text[len(free.text) // 2 :][:3] or free.text
    request = Request(Turn("Say something."), SamplingParams(temperature=0.0, max_new_tokens=30, stop=(stop,)))
    final = _same(engines, request)
    assert final.finish_reason == "stop" and stop not in final.text


def test_the_context_limit_ends_the_answer_at_the_same_token():
    engines = (_engine(False, max_context_tokens=64), _engine(True, max_context_tokens=64))
    request = Request(Turn("Count the boxes on the shelf."), SamplingParams(temperature=0.0, max_new_tokens=200))
    final = _same(engines, request)
    assert final.finish_reason == "length" and len(final.token_ids) < 200
    assert engines[1].describe()["kv_blocks_used"] == 0


def test_the_next_turn_of_a_conversation_sees_exactly_the_answer(engines):
    turns = [Turn("Hello robot."), Turn("What do you see?"), Turn("And now?")]
    for turn in turns:
        _same(engines, Request(turn, SamplingParams(temperature=0.0, max_new_tokens=20), session_id="talk"))
    sync, overlapped = engines
    assert overlapped.session_token_ids("talk") == sync.session_token_ids("talk")
    kv = overlapped.parts.cache.length(overlapped.parts.session_store.get("talk").seq)
    # no slot of a row computed past the end
    assert kv == sync.parts.cache.length(sync.parts.session_store.get("talk").seq)
    for e in engines:
        e.reset()


def test_a_cancel_ends_the_answer_and_frees_its_kv(engines):
    overlapped = engines[1]
    request = Request(Turn("Tell a long story."), SamplingParams(temperature=0.0, max_new_tokens=60, ignore_eos=True))
    stream = overlapped.generate(Request(request.turn, request.sampling, request_id="stop-me"))
    taken = 0
    for event in stream:
        if isinstance(event, TextDelta):
            taken += len(event.token_ids)
            if taken >= 5:
                overlapped.cancel("stop-me")
        else:
            final = event
    reference = _answer(engines[0], request)[1]
    assert final.finish_reason == "cancelled"
    assert 5 <= len(final.token_ids) < 60 and final.token_ids == reference.token_ids[: len(final.token_ids)]
    assert overlapped.describe()["kv_blocks_used"] == 0


def test_the_host_reads_token_n_after_step_n_plus_1_was_launched(engines, monkeypatch):
    overlapped = engines[1]
    order: list[str] = []
    run, read = overlapped.parts.decode_step.run, SampledTokens.read
    monkeypatch.setattr(overlapped.parts.decode_step, "run", lambda: order.append("launch") or run())
    monkeypatch.setattr(SampledTokens, "read", lambda self: order.append("read") or read(self))
    sampling = SamplingParams(temperature=0.0, max_new_tokens=6, ignore_eos=True)
    final = _answer(overlapped, Request(Turn("Hello."), sampling))[1]
    assert len(final.token_ids) == 6
    # token 1 comes from the prefill (read at once); tokens 2..5 are each read after the next launch; token
    # 6 is the last by max_new_tokens, so no step is launched for it.
    assert order == ["read", "launch", "launch", "read", "launch", "read", "launch", "read", "launch", "read", "read"]
