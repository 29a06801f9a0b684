"""Test-wide setup: deterministic torch, ROS kept on localhost, standard logging (import paths:
pyproject.toml's pythonpath)."""

from __future__ import annotations

import logging
import os

import pytest

# Any rclpy use in this process or its children stays on this machine (no multicast discovery).
os.environ["ROS_AUTOMATIC_DISCOVERY_RANGE"] = "LOCALHOST"  # forced: an inherited SUBNET must not leak
os.environ.setdefault("ROS_DOMAIN_ID", "42")

# Where ROS 2's launch_testing is installed, pytest loads its plugin, which imports `launch`, and `launch`
# makes every logger created afterwards a LaunchLogger that does not propagate to the root logger, so
# pytest's log capture would see nothing from this package's loggers (created when the tests import it,
# after this file). Loggers of the standard class again; without the plugin this changes nothing.
logging.setLoggerClass(logging.Logger)


@pytest.fixture(autouse=True)
def _seed_torch():
    import torch

    torch.manual_seed(0)
    yield


@pytest.fixture(scope="session")
def harness(tmp_path_factory):
    """The CPU CUDA harness (``test/cuda_harness``) with every kernel of ``kernels/``, built once a session."""
    import shutil

    from cuda_harness.harness import Harness, build

    if not shutil.which("g++"):
        pytest.skip("g++ not found: cannot build the CUDA CPU harness")
    lib, seconds = build(tmp_path_factory.getbasetemp() / "cuda_harness")
    print(f"\ncuda harness built in {seconds:.1f} s")
    return Harness(lib)


@pytest.fixture(scope="session")
def cpu_kernel_cache(tmp_path_factory) -> str:
    """One CPU GEMM kernel cache for the session: the library compiled once (about 5 s on a 2-core machine)
    and loaded from there by the tests that use the kernels (compiling and caching themselves are
    test_cpu_gemm's tests, with caches of their own)."""
    return str(tmp_path_factory.mktemp("cpu_kernel_cache"))
