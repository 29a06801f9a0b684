"""Every module of the package imports (the install layouts are in test_install_layouts)."""

from __future__ import annotations

import importlib
import pkgutil

import orin_vlm_node


def test_every_module_imports():
    names = [m.name for m in pkgutil.walk_packages(orin_vlm_node.__path__, "orin_vlm_node.")]
    assert "orin_vlm_node.engine.events" in names
    for name in names:
        if name.endswith(".__main__"):
            continue  # running it is its own test (the diagnostics command)
        importlib.import_module(name)
