"""The engine stays healthy: cancellation (before start, mid-decode, from another thread, by closing the
stream), pool exhaustion (prefill and decode, with idle-session eviction), bad input and failures inside the
model. Reconfiguration is ``test_engine_reconfigure.py``'s."""

from __future__ import annotations

import queue
import threading

import numpy as np
import pytest
import torch
from test_engine_streaming import SCRIPT, assert_healthy, finish_one, scripted_engine

from orin_vlm_node.engine import Engine, EngineConfig, EngineError, Request, SamplingParams, TextDelta, Turn
from support.checkpoints import IM_END, cached_tiny_checkpoint

torch.set_num_threads(1)

GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture
def engine(tmp_path_factory) -> Engine:
    return scripted_engine(tmp_path_factory)[0]


# -- cancellation ---------------------------------------------------------------------------------


def test_cancel_mid_decode_from_another_thread(engine):
    request = Request(Turn("Go."), GREEDY)
    events = engine.generate(request)
    first = next(events)
    assert isinstance(first, TextDelta)
    canceller = threading.Thread(target=lambda: engine.cancel(request.request_id))
    canceller.start()
    canceller.join()
    rest = list(events)
    final = rest[-1]
    assert final.finish_reason == "cancelled"
    assert final.text == first.text + "".join(e.text for e in rest[:-1])
    assert 0 < len(final.text) < len(SCRIPT)
    assert engine.parts.cache.stats()["blocks_used"] == 0 and engine.parts.cache.stats()["sequences"] == 0
    assert_healthy(engine)


def test_cancel_while_consumer_thread_streams(engine):
    request = Request(Turn("Go."), GREEDY, request_id="r-1")
    seen: queue.Queue = queue.Queue()

    def consume():
        for event in engine.generate(request):
            seen.put(event)

    worker = threading.Thread(target=consume)
    worker.start()
    assert isinstance(seen.get(timeout=30), TextDelta)
    assert engine.cancel("r-1") is True
    worker.join(timeout=30)
    events = []
    while not seen.empty():
        events.append(seen.get())
    assert events[-1].finish_reason in ("cancelled", "stop")  # the script may have ended first
    assert engine.cancel("r-1") is False  # finished requests are forgotten
    assert_healthy(engine)


def test_cancel_before_start_and_unknown_id(engine):
    assert engine.cancel("nope") is False
    request = Request(Turn("Go."), GREEDY)
    events = engine.generate(request)
    assert engine.cancel(request.request_id) is True
    final = list(events)[-1]
    assert final.finish_reason == "cancelled" and final.token_ids == () and final.text == ""
    assert_healthy(engine)


def test_cancelled_session_turn_keeps_answer_so_far(engine):
    request = Request(Turn("Go."), GREEDY, session_id="s")
    events = engine.generate(request)
    next(events)
    engine.cancel(request.request_id)
    final = list(events)[-1]
    assert final.finish_reason == "cancelled"
    stream = engine.session_token_ids("s")
    assert stream[-1] == IM_END and stream[-1 - len(final.token_ids) : -1] == list(final.token_ids)
    follow = finish_one(engine, Request(Turn("Again."), GREEDY, session_id="s"))
    assert follow.finish_reason == "stop" and follow.text == SCRIPT


# -- pool exhaustion ------------------------------------------------------------------------------


def _prompt_len(engine: Engine, text: str) -> int:
    return len(engine.parts.turns.renderer.first_turn(None, Turn(text), [])[0])


def test_a_pool_that_cannot_hold_one_context_is_refused_and_a_full_one_serves_the_limit(tmp_path_factory):
    engine, answer = scripted_engine(tmp_path_factory, page_size=4)
    n = _prompt_len(engine, "Go.")
    blocks = -(-(n + 6) // 4)  # room for the prompt and a few answer tokens, not the whole answer
    with pytest.raises(ValueError, match="cannot hold one max_context_tokens=256 sequence"):
        engine.validate_changes(kv_pool_blocks=blocks)
    with pytest.raises(ValueError, match=f"{blocks} blocks x 4 tokens = {blocks * 4} tokens"):
        engine.reconfigure(kv_pool_blocks=blocks)
    assert engine.config.kv_pool_blocks == 0
    # Pool and context limit agree: a long answer stops at the limit, never in the middle of the pool.
    engine.reconfigure(kv_pool_blocks=blocks, max_context_tokens=blocks * 4)
    final = finish_one(engine, Request(Turn("Go."), GREEDY))
    assert final.finish_reason == "length" and 0 < len(final.token_ids) < len(answer)
    assert SCRIPT.startswith(final.text) and final.text
    assert engine.parts.cache.stats()["blocks_used"] == 0
    long_prompt = "Describe every object in the room, one by one, with its colour. " * 3
    final = finish_one(engine, Request(Turn(long_prompt), GREEDY))
    assert final.finish_reason == "error" and "prompt is too long" in final.error
    assert_healthy(engine)


def test_idle_sessions_are_evicted_before_exhausting(tmp_path_factory):
    engine, answer = scripted_engine(tmp_path_factory, page_size=4)
    n = _prompt_len(engine, "Go.")
    blocks = -(-(n + len(answer) + 2) // 4) + 1
    engine.reconfigure(kv_pool_blocks=blocks, max_context_tokens=blocks * 4, prefix_caching=False, max_sessions=2)
    assert finish_one(engine, Request(Turn("Go."), GREEDY, session_id="old")).finish_reason == "stop"
    assert engine.sessions() == ["old"]
    final = finish_one(engine, Request(Turn("Go."), GREEDY, session_id="new"))
    assert final.finish_reason == "stop" and final.text == SCRIPT
    assert engine.sessions() == ["new"]


def test_sessions_beyond_max_sessions_are_dropped_least_recent_first(tmp_path_factory):
    engine, _ = scripted_engine(tmp_path_factory, page_size=4)
    engine.reconfigure(max_sessions=2)
    for sid in ("a", "b", "c"):
        assert finish_one(engine, Request(Turn("Go."), GREEDY, session_id=sid)).finish_reason == "stop"
    assert sorted(engine.sessions()) == ["b", "c"]
    engine.reconfigure(max_sessions=0)  # the KV layout changes: every session goes, and none is kept
    assert finish_one(engine, Request(Turn("Go."), GREEDY, session_id="d")).finish_reason == "stop"
    assert engine.sessions() == [] and engine.parts.cache.stats()["blocks_used"] == 0


# -- bad input and failures -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "request_kwargs,fragment",
    [
        (dict(turn=Turn("")), "empty prompt"),
        (dict(turn=Turn("   \n")), "empty prompt"),
        (dict(turn=Turn("Look.", (np.zeros((2, 900, 3), np.uint8),))), "image 0"),
        (dict(turn=Turn("Look.", (np.zeros((64, 64, 3), np.float32),))), "image 0"),
        (dict(turn=Turn("Look.", ("not an image",))), "image 0"),
        (dict(turn=Turn("Look.", (np.zeros((64, 64, 3), np.uint8),), color="hsv")), "color"),
        (dict(turn=Turn("Hi"), sampling=SamplingParams(top_p=0.0)), "top_p"),
        (dict(turn=Turn("Hi"), sampling=SamplingParams(temperature=-1.0)), "temperature"),
        (dict(turn=Turn("Hi"), sampling=SamplingParams(repetition_penalty=0.0)), "repetition_penalty"),
        (dict(turn=Turn("Hi"), sampling=SamplingParams(max_new_tokens=0)), "max_new_tokens"),
        (dict(turn=Turn("word " * 400)), "prompt is too long"),
    ],
)
def test_bad_input_gives_clear_error_and_engine_keeps_serving(engine, request_kwargs, fragment):
    final = finish_one(engine, Request(**request_kwargs))
    assert final.finish_reason == "error"
    assert fragment in final.error
    assert_healthy(engine)


def test_special_token_text_in_a_prompt_is_answered_as_plain_text(engine):
    """A typed image placeholder or end-of-text is text: no image is demanded, the sequence does not end, and
    the prompt is longer (in tokens) than with the expert setting that reads it as control tokens."""
    text = "Hi <|image_pad|> there<|endoftext|><|im_end|>"
    plain = finish_one(engine, Request(Turn(text), GREEDY))
    assert plain.finish_reason == "stop" and plain.text == SCRIPT
    engine.reconfigure(prompt_special_tokens=True)
    try:
        raw = finish_one(engine, Request(Turn(text), GREEDY))
    finally:
        engine.reconfigure(prompt_special_tokens=False)
    assert raw.finish_reason == "error" and "image placeholder" in raw.error
    assert_healthy(engine)


def test_a_full_conversation_starts_over_with_a_turn_that_fits_alone(tmp_path_factory):
    """A session turn that does not fit after the earlier turns (but does alone) starts the conversation
    over: the same answer and session as a fresh conversation, the tokens forgotten in the metrics. A turn
    too long even alone is an error that leaves the conversation as it was."""
    engine, _ = scripted_engine(tmp_path_factory, max_context_tokens=96)
    turn = Turn("more " * 20)
    fresh = finish_one(engine, Request(turn, GREEDY, session_id="fresh"))
    assert fresh.finish_reason == "stop" and fresh.metrics["forgotten_tokens"] == 0
    fresh_conversation = engine.session_token_ids("fresh")  # before "s" takes the one session kept
    assert finish_one(engine, Request(Turn("Go."), GREEDY, session_id="s")).finish_reason == "stop"
    before, held = engine.session_token_ids("s"), len(engine.parts.session_store.get("s").token_ids)
    assert len(before) + fresh.metrics["prompt_tokens"] > 96  # the turn does not fit after the first one
    final = finish_one(engine, Request(turn, GREEDY, session_id="s"))
    assert final.finish_reason == "stop" and final.error is None
    assert (final.text, final.token_ids) == (fresh.text, fresh.token_ids)
    assert final.metrics["forgotten_tokens"] == held  # the earlier turns' tokens in the KV
    assert final.metrics["prompt_tokens"] == fresh.metrics["prompt_tokens"]
    assert engine.session_token_ids("s") == fresh_conversation
    after = engine.session_token_ids("s")
    final = finish_one(engine, Request(Turn("more " * 200), GREEDY, session_id="s"))
    assert final.finish_reason == "error" and "prompt is too long" in final.error and "96" in final.error
    assert "earlier turns" not in final.error  # too long alone: starting over would not help
    assert engine.session_token_ids("s") == after
    assert finish_one(engine, Request(Turn("Go."), GREEDY, session_id="s")).text == SCRIPT
    assert_healthy(engine)


@pytest.mark.parametrize("fail_at_call", [1, 4], ids=["prefill", "decode"])
def test_exception_inside_model_finishes_with_error(engine, monkeypatch, fail_at_call):
    real = engine.parts.model.forward
    calls = {"n": 0}

    def flaky(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == fail_at_call:
            raise RuntimeError("simulated device fault")
        return real(*args, **kwargs)

    monkeypatch.setattr(engine.parts.model, "forward", flaky)
    for session_id in (None, "s"):
        calls["n"] = 0
        final = finish_one(engine, Request(Turn("Go."), GREEDY, session_id=session_id))
        assert final.finish_reason == "error" and "simulated device fault" in final.error
        assert engine.sessions() == []  # a failed first turn leaves no session behind
    assert_healthy(engine)


def test_missing_or_broken_model_directory_raises_engine_error(tmp_path):
    with pytest.raises(EngineError, match="does not exist"):
        Engine(EngineConfig(model_path=str(tmp_path / "missing")))
    (tmp_path / "empty").mkdir()
    with pytest.raises(EngineError, match="config.json"):
        Engine(EngineConfig(model_path=str(tmp_path / "empty")))
    with pytest.raises(EngineError, match="dtype"):
        Engine(
            EngineConfig(
                model_path=str(cached_tiny_checkpoint(layers=1, tie=False, deepstack=(0,), seed=11)), dtype="int8"
            )
        )


def test_closing_the_iterator_mid_stream_frees_the_request(engine):
    events = engine.generate(Request(Turn("Go."), GREEDY))
    assert isinstance(next(events), TextDelta)
    events.close()
    assert engine.parts.cache.stats()["sequences"] == 0 and engine.parts.cache.stats()["blocks_used"] == 0
    assert_healthy(engine)  # the engine lock was released too
