"""Every module of the package imports (the install layouts are in test_install_layouts)."""

from __future__ import annotations

import ast
import importlib
import pkgutil
import re
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import orin_vlm_node


def test_every_module_imports():
    names = [m.name for m in pkgutil.walk_packages(orin_vlm_node.__path__, "orin_vlm_node.")]
    assert "orin_vlm_node.engine.events" in names
    for name in names:
        if name.endswith(".__main__"):
            continue  # running it is its own test (the diagnostics command)
        importlib.import_module(name)


# Where a robot gets each module the package imports that is neither the standard library nor ROS 2 (which
# rosdep installs from package.xml's exec_depend, by the package's own name): a rosdep key of package.xml,
# requirements-jetson.txt (pip), or NVIDIA's Jetson wheel (torch, which no package index has for a Jetson).
ROSDEP_KEYS = {"cv2": "python3-opencv", "numpy": "python3-numpy"}
JETSON_PIP = {"pycuda", "tokenizers", "safetensors", "jinja2", "llguidance"}
NVIDIA_WHEEL = {"torch"}


def _imported_top_level_modules() -> set[str]:
    """Top-level names of every absolute import in the package and the launch file (the code a robot runs)."""
    root = Path(orin_vlm_node.__file__).resolve().parent.parent
    files = [*(root / "orin_vlm_node").rglob("*.py"), *(root / "launch").glob("*.py")]
    names = set()
    for path in files:
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                names |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module.split(".")[0])
    return names


def test_every_import_comes_with_the_install_a_robot_does():
    """``rosdep install`` brings package.xml's exec_depends and ``pip install -r requirements-jetson.txt`` the
    rest (README's Jetson steps): an import missing from both fails on a freshly set-up robot, at startup."""
    root = Path(orin_vlm_node.__file__).resolve().parent.parent
    depends = {e.text for e in ET.parse(root / "package.xml").getroot().iter("exec_depend")}
    pip = {
        re.split(r"[<>=!~ ]", line.strip())[0].lower()
        for line in (root / "requirements-jetson.txt").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    }
    assert pip == JETSON_PIP, "requirements-jetson.txt changed: say here where each module comes from"
    imported = _imported_top_level_modules() - set(sys.stdlib_module_names) - {"orin_vlm_node", "__future__"}
    assert {"rclpy", "torch", "launch_ros", "ament_index_python"} <= imported  # the scan sees the imports
    ros = imported - ROSDEP_KEYS.keys() - JETSON_PIP - NVIDIA_WHEEL
    assert not ros - depends, f"imported ROS packages missing from package.xml's exec_depend: {sorted(ros - depends)}"
    missing_keys = {m: key for m, key in ROSDEP_KEYS.items() if m in imported and key not in depends}
    assert not missing_keys, f"rosdep keys missing from package.xml: {missing_keys}"
