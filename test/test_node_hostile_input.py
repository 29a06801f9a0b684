"""The node under hostile input and rough handling, end to end over real DDS (a separate node process, as in
test_node_integration): a decompression bomb, a burst of prompts far beyond the queue, large raw frames from a
reliable publisher, values refused when set rather than after, frames and prompts the node cannot use (each
an error event, the node answering on), and stops by signal while generating or while starting. Every prompt
that reaches the node gets exactly one terminal event."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("rclpy", reason="rclpy (ROS 2 wheels) is installed by `make test`")

import cv2  # noqa: E402
from builtin_interfaces.msg import Time  # noqa: E402
from ros_harness import FAST_PARAMS, domain_id_for, running_node  # noqa: E402
from sensor_msgs.msg import CompressedImage, Image  # noqa: E402

from orin_vlm_node.ros.image import rgb_to_image_msg  # noqa: E402
from orin_vlm_node.ros.params import defaults  # noqa: E402
from support.checkpoints import cached_tiny_checkpoint  # noqa: E402
from support.image_bomb import png_bomb  # noqa: E402
from support.node_process import NodeProcess, compiler_of, processes  # noqa: E402

PARAMS = {**FAST_PARAMS, "device": "cpu", "max_queue": 4, "max_new_tokens": 4}
TERMINAL = ("finished", "dropped", "error")
LONG_PROMPT = "Describe this image."  # runs to max_new_tokens with the tiny checkpoint (test_node_integration)
QUESTION = "Describe this image."
RGB = np.random.default_rng(7).integers(0, 256, size=(64, 96, 3), dtype=np.uint8)
STAMP = Time(sec=1234, nanosec=500_000_000)


@pytest.fixture(scope="module")
def values():
    return {**defaults(), **PARAMS, "model_path": str(cached_tiny_checkpoint())}


@pytest.fixture(scope="module")
def vlm(values, tmp_path_factory):
    with running_node(values, tmp_path_factory.mktemp("node"), __name__) as (node, client):
        yield node, client


def image_msg() -> Image:
    return rgb_to_image_msg(RGB, Image, stamp=STAMP)


def peak_rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmHWM in /proc status")


def new_events(client, known: set) -> list[dict]:
    return [e for e in client.status if e["request_id"] and e["request_id"] not in known]


def test_decompression_bomb_is_refused_with_bounded_memory(vlm):
    node, client = vlm
    before = peak_rss_mb(node.proc.pid)
    msg = CompressedImage(format="png")
    msg.data = png_bomb()
    n = len(client.status)
    client.publish_compressed(msg)
    error = client.wait_for(
        lambda: next((e for e in client.status[n:] if e["event"] == "error"), None), 30, "the bomb's error event"
    )
    assert "image too large: 30000x30000" in error["error"] and "image_max_input_pixels" in error["error"]
    assert peak_rss_mb(node.proc.pid) - before < 200  # decoding it would take 900 MB and more
    assert client.ask("What is this?")["status"]["event"] == "finished"


def test_a_burst_of_500_prompts_gets_one_terminal_event_each(vlm):
    _, client = vlm
    known = {e["request_id"] for e in client.status}
    for i in range(500):
        client.send_prompt(f"Question {i}?")

    def ended() -> dict | None:
        done: dict[str, list[str]] = {}
        for e in new_events(client, known):
            if e["event"] in TERMINAL:
                done.setdefault(e["request_id"], []).append(e["event"])
        return done if len(done) == 500 else None

    done = client.wait_for(ended, 180, "500 terminal events")
    time.sleep(1.0)  # any duplicate would arrive by now
    done = ended()
    assert done is not None and all(len(events) == 1 for events in done.values())
    accepted = [e for e in new_events(client, known) if e["event"] == "accepted"]
    assert len(accepted) == 500


def test_large_raw_frames_from_a_reliable_publisher_are_used(vlm):
    """A 1280x720 rgb8 frame is 2.7 MB in hundreds of fragments: the node subscribes reliable to a reliable
    publisher (image_reliability auto), so every frame arrives whole: each one published once is used."""
    node, client = vlm
    client.wait_for(lambda: "image subscription /image: now reliable" in node.output(), 10, "a reliable subscription")
    rgb = np.random.default_rng(3).integers(0, 256, size=(720, 1280, 3), dtype=np.uint8)
    for n in range(3):
        client.publish_image(rgb_to_image_msg(rgb, Image, stamp=Time(sec=720 + n, nanosec=0)), repeat=1)
        time.sleep(1.0)  # 2.7 MB through the loopback
        result = client.ask("What do you see?")
        assert result["status"].get("image_stamp") == pytest.approx(720.0 + n), result["status"]
        assert result["status"]["metrics"]["prompt_tokens"] > 20  # the image pads are part of the prompt


@pytest.mark.parametrize(
    ("name", "value", "reason"),
    [
        ("kv_pool_blocks", 16_777_216, "does not fit"),
        ("kv_pool_mb", 262_144, "does not fit"),
        ("max_context_tokens", 16, "leaves no room for a question"),
    ],
)
def test_values_that_cannot_work_are_refused_when_set(vlm, name, value, reason):
    _, client = vlm
    overrides = {"system_prompt": "You are the robot's eyes. Answer in one short sentence."}
    if name == "max_context_tokens":
        (ok,) = client.set_params(overrides)
        assert ok.successful, ok.reason
    try:
        before = client.get_params([name])
        n = len(client.status)
        (result,) = client.set_params({name: value})
        assert not result.successful and reason in result.reason
        assert client.get_params([name]) == before
        assert client.ask("Still there?")["status"]["event"] == "finished"
        assert not [e for e in client.status[n:] if e["event"] == "error"]
    finally:
        client.set_params({"system_prompt": ""})


def _long_generation(client, queued: int) -> tuple[str, list[str]]:
    """Start an endless answer and queue ``queued`` prompts behind it; (running id, queued ids)."""
    known = {e["request_id"] for e in client.status}
    client.send_prompt(LONG_PROMPT)
    for i in range(queued):
        client.send_prompt(f"Waiting question {i}?")
    started = client.wait_for(
        lambda: next((e for e in new_events(client, known) if e["event"] == "started"), None), 30, "generation"
    )
    client.wait_for(
        lambda: len([e for e in new_events(client, known) if e["event"] == "accepted"]) == queued + 1, 30, "accepts"
    )
    n_tokens = len(client.tokens)
    client.wait_for(lambda: len(client.tokens) > n_tokens, 30, "tokens")
    waiting = [e["request_id"] for e in new_events(client, known) if e["event"] == "accepted"]
    waiting.remove(started["request_id"])
    return started["request_id"], waiting


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_while_generating_ends_every_prompt_then_exits_0(values, tmp_path, sig):
    params = {**values, "max_new_tokens": 3000, "image_max_age_s": 0.0}
    with running_node(params, tmp_path, f"{__name__}-{sig.name}") as (node, client):
        running, waiting = _long_generation(client, queued=2)
        node.signal_group(sig)
        rc = node.wait(10.0)
        assert rc == 0, node.output()[-3000:]
        ends = {e["request_id"]: e for e in client.status if e["event"] in TERMINAL}
        assert ends[running]["event"] == "finished" and ends[running]["finish_reason"] == "cancelled"
        assert f"{sig.name} received" in ends[running]["note"]
        assert all(ends[rid]["event"] == "dropped" and "shutting down" in ends[rid]["note"] for rid in waiting)
        output = node.output()
        assert "Traceback" not in output and "context is invalid" not in output, output[-3000:]


@pytest.mark.parametrize("delay_s", [0.3, 1.5, 3.0])
def test_sigint_while_starting_exits_0_with_one_line(values, tmp_path, delay_s):
    """Whether the signal lands while Python imports torch, while the model loads or just after: exit 0, no
    traceback."""
    node = NodeProcess(values, tmp_path, domain_id_for(f"{__name__}-start-{delay_s}"))
    try:
        time.sleep(delay_s)
        node.signal_group(signal.SIGINT)
        rc = node.wait(20.0)
    finally:
        node.stop()
    output = node.output()
    assert rc == 0, output[-3000:]
    assert "Traceback" not in output and "KeyboardInterrupt" not in output, output[-3000:]
    if delay_s < 1.0:  # surely before the node served
        assert "SIGINT during startup: stopped before serving" in output


@contextlib.contextmanager
def compiling_node(values, tmp_path: Path, salt: str) -> Iterator[tuple[NodeProcess, int]]:
    """A node on its first start, with nothing cached, once it compiles its CPU library: (node, the compiler's
    pid, a child of the node and the leader of the compile's process group); the node stopped after."""
    env = {"XDG_CACHE_HOME": str(tmp_path / "cache")}  # nothing cached: this start compiles
    node = NodeProcess(values, tmp_path, domain_id_for(f"{__name__}-{salt}"), env={**os.environ, **env})
    try:
        compiler = compiler_of(node, "cpu_gemm")
        assert compiler is not None, "the node never compiled its CPU library: " + node.output()[-2000:]
        yield node, compiler
    finally:
        node.stop()


def test_a_stop_while_the_kernels_compile_stops_the_compilers_too(values, tmp_path):
    """A first start compiles the node's kernels (the CPU library here; on a Jetson nvcc's modules, a minute of
    it before this release). A stop signal then ends the node at once and the compilers with everything they
    started: none runs on in the background."""
    with compiling_node(values, tmp_path, "compiling") as (node, compiler):
        node.proc.send_signal(signal.SIGINT)  # to the node alone, as ros2 launch stops it
        rc = node.wait(20.0)
    # the node's session (NodeProcess starts one) and the compiler's own: nothing of either is left
    left = [cmd for _, _, session, cmd in processes() if session in (node.proc.pid, compiler)]
    assert not left, f"left running: {left}"
    output = node.output()
    assert rc == 0 and "SIGINT during startup: stopped before serving (1 kernel build(s) stopped)" in output, output
    assert not list((tmp_path / "cache").rglob("*.so.cache"))  # nothing half-built was cached


def test_a_node_killed_while_the_kernels_compile_leaves_no_compiler(values, tmp_path):
    """SIGKILL (the OOM killer, a launch file's escalation) runs none of the node's code: the compiler's guard
    sees its node die and ends the compile with all it started, and removes the build's folder."""
    with compiling_node(values, tmp_path, "killed") as (node, compiler):
        command = next(cmd for pid, _, _, cmd in processes() if pid == compiler).split()
        folder = Path(command[command.index("-o") + 1]).parent  # the build's, where the compilers write
        node.proc.send_signal(signal.SIGKILL)
        node.wait(20.0)
        deadline = time.monotonic() + 2  # the compile itself takes longer (8 s here)
        while (left := [cmd for _, _, sid, cmd in processes() if sid == compiler]) and time.monotonic() < deadline:
            time.sleep(0.05)
    assert not left, f"left running: {left}"
    assert folder.name.startswith("orin_vlm_build_") and not folder.exists()


@pytest.mark.parametrize(
    ("text", "problem"),
    [("abc\x00def", "NUL character at position 3"), ("  \n", "empty prompt"), ("What is this?", None)],
)
def test_prompts_with_nul_are_refused_not_truncated(text, problem):
    """rclpy itself cuts a published string at a NUL; other clients (C++) can deliver one."""
    from orin_vlm_node.ros.startup import prompt_problem

    reason = prompt_problem(text)
    assert (reason is None) if problem is None else (problem in reason)


def _corrupt_compressed() -> CompressedImage:
    msg = CompressedImage(format="jpeg")
    msg.data = b"\xff\xd8\xff\xe0 this is not a jpeg" * 4
    return msg


def _wrong_encoding() -> Image:
    msg = image_msg()
    msg.encoding = "yuv422"
    return msg


def _step_mismatch() -> Image:
    msg = image_msg()
    msg.step = msg.step + 8  # rows claim padding the data does not have
    return msg


def _empty_image() -> Image:
    return Image(height=0, width=0, encoding="rgb8", step=0)


@pytest.mark.parametrize(
    ("make", "expected"),
    [
        (_corrupt_compressed, "compressed image rejected: cannot decode"),
        (_wrong_encoding, "unsupported image encoding 'yuv422'"),
        (_step_mismatch, "but step*height"),
        (_empty_image, "empty image: 0x0"),
    ],
    ids=["corrupt_compressed", "wrong_encoding", "step_mismatch", "zero_size"],
)
def test_bad_images_give_error_events_and_the_node_keeps_answering(vlm, make, expected):
    """A frame whose sizes or header are wrong is reported on arrival; one that only decoding finds corrupt
    when a prompt takes it (frames are decoded only then), and that prompt is answered without it."""
    node, client = vlm
    msg = make()
    before = len(client.status)
    if isinstance(msg, CompressedImage):
        client.publish_compressed(msg)
    else:
        client.publish_image(msg, repeat=2)

    def error_event() -> dict | None:
        return next((e for e in client.status[before:] if e["event"] == "error" and expected in e["error"]), None)

    deadline = time.monotonic() + 20
    while (error := error_event()) is None:  # ask until the frame has arrived and been taken
        assert time.monotonic() < deadline, f"no error event with {expected!r}"
        result = client.ask(QUESTION)
        assert result["status"]["event"] == "finished"
        if error_event() is None:
            time.sleep(0.5)
    assert error["request_id"] is None  # image errors belong to no prompt
    assert node.alive()
    assert client.ask(QUESTION)["status"]["event"] == "finished"


def test_a_frame_only_decoding_finds_corrupt_is_reported_when_a_prompt_takes_it(vlm):
    """A PNG whose header is sound and whose pixel data is not: kept on arrival (frames are decoded only
    when a prompt takes them), then rejected with an error event, the prompt answered without it and its
    note saying why; the next good frame is used again."""
    node, client = vlm
    ok, png = cv2.imencode(".png", RGB[:, :, ::-1])
    assert ok
    data = bytearray(png.tobytes())
    idat = data.find(b"IDAT")
    data[idat + 8 : idat + 40] = bytes(b ^ 0xFF for b in data[idat + 8 : idat + 40])
    msg = CompressedImage(format="png")
    msg.header.stamp = Time(sec=77, nanosec=0)
    msg.data = bytes(data)
    before = len(client.status)
    client.publish_compressed(msg)
    expected = "compressed image rejected: cannot decode compressed image (png"
    deadline = time.monotonic() + 20
    while True:  # ask until the frame has arrived and a prompt has taken it
        result = client.ask(QUESTION)
        if expected in (result["status"].get("note") or ""):
            break
        assert time.monotonic() < deadline, "no prompt took the corrupt frame"
        time.sleep(0.5)
    assert result["status"]["event"] == "finished" and result["status"]["image_stamp"] is None
    errors = [e for e in client.status[before:] if e["event"] == "error" and expected in e["error"]]
    assert errors and errors[0]["request_id"] is None and errors[0]["image_stamp"] == pytest.approx(77.0)
    assert expected in node.output()  # logged too
    client.publish_image(image_msg())
    assert client.wait_for(
        lambda: (r := client.ask(QUESTION))["status"]["image_stamp"] == pytest.approx(1234.5) and r, 20, "a good frame"
    )


@pytest.mark.parametrize(
    ("text", "expected"), [("", "empty prompt"), ("   \n", "empty prompt"), ("x" * 1_000_000, "too long")]
)
def test_bad_prompts_give_error_events_and_the_node_keeps_answering(vlm, text, expected):
    node, client = vlm
    result = client.ask(text, timeout=120)
    assert result["status"]["event"] == "error" and result["status"]["finish_reason"] == "error"
    assert expected in result["status"]["error"]
    line = f"{result['status']['request_id']}: {result['status']['error']}"  # the log says it too
    client.wait_for(lambda: line in node.output(), 10, f"the log line {line!r}")
    assert node.alive()
    assert client.ask(QUESTION)["status"]["event"] == "finished"
