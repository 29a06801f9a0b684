"""launch_testing: the node started through ``launch/orin_vlm.launch.py`` (namespace, topic remaps,
launch-argument overrides on top of the params file), then the main scenarios over DDS: image +
prompt -> streamed tokens adding up to the response, runtime parameters (paging off gives the same
greedy answer; an invalid page size is refused with its reason), the reset and cancel services, and a
clean exit when launch shuts the node down.

Needs a ROS 2 install with launch_testing/launch_ros and the installed package (``colcon test``); the
PyPI wheels CI uses have neither, so the module skips there. Run it with
``launch_test test/test_orin_vlm_launch.py`` or ``colcon test --packages-select orin_vlm_node``.
"""

from __future__ import annotations

import os
import sys
import tempfile
import unittest
from pathlib import Path

import pytest

# launch_test runs this file without pytest's configuration (pyproject's pythonpath): the shared test
# harness `support` lives at the checkout root.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
pytest.importorskip("launch_testing", reason="launch_testing comes with a ROS 2 install only")
pytest.importorskip("launch_ros", reason="launch_ros comes with a ROS 2 install only")

import launch_testing.actions  # noqa: E402
import launch_testing.asserts  # noqa: E402
import numpy as np  # noqa: E402
from launch.actions import IncludeLaunchDescription  # noqa: E402
from launch.launch_description_sources import PythonLaunchDescriptionSource  # noqa: E402
from sensor_msgs.msg import Image  # noqa: E402

from launch import LaunchDescription  # noqa: E402
from orin_vlm_node.ros.image import rgb_to_image_msg  # noqa: E402
from support.node_client import VlmClient  # noqa: E402

LAUNCH_FILE = Path(__file__).resolve().parent.parent / "launch" / "orin_vlm.launch.py"
NAMESPACE = "launch_test"
IMAGE_TOPIC = "camera/image_raw"
PROMPT_TOPIC = "question"
QUESTION = "Describe this image."
RGB = np.random.default_rng(7).integers(0, 256, size=(64, 96, 3), dtype=np.uint8)


def _model_path() -> str:
    """A tiny random checkpoint when transformers is there to build one, else the embedded model."""
    try:
        from support.checkpoints import make_tiny_checkpoint
    except ImportError:
        return ""
    return str(make_tiny_checkpoint(Path(tempfile.mkdtemp(prefix="launch_test_")) / "ckpt"))


@pytest.mark.launch_test
def generate_test_description():
    os.environ["ROS_AUTOMATIC_DISCOVERY_RANGE"] = "LOCALHOST"  # the launched node inherits it
    include = IncludeLaunchDescription(
        PythonLaunchDescriptionSource(str(LAUNCH_FILE)),
        launch_arguments={
            "model_path": _model_path(),
            "device": "cpu",
            "max_new_tokens": "8",
            "temperature": "0.0",
            "image_max_age_s": "60.0",
            "namespace": NAMESPACE,
            "image_topic": IMAGE_TOPIC,
            "prompt_topic": PROMPT_TOPIC,
        }.items(),
    )
    return LaunchDescription([include, launch_testing.actions.ReadyToTest()]), {}


class TestNodeThroughLaunch(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.client = VlmClient(
            int(os.environ.get("ROS_DOMAIN_ID", "0")),
            namespace=NAMESPACE,
            image_topic=IMAGE_TOPIC,
            prompt_topic=PROMPT_TOPIC,
        )
        cls.client.wait_until_connected(timeout=180.0)

    @classmethod
    def tearDownClass(cls):
        cls.client.close()

    def ask_with_image(self) -> dict:
        self.client.publish_image(rgb_to_image_msg(RGB, Image))
        return self.client.ask(QUESTION, timeout=120.0)

    def test_1_tokens_add_up_to_the_response(self):
        result = self.ask_with_image()
        self.assertEqual([e["event"] for e in result["events"]], ["accepted", "started", "finished"])
        self.assertIsNotNone(result["status"]["image_stamp"])
        self.assertEqual("".join(result["tokens"]), result["response"])
        self.assertLessEqual(result["status"]["metrics"]["generated_tokens"], 8)  # launch override applied

    def test_2_paging_off_gives_the_same_answer_and_bad_page_size_is_refused(self):
        expected = self.ask_with_image()["response"]
        n = len(self.client.events(event="reconfigured"))
        (result,) = self.client.set_params({"use_paged_attention": False})
        self.assertTrue(result.successful, result.reason)
        self.client.wait_for(lambda: len(self.client.events(event="reconfigured")) > n, 60, "reconfigured")
        self.assertEqual(self.ask_with_image()["response"], expected)
        (refused,) = self.client.set_params({"page_size": 24})
        self.assertFalse(refused.successful)
        self.assertIn("power of two", refused.reason)
        (restored,) = self.client.set_params({"use_paged_attention": True})
        self.assertTrue(restored.successful, restored.reason)

    def test_3_reset_and_cancel_services(self):
        reset = self.client.trigger("reset")
        self.assertTrue(reset.success)
        cancel = self.client.trigger("cancel")
        self.assertTrue(cancel.success)
        self.assertIn("dropped 0", cancel.message)
        self.assertEqual(self.ask_with_image()["status"]["event"], "finished")


@launch_testing.post_shutdown_test()
class TestCleanExit(unittest.TestCase):
    def test_exit_code_is_zero(self, proc_info):
        # launch stops the node with SIGINT; the node exits 0 after a clean shutdown.
        launch_testing.asserts.assertExitCodes(proc_info)
