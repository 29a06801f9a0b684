"""oneDNN's per-shape caches stay bounded in a process that runs the engine on the CPU (``cpu/onednn.py``):
without the bound, bf16 matmuls of many row counts (prompts of many lengths) grew a process by about 0.7 MB a
shape up to a gigabyte. Each case is a fresh process: the capacities take effect only before its first
oneDNN matmul. Where torch's bf16 matmul does not go through oneDNN (as on an AVX2-only EPYC), 40 shapes
grow nothing, and the 500-shape comparison, about a minute of bf16 arithmetic there, is skipped with the
figure; the capacities are checked everywhere."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from orin_vlm_node.cpu.onednn import CACHE_ENTRIES, CAPACITY_VARIABLES

# An engine on the CPU in bf16, then bf16 products of argv[2] row counts in a fixed shuffled order (what as many
# prompts of different lengths send through a projection, in no particular order: an entry's memory grows with
# its rows, so in rising order the entries a bound keeps would be the largest ones): the capacities in effect,
# how much the process grew, and how much of that in the second half of the shapes.
SCRIPT = """
import json, os, random, sys
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
rows = list(range(16, 16 + int(sys.argv[2])))
random.Random(0).shuffle(rows)
for i, n in enumerate(rows):
    if i == len(rows) // 2:
        half = rss_mb()
    F.linear(torch.randn(n, 1024, dtype=torch.bfloat16), w)
end = rss_mb()
capacities = {name: os.environ.get(name) for name in sys.argv[3:]}
print(json.dumps({"capacities": capacities, "grew_mb": end - before, "second_half_mb": end - half}))
"""


SHAPES = 500
PROBE_SHAPES = 40  # about 0.7 MB each where bf16 matmuls fill oneDNN's caches, nothing where they do not


def _run(cache_dir: str, env: dict[str, str], shapes: int) -> dict:
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, cache_dir, str(shapes), *CAPACITY_VARIABLES],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _environments() -> tuple[dict[str, str], dict[str, str]]:
    """The environment without capacities, and with an operator's (larger than the engine's)."""
    clean = {k: v for k, v in os.environ.items() if k not in CAPACITY_VARIABLES}
    return clean, {**clean, **dict.fromkeys(CAPACITY_VARIABLES, "1024")}


@pytest.fixture(scope="module")
def operator_probe(cpu_kernel_cache) -> dict:
    """A process with the operator's capacities after PROBE_SHAPES bf16 shapes."""
    return _run(cpu_kernel_cache, _environments()[1], PROBE_SHAPES)


def test_the_engine_sets_onednns_capacities_unless_the_operator_did(cpu_kernel_cache, operator_probe):
    bounded = _run(cpu_kernel_cache, _environments()[0], 1)
    assert bounded["capacities"] == dict.fromkeys(CAPACITY_VARIABLES, str(CACHE_ENTRIES))
    assert operator_probe["capacities"] == dict.fromkeys(CAPACITY_VARIABLES, "1024")  # the operator's values win


def test_the_bound_keeps_a_process_of_many_shapes_small(cpu_kernel_cache, operator_probe):
    if operator_probe["grew_mb"] < 10:
        pytest.skip(
            f"bf16 matmuls on this CPU do not fill oneDNN's caches "
            f"({operator_probe['grew_mb']:.0f} MB for {PROBE_SHAPES} shapes)"
        )
    clean, operator_env = _environments()
    bounded, operator = _run(cpu_kernel_cache, clean, SHAPES), _run(cpu_kernel_cache, operator_env, SHAPES)
    # 500 shapes: 350..420 MB with oneDNN's own capacities, growing all the way; the bound keeps 128 of them, so
    # past the first 128 shapes a new one takes the memory of one it evicts and the process stops growing.
    grew = f"{bounded['grew_mb']:.0f} MB bounded, {operator['grew_mb']:.0f} MB not"
    half = f"{bounded['second_half_mb']:.0f} and {operator['second_half_mb']:.0f} MB of it in the second half"
    print(f"\n{SHAPES} bf16 shapes: the process grew {grew}, {half}")
    assert bounded["grew_mb"] < operator["grew_mb"] / 2, (bounded, operator)
    assert bounded["second_half_mb"] < operator["second_half_mb"] / 3, (bounded, operator)
