"""Test-wide setup: deterministic torch, ROS kept on localhost, standard logging (import paths:
pyproject.toml's pythonpath)."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

from support.node_process import domain_id_for

# Any rclpy use in this process or its children stays on this machine (no multicast discovery).
os.environ["ROS_AUTOMATIC_DISCOVERY_RANGE"] = "LOCALHOST"  # forced: an inherited SUBNET must not leak
# rclpy used in this process without a domain of its own joins the run's (CI sets one per run); where pytest-xdist
# runs modules in parallel workers, each worker gets one of its own (domain_id_for) so they do not hear each other.
if "PYTEST_XDIST_WORKER" in os.environ:
    os.environ["ROS_DOMAIN_ID"] = str(domain_id_for("conftest"))
else:
    os.environ.setdefault("ROS_DOMAIN_ID", "42")

# Where ROS 2's launch_testing is installed, pytest loads its plugin, which imports `launch`, and `launch`
# makes every logger created afterwards a LaunchLogger that does not propagate to the root logger, so
# pytest's log capture would see nothing from this package's loggers (created when the tests import it,
# after this file). Loggers of the standard class again; without the plugin this changes nothing.
logging.setLoggerClass(logging.Logger)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Test files marked ``starts_first`` first (a stable sort: the order is otherwise unchanged), so that
    `make test`'s workers, which take files in this order, start the longest ones at once and do not end the
    run waiting for one of them."""
    items.sort(key=lambda item: item.get_closest_marker("starts_first") is None)


@pytest.fixture(autouse=True)
def _seed_torch():
    import torch

    torch.manual_seed(0)
    yield


def _shared_dir(tmp_path_factory) -> Path:
    """A directory of this pytest run that every worker sees: under pytest-xdist each worker has its own
    base temporary directory inside one the run shares, so what is built there is built once a run."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if "PYTEST_XDIST_WORKER" in os.environ else base


@pytest.fixture(scope="session")
def harness(tmp_path_factory):
    """The CPU CUDA harness (``test/cuda_harness``) with every kernel of ``kernels/``, built once a run (the
    first worker to get here builds it, under a lock; the others wait and load it)."""
    import fcntl
    import shutil

    from cuda_harness.harness import Harness, build

    if not shutil.which("g++"):
        pytest.skip("g++ not found: cannot build the CUDA CPU harness")
    root = _shared_dir(tmp_path_factory) / "cuda_harness"
    root.mkdir(exist_ok=True)
    with open(root / "build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        lib, seconds = build(root)
    print(f"\ncuda harness built in {seconds:.1f} s")
    return Harness(lib)


@pytest.fixture(scope="session")
def cpu_kernel_cache(tmp_path_factory) -> str:
    """One CPU GEMM kernel cache for the run: the library compiled once (about 5 s on a 2-core machine) and
    loaded from there by the tests that use the kernels (compiling and caching themselves are test_cpu_gemm's
    tests, with caches of their own). Workers that compile it at the same time each write it atomically."""
    path = _shared_dir(tmp_path_factory) / "cpu_kernel_cache"
    path.mkdir(exist_ok=True)
    return str(path)


@pytest.fixture(scope="session")
def gpu_cache(tmp_path_factory) -> str:
    """One kernel cache for the GPU tests: the first engine builds the kernels (the cold path), the others load
    the cubins it cached, as a robot's restarts do (the diagnostics step of the GPU check times both)."""
    return str(tmp_path_factory.mktemp("gpu_cache"))


@pytest.fixture(scope="module")
def default_model_engine():
    """Our engine on the embedded default model, CPU, one thread (the acceptance tests' numerics), one per
    test module so that no module's prefix cache serves another's prompts."""
    import torch

    from orin_vlm_node.engine import Engine, EngineConfig

    torch.set_num_threads(1)
    model = Path(__file__).resolve().parent.parent / "orin_vlm_node" / "default_model"
    return Engine(EngineConfig(model_path=str(model), device="cpu", kv_pool_blocks=64, max_context_tokens=1024))
