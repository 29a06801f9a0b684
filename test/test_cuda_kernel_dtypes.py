"""The node builds each kernel module for its model's dtype only (``BuildConfig.dtype``, ``kernels/compat.cuh``):
every build defines exactly the kernels ``launch.kernel_modules`` lists for it, in a cache entry of its own, and
the diagnostics build and report each dtype as the node builds it.

Most of it runs through a stand-in nvcc that preprocesses the real sources with g++ (the CPU harness's CUDA
spellings) and writes the extern "C" kernels it finds as the "cubin": the dtype flag's way from the build
config to the preprocessor is the one nvcc gets. One real nvcc compile per dtype of a small module closes the
loop.
"""

from __future__ import annotations

import os
import re
import shutil
import stat
import sys
from pathlib import Path

import pytest
import torch

from orin_vlm_node.cuda import build as B
from orin_vlm_node.cuda import diagnostics
from orin_vlm_node.cuda import runtime as R
from orin_vlm_node.cuda.launch import DTYPE_TAGS, KERNEL_MODULES, kernel_modules
from orin_vlm_node.cuda.sources import find_kernel_sources

HARNESS = Path(__file__).resolve().parent / "cuda_harness"
NVCC = shutil.which("nvcc") or ("/usr/local/bin/nvcc" if os.path.exists("/usr/local/bin/nvcc") else None)
KERNEL_NAME = re.compile(rb'extern "C"\s+void\s+(\w+)\s*\(')
TAGS = tuple(DTYPE_TAGS.values())

# argv as build.compile_cubin gives it: -cubin -arch=.. <flags> -I <dir> -o <out> <source>; the -D flags and
# include dirs go to g++ -E with the harness's headers, the kernels' names to <out>.
FAKE_NVCC = f"""#!{sys.executable}
import re, subprocess, sys
args = sys.argv[1:]
if args == ["--version"]:
    print("Cuda compilation tools, release 99.9, V99.9.0 (preprocessor stand-in)")
    sys.exit(0)
out = args[args.index("-o") + 1]
keep = [a for a in args if a.startswith("-D")] + ["-I", args[args.index("-I") + 1]]
text = subprocess.run(["g++", "-E", "-x", "c++", "-std=c++17", "-I", {str(HARNESS)!r}, *keep, args[-1]],
                      capture_output=True, check=True).stdout
names = re.findall({KERNEL_NAME.pattern!r}, text)
open(out, "wb").write(b"\\x7fELF" + b"\\0".join(names) + b"\\0")
"""


@pytest.fixture(scope="module")
def preprocessing_nvcc(tmp_path_factory) -> str:
    if shutil.which("g++") is None:
        pytest.skip("g++ not found (the stand-in nvcc preprocesses with it)")
    script = tmp_path_factory.mktemp("nvcc") / "nvcc"
    script.write_text(FAKE_NVCC)
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return str(script)


def defined(cubin: bytes) -> set[str]:
    """The kernels a stand-in cubin names."""
    return {name.decode() for name in cubin[4:].split(b"\0") if name}


@pytest.mark.parametrize("dtype", [*TAGS, ""])
def test_a_build_for_one_dtype_defines_that_dtypes_kernels_and_no_other(tmp_path, preprocessing_nvcc, dtype):
    kernels = find_kernel_sources().directory
    cfg = B.BuildConfig("sm_87", kernels, tmp_path / "cache", preprocessing_nvcc, dtype=dtype)
    built = B.build_all(cfg)
    assert {m.name for m in built} == set(KERNEL_MODULES) and {m.dtype for m in built} == {dtype}
    for module in built:
        assert defined(module.cubin) == set(module.kernels), module.name
        assert module.kernels == kernel_modules([dtype] if dtype else TAGS)[module.name]
        assert module.path.name.startswith(f"{module.name}-sm_87-{dtype or 'all'}-")
    if dtype:  # a third of every module's kernels
        assert sum(len(m.kernels) for m in built) * len(TAGS) == sum(map(len, KERNEL_MODULES.values()))


def test_each_dtype_has_its_own_cache_entries_and_a_build_of_several_is_one_per_dtype(tmp_path, preprocessing_nvcc):
    kernels = find_kernel_sources().directory
    cfg = B.BuildConfig("sm_87", kernels, tmp_path / "cache", preprocessing_nvcc)
    first = B.build_all(cfg, ["silu_mul", "rms_norm"], dtypes=("f16", "bf16"))
    assert [(m.name, m.dtype, m.cache_hit) for m in first] == [
        ("silu_mul", "f16", False), ("rms_norm", "f16", False), ("silu_mul", "bf16", False), ("rms_norm", "bf16", False)
    ]  # fmt: skip
    assert len({m.path for m in first}) == 4
    every = B.build_all(cfg, ["silu_mul"])  # every dtype in one build: an entry of its own, which evicts none
    again = B.build_all(cfg, ["silu_mul", "rms_norm"], dtypes=("f16", "bf16"))
    assert every[0].dtypes == TAGS and all(m.cache_hit for m in again)
    assert [m.path for m in again] == [m.path for m in first]
    with pytest.raises(B.KernelBuildError, match="no kernels for dtype 'f64'"):
        B.BuildConfig("sm_87", kernels, dtype="f64")


class FakeRuntime:
    """KernelRuntime's surface that the diagnostics use: the kernels the stand-in cubins define, loaded."""

    closed = 0

    def __init__(self, modules, device):
        self.dtypes = sorted({tag for m in modules for tag in m.dtypes})
        self._kernels = set().union(*(defined(m.cubin) for m in modules))
        self.programmatic_status = "off (no GPU here)"

    def kernels(self) -> list[str]:
        return sorted(self._kernels)

    def close(self) -> None:
        FakeRuntime.closed += 1


def test_the_diagnostics_build_and_load_each_dtype_as_the_node_does(tmp_path, preprocessing_nvcc, monkeypatch):
    """``python -m orin_vlm_node.cuda`` on a GPU: every module for each dtype asked, one report line each with
    the kernels of that build loaded, and the runtime closed after."""
    monkeypatch.setattr(R, "KernelRuntime", FakeRuntime)
    monkeypatch.setattr(FakeRuntime, "closed", 0)
    monkeypatch.setattr(B, "find_nvcc", lambda explicit="": preprocessing_nvcc)
    kernels = find_kernel_sources().directory
    report, ok, status = diagnostics._build_and_load(kernels, "sm_87", str(tmp_path / "cache"), ("f16", "bf16"))
    assert ok and status == "off (no GPU here)" and FakeRuntime.closed == 1
    assert set(report) == {f"{m} {d}" for m in KERNEL_MODULES for d in ("f16", "bf16")}
    for key, entry in report.items():
        module, dtype = key.split()
        assert entry["built"] and entry["loaded"] == entry["expected"] == len(kernel_modules([dtype])[module])
    text = diagnostics.render(
        {"python": "3", "torch": torch.__version__, "kernel_sources": {"directory": None, "error": "-"},
         "nvcc": {"path": None, "error": "-"}, "gpu": {"available": False, "reason": "-"}, "pycuda": None,
         "cache": {"directory": "-", "writable": True, "cubins": []}, "kernels": report,
         "programmatic_launch": status}
    )  # fmt: skip
    n = len(kernel_modules(["bf16"])["gemv_swiglu"])
    assert re.search(rf"gemv_swiglu bf16 +: compiled in [0-9.]+ s, {n}/{n} kernels loaded", text), text


@pytest.mark.skipif(NVCC is None, reason="nvcc not found on PATH or at /usr/local/bin/nvcc")
@pytest.mark.parametrize("dtype", TAGS)
def test_nvcc_builds_a_modules_kernels_of_one_dtype(tmp_path, dtype):
    cfg = B.BuildConfig("sm_87", find_kernel_sources().directory, tmp_path / "cache", NVCC, dtype=dtype)
    module = B.build_module("silu_mul", cfg)
    assert module.cubin[:4] == b"\x7fELF" and module.kernels == (f"silu_mul_{dtype}",)
    for tag in TAGS:
        assert (f"silu_mul_{tag}".encode() + b"\0" in module.cubin) == (tag == dtype)
