"""The OpenAI-compatible client's handling of what a server may send, against a local HTTP server that
answers with scripted bodies (``scripted_server``): a stream of chunks, error statuses with their messages,
an event that is not JSON, a stream cut before ``[DONE]``, a stream closed from another thread while the
server keeps sending."""

from __future__ import annotations

import json
import threading
import time

import pytest
from scripted_server import scripted_server, sse

from orin_vlm_node.remote.client import ChatStream, Endpoint, RemoteError, list_models


@pytest.fixture
def server():
    with scripted_server() as peer:
        yield peer


def test_a_stream_gives_each_chunk_until_done_and_sends_the_key(server):
    script, endpoint = server
    script.chunks = [b": keep-alive\n\n", *sse({"choices": [{"delta": {"content": "Hi"}}]}, {"usage": {}}, "[DONE]")]
    chunks = list(ChatStream(endpoint, {"model": "m", "messages": []}))
    assert chunks == [{"choices": [{"delta": {"content": "Hi"}}]}, {"usage": {}}]
    (sent,) = script.requests
    assert sent["path"] == "/v1/chat/completions" and sent["body"]["stream"] is True
    assert sent["auth"] == "Bearer k3y"


@pytest.mark.parametrize(("status", "retryable"), [(400, False), (404, False), (429, True), (503, True)])
def test_an_error_status_names_the_server_s_message(server, status, retryable):
    script, endpoint = server
    script.status = status
    script.chunks = [json.dumps({"error": {"message": "model 'x' does not exist"}}).encode()]
    with pytest.raises(RemoteError, match=f"{status}: model 'x' does not exist") as caught:
        ChatStream(endpoint, {"model": "x"})
    assert caught.value.retryable is retryable


def test_an_event_that_is_not_json_is_an_error(server):
    script, endpoint = server
    script.chunks = sse({"choices": []}, "{not json")
    with pytest.raises(RemoteError, match="not JSON"):
        list(ChatStream(endpoint, {}))


def test_a_stream_cut_before_done_is_a_retryable_error(server):
    script, endpoint = server
    script.chunks = sse({"choices": [{"delta": {"content": "a"}}]})
    with pytest.raises(RemoteError, match="closed the stream") as caught:
        list(ChatStream(endpoint, {}))
    assert caught.value.retryable


def test_closing_a_stream_from_another_thread_ends_it_quietly(server):
    script, endpoint = server
    script.chunks, script.delay = sse(*({"choices": [{"delta": {"content": "x"}}]} for _ in range(200))), 0.02
    stream = ChatStream(endpoint, {})
    timer = threading.Timer(0.2, stream.close)
    timer.start()
    t0 = time.monotonic()
    got = list(stream)
    assert 0 < len(got) < 200 and time.monotonic() - t0 < 2.0


def test_an_unreachable_server_is_a_retryable_error_and_a_bad_url_is_refused():
    with pytest.raises(RemoteError, match="unreachable") as caught:
        list_models(Endpoint("http://127.0.0.1:9/v1", timeout_s=1.0))
    assert caught.value.retryable
    for url in ("ftp://host/v1", "gpu-box:8000", "http:///v1"):
        with pytest.raises(ValueError, match="http:// or https://"):
            Endpoint(url)


def test_the_model_list_is_read_from_get_models(server):
    script, endpoint = server
    script.chunks = [json.dumps({"object": "list", "data": [{"id": "Qwen/Qwen3-VL-32B"}, {"id": "b"}]}).encode()]
    assert list_models(endpoint) == ["Qwen/Qwen3-VL-32B", "b"]
    assert script.requests[0]["path"] == "/v1/models"


def test_closing_while_the_reader_is_inside_a_read_never_raises(server):
    """The closing thread only shuts the socket down; the reading thread closes the connection (http.client's
    response is not safe to close from two threads at once)."""
    script, endpoint = server
    script.chunks, script.delay = sse(*({"choices": [{"delta": {"content": "x"}}]} for _ in range(100))), 0.001
    for delay in (0.0, 0.002, 0.005, 0.01, 0.02) * 4:
        stream = ChatStream(endpoint, {})
        threading.Timer(delay, stream.close).start()
        assert len(list(stream)) < 100
