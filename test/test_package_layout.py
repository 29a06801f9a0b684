"""The package installs the way ROS 2 users expect, and every module imports."""

from __future__ import annotations

import importlib
import os
import pkgutil
import subprocess
import sys
from pathlib import Path

import orin_vlm_node

REPO = Path(__file__).resolve().parent.parent


def test_every_module_imports():
    names = [m.name for m in pkgutil.walk_packages(orin_vlm_node.__path__, "orin_vlm_node.")]
    assert "orin_vlm_node.engine.events" in names
    for name in names:
        if name.endswith(".__main__"):
            continue  # running it is its own test (the diagnostics command)
        importlib.import_module(name)


def test_pip_install_yields_ament_layout(tmp_path):
    prefix = tmp_path / "prefix"
    env = dict(os.environ, PIP_DISABLE_PIP_VERSION_CHECK="1")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "--prefix",
            str(prefix),
            str(REPO),
        ],
        check=True,
        env=env,
        cwd=tmp_path,
    )
    share = prefix / "share"
    assert (share / "orin_vlm_node" / "package.xml").is_file()
    assert (share / "ament_index" / "resource_index" / "packages" / "orin_vlm_node").is_file()
    launcher = prefix / "lib" / "orin_vlm_node" / "vlm_node"
    assert launcher.is_file() and os.access(launcher, os.X_OK)
    assert "orin_vlm_node.node import main" in launcher.read_text()
    assert list((share / "orin_vlm_node" / "launch").glob("*.launch.py"))
    assert (share / "orin_vlm_node" / "config" / "orin_vlm.yaml").is_file()
    assert list((share / "orin_vlm_node" / "kernels").glob("*.cu"))
