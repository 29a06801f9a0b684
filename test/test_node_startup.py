"""Starting the node the way `ros2 run` does (`python -m orin_vlm_node.ros.main --ros-args -p ...`):
a good checkpoint comes up and stops cleanly on SIGINT; a bad model_path or an invalid parameter
value ends the process with exit status 1 and a log line naming the problem."""

from __future__ import annotations

import pytest

pytest.importorskip("rclpy", reason="rclpy (ROS 2 wheels) is installed by `make test`")

from ros_harness import domain_id_for  # noqa: E402

from support.checkpoints import cached_tiny_checkpoint  # noqa: E402
from support.node_client import VlmClient  # noqa: E402
from support.node_process import NodeProcess  # noqa: E402


def start(tmp_path, *args: str) -> NodeProcess:
    return NodeProcess({}, tmp_path, domain_id_for(__name__), extra_args=list(args))


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["-p", "model_path:=/nonexistent/qwen3-vl"], "model_path '/nonexistent/qwen3-vl' is not a Hugging Face model"),
        (["-p", "page_size:=24"], "page_size must be a power of two"),
        (["-p", "channels:=[arm, arm/left]"], "channels entry 'arm/left' is not a channel name"),
    ],
    ids=["missing_model", "page_size", "channel_name"],
)
def test_bad_startup_parameters_exit_1_with_a_clear_error(tmp_path, args, expected):
    node = start(tmp_path, *args)
    rc = node.wait(timeout=120)
    output = node.output()
    node.stop()
    assert rc == 1, output
    assert "cannot start" in output and expected in output, output


def test_model_dir_without_weights_exits_1(tmp_path):
    broken = tmp_path / "broken_model"
    broken.mkdir()
    (broken / "config.json").write_text("{}")
    node = start(tmp_path / "run", "-p", f"model_path:={broken}")
    rc = node.wait(timeout=120)
    output = node.output()
    node.stop()
    assert rc == 1 and "cannot start" in output, output


def test_ros_run_style_start_with_namespace_and_remap_then_sigint(tmp_path):
    checkpoint = cached_tiny_checkpoint()
    args = ["-p", f"model_path:={checkpoint}", "-p", "max_new_tokens:=4", "-p", "device:=cpu"]
    client = VlmClient(domain_id_for(__name__), namespace="robot7", prompt_topic="question")  # listening first
    node = start(tmp_path, *args, "-r", "__ns:=/robot7", "-r", "prompt:=question")
    try:
        client.wait_until_connected(node, timeout=120)
        # The first status event says the node serves, on which attention path, with which KV pool.
        ready = client.wait_for(lambda: client.events(event="ready"), 10, "the ready event")[0]
        assert ready["note"].startswith("kernels: off (cpu device); decode: torch reference (dynamic step); KV pool:")
        assert client.status[0]["event"] == "ready"
        result = client.ask("Hello?")
        assert result["status"]["event"] == "finished" and result["status"]["metrics"]["generated_tokens"] <= 4
    finally:
        client.close()
        rc, elapsed = node.stop(timeout=5.0)
    assert rc == 0, node.output()
    assert elapsed < 5.0
    assert "ready in" in node.output()
