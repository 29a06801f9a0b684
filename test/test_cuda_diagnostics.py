"""What ``python -m orin_vlm_node.cuda`` reports about PyCUDA: an installed one by its package metadata, one
built in place and put on the path (no metadata) by its own version, a missing one as missing."""

from __future__ import annotations

import sys

from orin_vlm_node.cuda import diagnostics


def _fake_pycuda(root, version: str) -> None:
    package = root / "pycuda"
    package.mkdir()
    (package / "__init__.py").write_text(f"VERSION_TEXT = {version!r}\n")


def test_a_pycuda_built_in_place_is_reported_by_its_own_version(tmp_path, monkeypatch):
    _fake_pycuda(tmp_path, "2026.1")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "pycuda", raising=False)
    assert diagnostics._pycuda() == "2026.1"


def test_a_missing_pycuda_is_reported_as_missing(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "path", [p for p in sys.path if "site-packages" not in p and p != ""])
    monkeypatch.delitem(sys.modules, "pycuda", raising=False)
    assert diagnostics._pycuda() is None
