"""Finding the kernel sources: the kernel_dir setting checked strictly, the search order, and a clear
error listing every place looked at (the install layouts themselves are in test_install_layouts)."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

from orin_vlm_node.cuda import sources as S
from orin_vlm_node.engine import Engine, EngineConfig, EngineError

REPO = Path(__file__).resolve().parent.parent


def test_the_checkout_finds_its_own_kernels():
    found = S.find_kernel_sources()
    assert found.directory == (REPO / "kernels").resolve() and found.found_by == "source checkout"
    assert found.modules == (
        "gemv",
        "gemv_swiglu",
        "paged_decode_attention",
        "paged_kv_write",
        "paged_prefill_attention",
        "rms_norm",
        "silu_mul",
        "widen_int4",
    )


def test_kernel_dir_setting_wins_and_is_checked(tmp_path):
    copy = tmp_path / "kernels"
    shutil.copytree(REPO / "kernels", copy)
    found = S.find_kernel_sources(str(copy))
    assert found.directory == copy and found.found_by == "kernel_dir setting"
    (copy / "paged_kv_write.cu").unlink()
    with pytest.raises(
        S.KernelSourcesNotFound,
        match=r"lacks paged_kv_write\.cu \(has gemv\.cu, gemv_swiglu\.cu, paged_decode_attention\.cu",
    ):
        S.find_kernel_sources(str(copy))
    with pytest.raises(S.KernelSourcesNotFound, match="holds no .cu files"):
        S.check_kernel_dir(tmp_path)
    with pytest.raises(S.KernelSourcesNotFound, match="does not exist"):
        S.check_kernel_dir(tmp_path / "missing")


def test_nothing_found_lists_every_place_looked_at(monkeypatch, tmp_path):
    places = [("install prefix /x", tmp_path / "x" / "share" / "orin_vlm_node" / "kernels"), ("ament index", tmp_path)]
    monkeypatch.setattr(S, "candidate_dirs", lambda: places)
    with pytest.raises(S.KernelSourcesNotFound) as info:
        S.find_kernel_sources()
    text = str(info.value)
    assert "kernel sources not found" in text and "set kernel_dir" in text
    assert f"{places[0][1]} (install prefix /x): does not exist" in text
    assert f"{tmp_path} (ament index): holds no .cu files" in text


def test_candidates_are_nearest_first():
    pairs = S.candidate_dirs()
    how = [h for h, _ in pairs]
    assert how[0] == "source checkout"
    # The last resort is this interpreter's prefix; with a sourced ROS environment the ament index may name
    # the same directory first (it is listed once, under the first way it was found).
    assert pairs[-1][1] == Path(sys.prefix) / "share" / "orin_vlm_node" / "kernels"
    assert all(h.startswith(("source checkout", "install prefix", "ament index", "sys.prefix")) for h in how)


def test_engine_refuses_a_kernel_dir_that_is_not_one(tmp_path):
    with pytest.raises(EngineError, match=f"kernel_dir '{tmp_path / 'nope'}' does not exist"):
        Engine(EngineConfig(kernel_dir=str(tmp_path / "nope")))
