"""The node end to end: a separate ``orin_vlm`` process with a tiny random Qwen3-VL checkpoint, driven
over real DDS (localhost discovery, a private ROS_DOMAIN_ID) from rclpy in this process.

One node serves the whole module (loading it costs seconds); tests that change parameters put them
back. Answers of random weights are noise text, which is fine: they are compared with the engine run
in this process on the same input, never with hard-coded strings.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

pytest.importorskip("rclpy", reason="rclpy (ROS 2 wheels) is installed by `make test`")

import cv2  # noqa: E402
from builtin_interfaces.msg import Time  # noqa: E402
from ros_harness import FAST_PARAMS, running_node  # noqa: E402
from sensor_msgs.msg import CompressedImage, Image  # noqa: E402

from orin_vlm_node.engine import Engine, Finished, Request, TextDelta, Turn  # noqa: E402
from orin_vlm_node.ros.image import rgb_to_image_msg  # noqa: E402
from orin_vlm_node.ros.params import defaults, engine_config, sampling_params  # noqa: E402
from support.checkpoints import cached_tiny_checkpoint  # noqa: E402

PARAMS = {**FAST_PARAMS, "device": "cpu", "max_queue": 4}
QUESTION = "Describe this image."
# Without an image, the tiny checkpoint's greedy answer to QUESTION runs to max_new_tokens (checked by
# test_long_prompt_really_is_long), which the cancel and shutdown tests rely on.
LONG_PROMPT = QUESTION
STAMP = Time(sec=1234, nanosec=500_000_000)
RGB = np.random.default_rng(7).integers(0, 256, size=(64, 96, 3), dtype=np.uint8)


@pytest.fixture(scope="module")
def checkpoint():
    return cached_tiny_checkpoint()


@pytest.fixture(scope="module")
def values(checkpoint):
    """The node's parameter values, as the node sees them."""
    return {**defaults(), **PARAMS, "model_path": str(checkpoint)}


@pytest.fixture(scope="module")
def vlm(values, tmp_path_factory):
    with running_node(values, tmp_path_factory.mktemp("node"), __name__) as (node, client):
        yield node, client


@pytest.fixture(scope="module")
def reference(values):
    """The engine in this process, configured from the same parameter values as the node, on one
    torch thread like the node (ros_harness) so both reduce in the same order."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    engine = Engine(engine_config(values))

    def answer(text: str, image: np.ndarray | None, **overrides) -> tuple[Finished, list[str]]:
        request = Request(
            turn=Turn(text=text, images=(image,) if image is not None else ()),
            sampling=sampling_params({**values, **overrides}),
            request_id=f"ref-{time.monotonic_ns()}",
        )
        deltas, final = [], None
        for event in engine.generate(request):
            if isinstance(event, TextDelta):
                deltas.append(event.text)
            elif isinstance(event, Finished):
                final = event
        assert final is not None and final.finish_reason in ("stop", "length"), final
        return final, deltas

    yield answer
    torch.set_num_threads(threads)


def image_msg(rgb: np.ndarray = RGB) -> Image:
    return rgb_to_image_msg(rgb, Image, stamp=STAMP)


def set_ok(client, values: dict) -> None:
    """Set parameters and wait until the node applied them (engine ones publish `reconfigured`)."""
    before = len(client.events(event="reconfigured"))
    results = client.set_params(values)
    assert all(r.successful for r in results), [r.reason for r in results]
    engine_side = {"use_paged_attention", "page_size", "kv_pool_mb", "kv_pool_blocks", "prefix_caching"}
    if engine_side & set(values):
        client.wait_for(
            lambda: len([e for e in client.status if e["event"] == "reconfigured"]) > before, 30, "reconfigured"
        )


def test_image_and_prompt_stream_tokens_that_add_up_to_the_response(vlm):
    _, client = vlm
    client.publish_image(image_msg())
    result = client.ask(QUESTION)
    assert [e["event"] for e in result["events"]] == ["accepted", "started", "finished"]
    final = result["status"]
    assert final["finish_reason"] in ("stop", "length")
    assert final["image_stamp"] == pytest.approx(1234.5)
    assert result["events"][0]["image_stamp"] == pytest.approx(1234.5)
    assert len(result["tokens"]) >= 1 and "".join(result["tokens"]) == result["response"]
    metrics = final["metrics"]
    assert metrics["generated_tokens"] >= 1 and metrics["ttft_s"] > 0 and "queue_wait_s" in metrics
    assert metrics["prompt_tokens"] > 10  # the image pads are part of the prompt


def test_greedy_answer_equals_the_engine_in_process(vlm, reference, values):
    """The same answer; with ``token_publish_period_ms`` 0 the same deltas, one message each."""
    _, client = vlm
    set_ok(client, {"token_publish_period_ms": 0})
    try:
        client.publish_image(image_msg())
        node_answer = client.ask(QUESTION)
    finally:
        set_ok(client, {"token_publish_period_ms": values["token_publish_period_ms"]})
    final, deltas = reference(QUESTION, RGB)
    assert node_answer["response"] == final.text
    assert node_answer["tokens"] == [d for d in deltas if d]


def test_tokens_are_coalesced_to_one_message_per_period(vlm, values):
    """A long answer under a long period: the first delta goes out at once, the rest joined, at most one
    message per period, and the messages still add up to the response."""
    _, client = vlm
    period_s = 0.5
    set_ok(client, {"token_publish_period_ms": int(period_s * 1000), "max_new_tokens": 64})
    try:
        t0 = time.monotonic()
        result = client.ask(LONG_PROMPT)
        elapsed = time.monotonic() - t0
    finally:
        set_ok(client, {k: values[k] for k in ("token_publish_period_ms", "max_new_tokens")})
    assert "".join(result["tokens"]) == result["response"]
    assert result["status"]["metrics"]["generated_tokens"] == 64
    assert 2 <= len(result["tokens"]) <= 2 + elapsed / period_s  # 64 deltas in a few messages


def test_stale_image_is_ignored_with_a_note(vlm, reference):
    _, client = vlm
    set_ok(client, {"image_max_age_s": 0.3})
    try:
        client.publish_image(image_msg())
        time.sleep(0.6)
        result = client.ask(QUESTION)
        accepted = result["events"][0]
        assert accepted["event"] == "accepted" and accepted["image_stamp"] is None
        assert "image ignored" in accepted["note"] and "image_max_age_s=0.3" in accepted["note"]
        assert result["response"] == reference(QUESTION, None)[0].text  # answered text-only
    finally:
        set_ok(client, {"image_max_age_s": PARAMS["image_max_age_s"]})


def test_paging_off_gives_the_same_greedy_answer(vlm, reference):
    node, client = vlm
    expected = reference(QUESTION, RGB)[0].text
    set_ok(client, {"use_paged_attention": False})
    try:
        changes = client.events(event="reconfigured")[-1]["changes"]
        assert changes == {"use_paged_attention": False}
        # The engine's own log line (Python logging of a ROS-free layer) is in the node's ROS log, once; so is
        # the new pool, made once (the plans that checked the change before it was applied are not logged).
        log = node.output().splitlines()
        assert sum("[orin_vlm]: engine reconfigured: use_paged_attention=False" in line for line in log) == 1
        applied = max(i for i, line in enumerate(log) if "engine reconfigured" in line)
        before = max(i for i, line in enumerate(log[:applied]) if "engine reconfigured" in line or "ready in" in line)
        assert sum("[orin_vlm]: KV pool:" in line for line in log[before:applied]) == 1, log[before:applied]
        assert client.get_params(["use_paged_attention"]) == {"use_paged_attention": False}
        client.publish_image(image_msg())
        assert client.ask(QUESTION)["response"] == expected
    finally:
        set_ok(client, {"use_paged_attention": True})
    set_ok(client, {"page_size": 32})
    try:
        client.publish_image(image_msg())
        assert client.ask(QUESTION)["response"] == expected
    finally:
        set_ok(client, {"page_size": 16})


@pytest.mark.parametrize(
    ("name", "value", "reason"),
    [
        ("page_size", 24, "page_size must be a power of two"),
        ("page_size", 512, ""),  # outside the descriptor's range: refused by rclpy itself
        ("dtype", "int8", "dtype must be one of auto, bf16, fp16, fp32"),
        ("device", "tpu", "device must be one of auto, cuda, cpu"),
        ("kv_pool_blocks", 1, "KV pool too small"),
        ("kv_pool_mb", 262144, "does not fit"),  # more than this machine's free memory, refused when set
        ("kernel_dir", "/nonexistent/kernels", "kernel_dir '/nonexistent/kernels' does not exist"),
        ("model_path", "/somewhere/else", "read-only"),
        ("image_min_pixels", 10**7, "image_min_pixels"),
        ("top_p", 0.0, "top_p must be in (0, 1]"),  # the engine's sampling check, at set time
    ],
)
def test_invalid_values_are_refused_with_a_reason(vlm, name, value, reason):
    _, client = vlm
    before = client.get_params([name])
    overrides = {"image_max_pixels": 10**6} if name == "image_min_pixels" else {}
    if overrides:
        set_ok(client, overrides)
    try:
        (result,) = client.set_params({name: value})
        assert not result.successful
        assert reason in result.reason
        assert client.get_params([name]) == before
    finally:
        if overrides:
            set_ok(client, {"image_max_pixels": 0})


def test_device_cuda_without_cuda_is_refused(vlm):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: device cuda is valid here")
    _, client = vlm
    (result,) = client.set_params({"device": "cuda"})
    assert not result.successful and "CUDA is not available" in result.reason


def test_multi_turn_keeps_history_until_reset(vlm):
    _, client = vlm
    set_ok(client, {"multi_turn": True, "image_max_age_s": 0.0})
    try:
        first = client.ask("What is on the table?")["status"]["metrics"]
        second = client.ask("And behind it?")["status"]["metrics"]
        # The second turn runs on the whole conversation; its history comes from the session cache.
        assert second["prompt_tokens"] > first["prompt_tokens"]
        assert second["prefix_hit_tokens"] >= first["prompt_tokens"]
        reply = client.trigger("reset")
        assert reply.success and "reset" in reply.message
        fresh = client.ask("And behind it?")["status"]["metrics"]
        assert fresh["prompt_tokens"] < second["prompt_tokens"]
    finally:
        set_ok(client, {"multi_turn": False, "image_max_age_s": PARAMS["image_max_age_s"]})


def test_long_prompt_really_is_long(reference):
    final, _ = reference(LONG_PROMPT, None, max_new_tokens=64)
    assert final.finish_reason == "length", "pick another LONG_PROMPT: this one stops early with this checkpoint"


def test_cancel_stops_the_running_prompt_and_drops_waiting_ones(vlm):
    _, client = vlm
    set_ok(client, {"max_new_tokens": 3000, "max_context_tokens": 4096, "image_max_age_s": 0.0})
    try:
        known = {e["request_id"] for e in client.status}
        client.send_prompt(LONG_PROMPT)
        client.send_prompt("A second question that will wait.")
        started = client.wait_for(
            lambda: next((e for e in client.status if e["event"] == "started" and e["request_id"] not in known), None),
            30,
            "the long prompt to start",
        )
        n_tokens = len(client.tokens)
        client.wait_for(lambda: len(client.tokens) > n_tokens, 30, "tokens of the long prompt")
        reply = client.trigger("cancel")
        assert reply.success and started["request_id"] in reply.message and "dropped 1" in reply.message
        final = client.wait_for(
            lambda: next(
                (e for e in client.status if e["request_id"] == started["request_id"] and e["event"] == "finished"),
                None,
            ),
            30,
            "the cancelled prompt to finish",
        )
        assert final["finish_reason"] == "cancelled"
        assert final["metrics"]["generated_tokens"] < 3000
        events = [(e["event"], e["request_id"]) for e in client.status if e["request_id"] not in known]
        dropped = [e for e in client.status if e["event"] == "dropped" and e["request_id"] not in known]
        assert len(dropped) == 1 and "cancelled" in dropped[0]["note"]
        # the waiting prompt is dropped before the running one ends: the worker never takes it up
        assert events.index(("dropped", dropped[0]["request_id"])) < events.index(("finished", final["request_id"]))
        assert ("started", dropped[0]["request_id"]) not in events
    finally:
        set_ok(client, {"max_new_tokens": PARAMS["max_new_tokens"], "image_max_age_s": PARAMS["image_max_age_s"]})
    assert client.ask(QUESTION)["status"]["event"] == "finished"  # still answering


def test_a_setting_changed_twice_while_a_prompt_runs_takes_the_last_value(vlm, reference):
    """Engine settings wait for the running prompt; a second change of the same one replaces the first
    (it once crashed the node: both went to the engine's check as the same keyword)."""
    node, client = vlm
    expected = reference(QUESTION, RGB)[0].text
    set_ok(client, {"max_new_tokens": 3000, "image_max_age_s": 0.0})
    try:
        n = len(client.status)
        client.send_prompt(LONG_PROMPT)
        client.wait_for(lambda: any(e["event"] == "started" for e in client.status[n:]), 30, "the long prompt")
        for values in ({"page_size": 32, "prefix_caching": False}, {"page_size": 8}, {"prefix_caching": True}):
            assert all(r.successful for r in client.set_params(values)), values
        assert not [e for e in client.status[n:] if e["event"] == "reconfigured"]  # they wait for the prompt
        client.trigger("cancel")
        event = client.wait_for(
            lambda: next((e for e in client.status[n:] if e["event"] == "reconfigured"), None), 30, "reconfigured"
        )
        assert event["changes"] == {"page_size": 8}  # prefix_caching went off and back on: no change
        assert client.get_params(["page_size", "prefix_caching"]) == {"page_size": 8, "prefix_caching": True}
        assert node.alive()
    finally:
        set_ok(client, {"page_size": 16, "max_new_tokens": PARAMS["max_new_tokens"]})
        set_ok(client, {"image_max_age_s": PARAMS["image_max_age_s"]})
    client.publish_image(image_msg())
    assert client.ask(QUESTION)["response"] == expected


def test_burst_of_20_prompts_respects_the_queue_bound(vlm):
    node, client = vlm
    max_queue = PARAMS["max_queue"]
    known = {e["request_id"] for e in client.status}
    for i in range(20):
        client.send_prompt(f"Question number {i}?")

    def ended() -> dict | None:
        new = [e for e in client.status if e["request_id"] and e["request_id"] not in known]
        done = {e["request_id"]: e["event"] for e in new if e["event"] in ("finished", "dropped", "error")}
        return done if len(done) == 20 else None

    done = client.wait_for(ended, 120, "all 20 prompts to end")
    assert set(done.values()) <= {"finished", "dropped"}
    assert "dropped" in done.values() and "finished" in done.values()
    # Replay the status stream (one publisher, so in order): the waiting set never exceeds the bound
    # once an overflow has been resolved, and a drop always takes the oldest waiting prompt.
    waiting: list[str] = []
    for e in (e for e in client.status if e["request_id"] and e["request_id"] not in known):
        if e["event"] == "accepted":
            waiting.append(e["request_id"])
            assert len(waiting) <= max_queue + 1
        elif e["event"] == "dropped":
            assert e["request_id"] == waiting[0], "a drop must evict the oldest waiting prompt"
            waiting.pop(0)
            assert len(waiting) <= max_queue
            assert "queue full" in e["note"]
            assert f"{e['request_id']} dropped: {e['note']}" in node.output()  # and in the log
        elif e["event"] == "started":
            waiting.remove(e["request_id"])
            assert len(waiting) <= max_queue
    assert waiting == []


def test_good_compressed_image_is_used(vlm, reference):
    _, client = vlm
    ok, png = cv2.imencode(".png", RGB[:, :, ::-1])
    assert ok
    msg = CompressedImage(format="png")
    msg.header.stamp = Time(sec=99, nanosec=0)
    msg.data = png.tobytes()
    client.publish_compressed(msg)
    result = client.ask(QUESTION)
    assert result["status"]["image_stamp"] == pytest.approx(99.0)
    assert result["response"] == reference(QUESTION, RGB)[0].text  # PNG is lossless: same pixels, same answer


def test_diagnostics_report_the_engine(vlm):
    node, client = vlm
    client.subscribe_diagnostics()
    status, values = client.node_diagnostics()
    assert values["state"] in ("idle", "generating")
    assert values["engine.device"] == "cpu" and values["engine.paged_attention"] == "True"
    assert int(values["requests_completed"]) >= 1 and float(values["last_ttft_s"]) > 0
    for key in ("engine.kv_blocks_total", "engine.kv_blocks_used", "engine.decode_path", "last_decode_tokens_per_s"):
        assert key in values
    # The attention path and the pool size, with their reasons, here and in the startup log.
    assert values["engine.kernels"] == "kernels: off (cpu device)" and status.level == status.OK
    assert "(auto: 1 x 4096-token context + 25% prefix-cache share)" in values["engine.kv_pool"]
    ready = next(line for line in node.output().splitlines() if "ready in" in line)
    assert "kernels: off (cpu device); decode: torch reference (dynamic step); KV pool:" in ready


def test_sigint_stops_the_node_within_5_s_even_while_generating(vlm):
    """Runs last in this module: it stops the shared node."""
    node, client = vlm
    set_ok(client, {"max_new_tokens": 3000, "image_max_age_s": 0.0})
    n = len(client.status)
    client.send_prompt(LONG_PROMPT)
    client.wait_for(lambda: any(e["event"] == "started" for e in client.status[n:]), 30, "generation to start")
    rc, elapsed = node.stop(timeout=5.0)
    assert rc == 0, node.output()[-2000:]
    assert elapsed < 5.0
