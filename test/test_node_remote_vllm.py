"""The node with ``backend`` openai against a real vLLM serving the embedded default model on this CPU
(``support.vllm_server``): a real node, real DDS, a real server. Its greedy answers, multi-turn answers and
detections equal those of the engine run in this process on the same requests; cancel stops the server's
stream; the diagnostics report the server and the model. Through a TCP proxy with faults: errors before the
first token are retried, a client error, a cut stream, a slow server and a refused connection each end the
prompt with one error event naming the cause, and the node serves on."""

from __future__ import annotations

import json
import time
import urllib.request

import pytest
import torch

pytest.importorskip("rclpy", reason="rclpy (ROS 2 wheels) is installed by `make test`")

from ros_harness import FAST_PARAMS, running_node  # noqa: E402
from tcp_proxy import Fault, TcpProxy  # noqa: E402

from orin_vlm_node.engine import Engine, EngineConfig, Request, SamplingParams, Turn  # noqa: E402
from orin_vlm_node.engine.grounding import detections, grounding_request  # noqa: E402
from orin_vlm_node.ros.image import rgb_to_image_msg  # noqa: E402
from orin_vlm_node.ros.params import defaults  # noqa: E402
from support import synthetic_scenes as scenes  # noqa: E402
from support.vllm_server import SERVED_NAME, VllmServer, env_python, free_port  # noqa: E402

MAX_NEW = 40
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=MAX_NEW)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    python = env_python()
    if python is None:
        pytest.skip("no vLLM environment on this machine: `make vllm-env` builds it")
    vllm = VllmServer(python, free_port(), log=tmp_path_factory.mktemp("vllm") / "vllm.log")
    try:
        vllm.wait_ready()
        yield vllm
    finally:
        vllm.stop()


@pytest.fixture(scope="module")
def vlm(server, tmp_path_factory):
    params = {**defaults(), **FAST_PARAMS, "backend": "openai", "remote_url": server.url, "remote_model": SERVED_NAME,
              "remote_image_format": "png", "max_new_tokens": MAX_NEW, "multi_turn": True}  # fmt: skip
    with running_node(params, tmp_path_factory.mktemp("node"), __name__) as running:
        yield running


@pytest.fixture(scope="module")
def local():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield Engine(EngineConfig(device="cpu", max_sessions=1))
    torch.set_num_threads(threads)


def _publish(client, rgb) -> None:
    from sensor_msgs.msg import Image

    msg = rgb_to_image_msg(rgb, Image)
    msg.header.frame_id = "front_camera"
    client.publish_image(msg)


def test_the_node_answers_as_the_local_engine_does(vlm, local):
    _, client = vlm
    for sample in [s for s in scenes.held_out_samples(12) if s.image is not None][:4]:
        _publish(client, sample.image)
        assert client.trigger("reset").success  # each question a conversation of its own, as the reference's
        answer = client.ask(sample.question, timeout=120)
        request = Request(Turn(sample.question, (sample.image,)), GREEDY)
        *_, want = local.generate(request)
        assert answer["status"]["event"] == "finished", answer["status"]
        assert answer["response"] == want.text and "".join(answer["tokens"]) == want.text
        metrics = answer["status"]["metrics"]
        assert metrics["prompt_tokens"] == want.metrics["prompt_tokens"]
        assert metrics["generated_tokens"] == want.metrics["generated_tokens"] and metrics["ttft_s"] > 0


def test_a_conversation_continues_as_it_would_locally(vlm, local):
    _, client = vlm
    client.trigger("reset")
    sample = next(s for s in scenes.held_out_samples(12) if s.image is not None)
    _publish(client, sample.image)
    turns = [sample.question, "What color is it?"]
    answers = [client.ask(text, timeout=120) for text in turns]
    local.reset()
    for text, answer in zip(turns, answers, strict=True):  # each prompt takes the camera's latest frame
        *_, want = local.generate(Request(Turn(text, (sample.image,)), GREEDY, session_id="s"))
        assert answer["response"] == want.text
        assert answer["status"]["metrics"]["prompt_tokens"] == want.metrics["prompt_tokens"]


def test_a_detection_request_gives_the_local_engine_s_detections(vlm, local):
    from std_msgs.msg import String

    _, client = vlm
    received: list[str] = []
    client.node.create_subscription(String, "detections_json", lambda m: received.append(m.data), 10)
    sample = next(s for s in scenes.held_out_samples(12) if s.image is not None)
    _publish(client, sample.image)
    labels = ("red circle", "blue square", "star")
    assert client.trigger("reset").success
    answer = client.ask({"detect": ", ".join(labels)}, timeout=180)
    text, fmt = grounding_request(labels, 1)
    *_, want = local.generate(Request(Turn(text, (sample.image,)), GREEDY, output=fmt, token_probs=True))
    if want.finish_reason != "stop":  # an answer cut by max_new_tokens is an error event on both paths
        assert answer["status"]["event"] == "error" and "unusable" in answer["status"]["error"], answer["status"]
        return
    assert answer["status"]["event"] == "finished" and answer["response"] == want.text, answer["status"]
    client.wait_for(lambda: received, 10, "the detections")
    found = detections(want.text, want.token_probs, want.token_spans, [sample.image.shape[:2]])
    published = json.loads(received[-1])["detections"]
    assert [(d["label"], d["box"]) for d in published] == [(d.label, list(d.box)) for d in found]
    assert [d["score"] for d in published] == pytest.approx([d.score for d in found], abs=0.05)


def _running_on(server: VllmServer) -> float:
    """Requests the server is generating for now (its Prometheus gauge)."""
    with urllib.request.urlopen(server.url.removesuffix("/v1") + "/metrics", timeout=5) as response:
        lines = response.read().decode().splitlines()
    return sum(float(line.split()[-1]) for line in lines if line.startswith("vllm:num_requests_running"))


def test_cancel_ends_the_answer_and_the_server_stops_generating(vlm, server):
    _, client = vlm
    (result,) = client.set_params({"max_new_tokens": 1500})
    assert result.successful, result.reason
    try:
        n, n_tokens = len(client.status), len(client.tokens)
        client.send_prompt({"prompt": "Say a lot.", "output": {"regex": "[ab]{1400}"}})  # a long answer
        client.wait_for(lambda: len(client.tokens) > n_tokens, 120, "the answer's first tokens")
        assert _running_on(server) == 1
        assert client.trigger("cancel").success
        final = client.wait_for(
            lambda: next((e for e in client.status[n:] if e["event"] == "finished"), None), 30, "the cancelled answer"
        )
        assert final["finish_reason"] == "cancelled" and final["metrics"]["generated_tokens"] < 1500
        deadline = time.monotonic() + 5.0
        while _running_on(server) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _running_on(server) == 0  # the closed connection stopped it
    finally:
        client.set_params({"max_new_tokens": MAX_NEW})
    assert client.ask("What can you do?", timeout=120)["status"]["event"] == "finished"


def test_diagnostics_report_the_server_and_the_model(vlm):
    node, client = vlm
    client.subscribe_diagnostics()
    status, values = client.node_diagnostics()
    assert values["engine.backend"] == "openai" and values["engine.remote_model"] == SERVED_NAME
    assert values["engine.server_reachable"] == "True" and values["engine.model_listed"] == "True"
    assert status.level == status.OK
    ready = next(line for line in node.output().splitlines() if "ready in" in line)
    assert f"server {values['engine.remote_url']}, model {SERVED_NAME}" in ready


# ---------------------------------------------------------------- faults of the network path (a TCP proxy)


@pytest.fixture(scope="module")
def proxied(server, tmp_path_factory):
    proxy = TcpProxy(("127.0.0.1", int(server.url.rsplit(":", 1)[1].split("/")[0])))
    params = {**defaults(), **FAST_PARAMS, "backend": "openai", "remote_url": proxy.url, "remote_model": SERVED_NAME,
              "remote_timeout_s": 1.5, "max_new_tokens": MAX_NEW}  # fmt: skip
    try:
        with running_node(params, tmp_path_factory.mktemp("proxied"), f"{__name__}.proxied") as (node, client):
            yield proxy, node, client
    finally:
        proxy.close()


def _one_terminal(client, answer: dict) -> dict:
    terminal = [e for e in answer["events"] if e["event"] in ("finished", "error", "dropped")]
    assert len(terminal) == 1, answer["events"]
    return terminal[0]


def test_server_errors_before_the_first_token_are_retried(proxied, local):
    proxy, _, client = proxied
    proxy.fault = Fault(status=503, body=b'{"error": {"message": "overloaded"}}', times=2)
    before = proxy.connections
    answer = client.ask("What can you do?", timeout=60)
    *_, want = local.generate(Request(Turn("What can you do?"), GREEDY))
    assert _one_terminal(client, answer)["event"] == "finished" and answer["response"] == want.text
    assert proxy.connections - before == 3  # two refusals, then the answer


def test_a_client_error_is_the_prompt_s_error_with_the_server_s_message(proxied):
    proxy, node, client = proxied
    proxy.fault = Fault(status=400, body=b'{"error": {"message": "this request is not valid"}}', times=1)
    before = proxy.connections
    final = _one_terminal(client, client.ask("Hello!", timeout=60))
    assert final["event"] == "error" and "400: this request is not valid" in final["error"]
    assert proxy.connections - before == 1 and node.alive()


def test_a_stream_cut_mid_answer_is_an_error_with_what_was_streamed(proxied):
    proxy, node, client = proxied
    proxy.fault = Fault(cut_after=4000, times=1)
    before = proxy.connections
    answer = client.ask({"prompt": "Say a lot.", "output": {"regex": "[ab]{30}"}}, timeout=60)
    final = _one_terminal(client, answer)
    assert final["event"] == "error" and ("stream" in final["error"]), final
    assert answer["tokens"] and proxy.connections - before == 1  # text came, and no retry after it
    assert client.ask("Hello!", timeout=60)["status"]["event"] == "finished" and node.alive()


def test_a_server_slower_than_the_timeout_is_an_error_and_a_refused_one_too(proxied):
    proxy, node, client = proxied
    proxy.fault = Fault(delay_s=4.0, times=5)
    final = _one_terminal(client, client.ask("Hello!", timeout=90))
    assert final["event"] == "error" and "timed out" in final["error"], final
    proxy.fault = Fault()
    proxy.refuse()
    try:
        final = _one_terminal(client, client.ask("Hello!", timeout=60))
        assert final["event"] == "error" and "unreachable" in final["error"], final
    finally:
        proxy.listen()
    assert client.ask("Hello!", timeout=60)["status"]["event"] == "finished" and node.alive()
