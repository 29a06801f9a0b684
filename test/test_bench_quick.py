"""CI smoke test of the benchmarks: ``python -m bench.run --quick`` runs end to end into a temporary path and
writes a schema-valid result, a chart and a report. Numbers are not checked (performance goals live in
bench/, never in timed tests); what is checked is that every section either measured something or
says why it did not."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench.report import TITLES
from bench.schema import SECTIONS, validate_result

pytestmark = pytest.mark.starts_first

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.timeout(400)
def test_quick_benchmark_writes_a_valid_result(tmp_path):
    out = tmp_path / "result.json"
    env = dict(
        os.environ,
        ROS_AUTOMATIC_DISCOVERY_RANGE="LOCALHOST",
        ROS_LOG_DIR=str(tmp_path / "ros_log"),
        PYTHONUNBUFFERED="1",
    )
    proc = subprocess.run(
        [sys.executable, "-m", "bench.run", "--quick", "--threads", "1", "--out", str(out)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=360,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(out.read_text())
    validate_result(result)
    assert result["mode"] == "quick"
    assert set(result["sections"]) == set(SECTIONS)
    errors = {n: s["reason"] for n, s in result["sections"].items() if s["status"] == "error"}
    assert not errors, errors
    # Sections that need only the CPU engine must have measured in quick mode.
    for name in ("vs_transformers", "paged_vs_contiguous", "prefix_cache", "batching", "quantization", "memory"):
        assert result["sections"][name]["status"] == "ok", (name, result["sections"][name]["reason"])
    # Every section ran in a process of its own, which reports its peak resident memory.
    for name, section in result["sections"].items():
        assert section["setup"]["process_peak_rss_mb"] > 0, name
    gpu = result["sections"]["gpu"]
    if not result["machine"]["cuda_device"]:
        assert gpu["status"] == "skipped" and gpu["reason"] == "no CUDA device"
    skipped_parts = {p["part"] for p in result["sections"]["vs_transformers"]["skipped_parts"]}
    assert {"2b_bf16", "2b_fp32"} <= skipped_parts  # quick mode never builds the 2B checkpoint
    assert out.with_suffix(".png").stat().st_size > 10_000
    assert "| Goal | Target | Measured | Status |" in proc.stdout

    report = subprocess.run(
        [sys.executable, "-m", "bench.report", str(out)], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert report.returncode == 0, report.stderr
    for name in SECTIONS:
        assert f"### {TITLES[name]}" in report.stdout
