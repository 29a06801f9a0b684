"""The node with ``backend`` openai when the server is not there: it starts without it, says so in
``/diagnostics``, answers each prompt with an error event naming the cause, and uses the server once it comes
up, without a restart. Settings the server cannot honour are refused; settings that cannot work stop the
start with the reason. The server here is a scripted local one (``scripted_server``)."""

from __future__ import annotations

import pytest

pytest.importorskip("rclpy", reason="rclpy (ROS 2 wheels) is installed by `make test`")

from ros_harness import FAST_PARAMS, running_node  # noqa: E402
from scripted_server import scripted_server, sse  # noqa: E402

from orin_vlm_node.ros.params import defaults  # noqa: E402
from orin_vlm_node.ros.startup import StartupError, remote_startup  # noqa: E402
from support.vllm_server import free_port  # noqa: E402

REMOTE = {"backend": "openai", "remote_model": "m", "remote_timeout_s": 2.0}


@pytest.mark.parametrize(
    ("changes", "reason"),
    [
        ({"remote_url": "http://127.0.0.1:1/v1", "remote_model": ""}, "needs remote_model"),
        ({"remote_url": "gpu-box:8000"}, "must be an http:// or https:// URL"),
        ({"remote_url": "http://gpu-box:8000/v1", "remote_api_key_env": "ORIN_VLM_TEST_UNSET_KEY"},
         "ORIN_VLM_TEST_UNSET_KEY, which is not set"),
    ],
)  # fmt: skip
def test_settings_that_cannot_work_stop_the_start_with_the_reason(changes, reason, monkeypatch):
    monkeypatch.delenv("ORIN_VLM_TEST_UNSET_KEY", raising=False)
    with pytest.raises(StartupError, match=reason):
        remote_startup({**defaults(), **REMOTE, **changes})


def test_a_server_that_is_down_then_up_is_used_without_a_restart(tmp_path):
    port = free_port()
    params = {**defaults(), **FAST_PARAMS, **REMOTE, "remote_url": f"http://127.0.0.1:{port}/v1"}
    with running_node(params, tmp_path, __name__) as (node, client):
        client.subscribe_diagnostics()
        status, values = client.node_diagnostics(20, lambda values: values.get("engine.server_reachable") == "False")
        assert status.level == status.WARN and "unreachable" in values["engine.server_problem"]
        down = client.ask("Hello!", timeout=60)["status"]
        assert down["event"] == "error" and "unreachable" in down["error"], down
        (refused,) = client.set_params({"use_cuda_graph": False})
        assert not refused.successful and "with backend openai the server decides" in refused.reason
        with scripted_server(port) as (script, _):
            script.models = ["m"]
            answer = {"choices": [{"delta": {"content": "Hi there."}, "finish_reason": "stop"}]}
            usage = {"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 3}}
            script.chunks = sse(answer, usage, "[DONE]")
            up = client.ask("Hello!", timeout=60)
            assert up["status"]["event"] == "finished" and up["response"] == "Hi there.", up["status"]
            assert up["status"]["metrics"]["prompt_tokens"] == 9 and up["status"]["metrics"]["generated_tokens"] == 3
            client.node_diagnostics(20, lambda values: values.get("engine.server_reachable") == "True")
        assert node.alive()
