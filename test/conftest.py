"""Test-wide setup: deterministic torch, ROS kept on localhost (import paths: pyproject.toml's pythonpath)."""

from __future__ import annotations

import os

import pytest

# Any rclpy use in this process or its children stays on this machine (no multicast discovery).
os.environ["ROS_AUTOMATIC_DISCOVERY_RANGE"] = "LOCALHOST"  # forced: an inherited SUBNET must not leak
os.environ.setdefault("ROS_DOMAIN_ID", "42")


@pytest.fixture(autouse=True)
def _seed_torch():
    import torch

    torch.manual_seed(0)
    yield
