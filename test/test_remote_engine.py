"""RemoteEngine, the engine's interface over an OpenAI-compatible server, against a scripted local server:
conversations kept per session (bounded in number and in tokens), retries before the first token only,
settings a server cannot honour refused, token probabilities and their characters for detections, and
diagnostics that never wait on the network."""

from __future__ import annotations

import dataclasses
import math
import socket
import time

import numpy as np
import pytest
from scripted_server import scripted_server, sse

from orin_vlm_node.engine import Request, SamplingParams, Turn, Video
from orin_vlm_node.engine.grounding import detections, grounding_request
from orin_vlm_node.remote.client import Endpoint
from orin_vlm_node.remote.engine import RemoteConfig, RemoteEngine


def _answer(*pieces: str, usage: dict | None = None, logprob: float | None = None, reason: str = "stop") -> list[bytes]:
    chunks = []
    for i, piece in enumerate(pieces):
        choice: dict = {"delta": {"content": piece}, "finish_reason": reason if i == len(pieces) - 1 else None}
        if logprob is not None:
            choice["logprobs"] = {"content": [{"token": piece, "logprob": logprob}]}
        chunks.append({"choices": [choice]})
    return sse(*chunks, {"choices": [], "usage": usage or {}}, "[DONE]")


@pytest.fixture
def peer():
    with scripted_server() as (script, endpoint):
        engine = RemoteEngine(RemoteConfig(endpoint, "m", max_sessions=2, max_context_tokens=100))
        yield script, engine
        engine.close()


def _ask(engine: RemoteEngine, text: str, session: str | None = None, **request) -> list:
    return list(engine.generate(Request(Turn(text), SamplingParams(temperature=0.0), session_id=session, **request)))


def test_a_session_sends_its_history_and_a_reset_forgets_it(peer):
    script, engine = peer
    script.chunks = _answer("Hel", "lo", usage={"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7})
    *deltas, done = _ask(engine, "hi", "s1")
    assert "".join(d.text for d in deltas) == done.text == "Hello" and done.finish_reason == "stop"
    assert done.metrics["prompt_tokens"] == 5 and done.metrics["generated_tokens"] == 2
    _ask(engine, "again", "s1")
    sent = script.posts()[-1]["messages"]
    assert [m["role"] for m in sent] == ["user", "assistant", "user"] and sent[1]["content"] == "Hello"
    engine.reset("s1")
    _ask(engine, "fresh", "s1")
    assert len(script.posts()[-1]["messages"]) == 1


def test_conversations_are_bounded_in_number_and_in_tokens(peer):
    script, engine = peer
    script.chunks = _answer("ok", usage={"total_tokens": 60})
    for session in ("a", "b", "c"):  # max_sessions 2: "a", the least recently used, is forgotten
        _ask(engine, "q", session)
    _ask(engine, "q", "a")
    assert len(script.posts()[-1]["messages"]) == 1
    script.chunks = _answer("ok", usage={"total_tokens": 130})  # over max_context_tokens (100)
    _ask(engine, "q", "b")
    *_, done = _ask(engine, "q", "b")
    assert len(script.posts()[-1]["messages"]) == 1 and done.metrics["forgotten_tokens"] == 130


def test_a_failure_before_the_first_token_is_retried_and_a_client_error_is_not(peer):
    script, engine = peer
    script.first = [(503, [b'{"error": {"message": "warming up"}}'])]
    script.chunks = _answer("fine")
    *_, done = _ask(engine, "q")
    assert done.text == "fine" and len(script.posts()) == 2
    script.first = [(400, [b'{"error": {"message": "max_tokens is too large"}}'])]
    *_, done = _ask(engine, "q")
    assert done.finish_reason == "error" and "400: max_tokens is too large" in done.error
    assert len(script.posts()) == 3 and engine.describe()["last_error"] == done.error


def test_a_stream_cut_after_the_first_token_ends_in_an_error_with_what_came(peer):
    script, engine = peer
    script.chunks = sse({"choices": [{"delta": {"content": "par"}}]})
    *deltas, done = _ask(engine, "q")
    assert [d.text for d in deltas] == ["par"] and done.finish_reason == "error" and done.text == "par"
    assert "closed the stream" in done.error and len(script.posts()) == 1


def test_settings_only_a_local_model_has_are_refused_and_sampling_is_checked(peer):
    _, engine = peer
    with pytest.raises(ValueError, match="use_cuda_graph: a local model's setting"):
        engine.validate_changes(use_cuda_graph=False)
    with pytest.raises(ValueError, match="temperature"):
        engine.validate_changes(sampling=SamplingParams(temperature=-1.0))
    engine.reconfigure(max_sessions=0, sampling=SamplingParams(temperature=0.5))
    assert engine.config.max_sessions == 0 and engine.config.sampling.temperature == 0.5


def test_a_detection_is_scored_by_the_probabilities_of_the_tokens_that_wrote_it(peer):
    script, engine = peer
    text, fmt = grounding_request(("cup",), 1)
    pieces = ('[{"bbox_2d": [', "100, 200, ", "500, 1000", '], "label": "cup"}', "]")
    script.chunks = _answer(*pieces, logprob=math.log(0.5))
    frame = np.zeros((480, 640, 3), np.uint8)
    request = Request(Turn(text, (frame,)), SamplingParams(temperature=0.0), output=fmt, token_probs=True)
    *_, done = list(engine.generate(request))
    assert script.posts()[0]["logprobs"] is True and "response_format" in script.posts()[0]
    assert done.output["complete"] and done.token_spans[-1][1] == len(done.text)
    (found,) = detections(done.text, done.token_probs, done.token_spans, [frame.shape[:2]])
    assert found.label == "cup" and found.box == (64.0, 96.0, 320.0, 480.0) and found.score == pytest.approx(0.5)


def test_cancel_closes_the_stream_and_the_answer_ends_cancelled(peer):
    script, engine = peer
    script.chunks, script.delay = _answer(*(["x"] * 200)), 0.01
    request = Request(Turn("q"), SamplingParams(), request_id="r1")
    events = engine.generate(request)
    first = next(events)
    assert engine.cancel("r1")
    *_, done = list(events)
    assert first.text == "x" and done.finish_reason == "cancelled" and len(done.text) < 200


def test_diagnostics_never_wait_on_a_server_that_does_not_answer():
    with socket.socket() as silent:  # accepts connections (the backlog), never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        url = f"http://127.0.0.1:{silent.getsockname()[1]}/v1"
        engine = RemoteEngine(RemoteConfig(Endpoint(url, timeout_s=30.0), "m"))
        try:
            t0 = time.monotonic()
            described = engine.describe()
            assert time.monotonic() - t0 < 0.5 and not described["server_reachable"]
            assert described["server_problem"] == "not checked yet"
            deadline = time.monotonic() + 10.0
            while engine.describe()["server_problem"] == "not checked yet" and time.monotonic() < deadline:
                time.sleep(0.05)
            described = engine.describe()
            assert not described["server_reachable"] and "timed out" in described["server_problem"]
        finally:
            engine.close()


def test_a_listed_model_and_a_missing_one_are_reported(peer):
    script, engine = peer
    script.models = ["m"]
    listed = RemoteEngine(dataclasses.replace(engine.config, model="other"))
    try:
        deadline = time.monotonic() + 5.0
        while listed.describe()["server_problem"] == "not checked yet" and time.monotonic() < deadline:
            time.sleep(0.05)
        described = listed.describe()
        assert described["server_reachable"] and not described["model_listed"]
        assert "'other' is not listed" in described["server_problem"]
    finally:
        listed.close()


def test_a_video_is_refused_with_the_reason_and_nothing_is_posted(peer):
    script, engine = peer
    clip = Video((np.zeros((32, 32, 3), np.uint8),) * 2, (0.0, 0.5))
    (done,) = list(engine.generate(Request(Turn("What moved?", videos=(clip,)), SamplingParams(temperature=0.0))))
    assert done.finish_reason == "error" and "does not send videos" in done.error
    assert script.posts() == []
