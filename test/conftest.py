"""Test-wide setup: test/ helpers importable, deterministic torch, ROS kept on localhost."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

TEST_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(TEST_DIR))
sys.path.insert(1, str(TEST_DIR.parent))  # the source tree, also under a bare `pytest`

# Any rclpy use in this process or its children stays on this machine (no multicast discovery).
os.environ["ROS_AUTOMATIC_DISCOVERY_RANGE"] = "LOCALHOST"  # forced: an inherited SUBNET must not leak
os.environ.setdefault("ROS_DOMAIN_ID", "42")


@pytest.fixture(autouse=True)
def _seed_torch():
    import torch

    torch.manual_seed(0)
    yield
