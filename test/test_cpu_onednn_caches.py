"""oneDNN's per-shape caches stay bounded in a process that runs the engine on the CPU (``cpu/onednn.py``):
without the bound, bf16 matmuls of many row counts (prompts of many lengths) grew a process by about 0.7 MB a
shape up to a gigabyte. Each case is a fresh process: the capacities take effect only before its first
oneDNN matmul."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from orin_vlm_node.cpu.onednn import CACHE_ENTRIES, CAPACITY_VARIABLES

# An engine on the CPU in bf16, then bf16 products of 500 row counts (what 500 prompts of different lengths
# send through a projection): the capacities in effect and how much the process grew.
SCRIPT = """
import json, os, sys
import torch, torch.nn.functional as F
from orin_vlm_node.engine import Engine, EngineConfig

def rss_mb():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 1e6

torch.set_num_threads(1)
Engine(EngineConfig(device="cpu", dtype="bf16", kernel_cache_dir=sys.argv[1]))
w = torch.randn(1024, 1024, dtype=torch.bfloat16)
F.linear(torch.randn(8, 1024, dtype=torch.bfloat16), w)
before = rss_mb()
for rows in range(16, 516):
    F.linear(torch.randn(rows, 1024, dtype=torch.bfloat16), w)
capacities = {name: os.environ.get(name) for name in sys.argv[2:]}
print(json.dumps({"capacities": capacities, "grew_mb": rss_mb() - before}))
"""


def _run(cache_dir: str, env: dict[str, str]) -> dict:
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, cache_dir, *CAPACITY_VARIABLES],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_the_engine_bounds_onednns_shape_caches_unless_the_operator_set_them(cpu_kernel_cache):
    clean = {k: v for k, v in os.environ.items() if k not in CAPACITY_VARIABLES}
    bounded = _run(cpu_kernel_cache, clean)
    assert bounded["capacities"] == dict.fromkeys(CAPACITY_VARIABLES, str(CACHE_ENTRIES))
    operator = _run(cpu_kernel_cache, {**clean, **dict.fromkeys(CAPACITY_VARIABLES, "1024")})
    assert operator["capacities"] == dict.fromkeys(CAPACITY_VARIABLES, "1024")  # the operator's values win
    if operator["grew_mb"] < 150:
        pytest.skip(
            f"bf16 matmuls on this CPU do not fill oneDNN's caches ({operator['grew_mb']:.0f} MB for 500 shapes)"
        )
    # 500 shapes: about 350 MB with oneDNN's own capacities; the bound keeps 128 of them.
    print(f"\n500 bf16 shapes: the process grew {bounded['grew_mb']:.0f} MB bounded, {operator['grew_mb']:.0f} MB not")
    assert bounded["grew_mb"] < operator["grew_mb"] / 2, (bounded, operator)
