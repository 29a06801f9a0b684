"""bench.kv_memory: the KV-memory figures come from the real caches and add up."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench import kv_memory

REPO = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.skipif(
    not kv_memory.DEFAULT_CONFIG.is_file(), reason=f"shared model config missing: {kv_memory.DEFAULT_CONFIG}"
)


def test_2b_figures_match_the_block_arithmetic():
    rows = kv_memory.kv_memory_figures()
    per_token = 28 * 2 * 8 * 128 * 2  # layers x (K, V) x kv heads x head_dim x bf16 bytes
    assert [r["tokens"] for r in rows] == [50, 500, 4000]
    for r in rows:
        assert r["bytes_per_token"] == per_token
        assert r["tokens_kv_bytes"] == r["tokens"] * per_token
        assert r["paged_kv_bytes"] == -(-r["tokens"] // 16) * 16 * per_token
        assert r["contiguous_kv_bytes"] == 4096 * per_token == r["pool_bytes"]
    assert rows[0]["paged_over_contiguous"] < 0.02  # a 50-token chat: 4 pages instead of 4096 slots


def test_benchmark_figures_for_bench_memory():
    figures = kv_memory.benchmark_figures()
    unit, value, description = figures["Qwen3-VL-2B-Instruct.500tok.paged_mb"]
    assert unit == "MB" and value == pytest.approx(32 * 16 * 28 * 2 * 8 * 128 * 2 / 2**20)
    assert "500-token" in description


def test_cli_json():
    out = subprocess.run(
        [sys.executable, "-m", "bench.kv_memory", "--json"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    rows = json.loads(out.stdout)
    assert rows == kv_memory.kv_memory_figures()
