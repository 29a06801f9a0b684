"""Every kernel module compiles with nvcc for Orin (sm_87) and Hopper (sm_90), warnings as errors.

The kernels' architecture branches (``compat.cuh``) are sm_90's dependent launch and the asynchronous copies of
sm_80 and later, so the other Ampere parts (sm_80, sm_86) compile the same code as Orin and are not compiled
again here; the decode kernel, whose K/V staging is the one user of those copies, is also compiled for Turing
(sm_75), where the copies are plain loads and stores.

Goes through ``build.compile_cubin`` (the startup builder's compile step) with the strict flags, and checks
that each cubin defines exactly the kernels ``launch.KERNEL_MODULES`` says it does (the names the runtime and
the harness look up). A build whose inputs an earlier run compiled already (same sources and headers, arch,
flags and nvcc) is read from that run's result in ``~/.cache/orin_vlm_node/nvcc-check`` (``$XDG_CACHE_HOME``
if set; delete the folder to compile everything again), as the node reads its kernel cache: a fresh machine,
CI's, compiles everything.
"""

from __future__ import annotations

import os
import re
import shutil
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

from orin_vlm_node.artifact_cache import default_cache_dir, read_cached, write_cached
from orin_vlm_node.cuda import build as B
from orin_vlm_node.cuda.launch import KERNEL_MODULES
from orin_vlm_node.cuda.sources import find_kernel_sources

NVCC = shutil.which("nvcc") or ("/usr/local/bin/nvcc" if os.path.exists("/usr/local/bin/nvcc") else None)
ARCHS = ["sm_87", "sm_90"]
TURING = ("sm_75", "paged_decode_attention")  # the one module whose code differs before Ampere

pytestmark = [
    pytest.mark.skipif(NVCC is None, reason="nvcc not found on PATH or at /usr/local/bin/nvcc"),
    pytest.mark.starts_first,
]


@dataclass(frozen=True)
class Compiled:
    """Every module's strict build for every arch: (arch, module) -> (cubin, seconds compiling or None when
    taken from ``CACHE``); and the PTX that nvcc wrote on the way to each cubin (``--keep``), in
    ``ptx_dir / arch``, which the dependent-launch check reads."""

    cubins: dict[tuple[str, str], tuple[bytes, float | None]]
    ptx_dir: Path

    def ptx_entries(self, module: str, arch: str) -> dict[str, str]:
        """Each kernel of ``module``'s PTX for ``arch``: entry name -> its PTX body."""
        bodies = re.split(r"\.visible \.entry ", (self.ptx_dir / arch / f"{module}.ptx").read_text())[1:]
        return {body.split("(")[0]: body for body in bodies}


# Strict builds of earlier runs, keyed as the node keys its kernel cache (sources with their headers, arch,
# flags, nvcc's version): a run that changed none of these takes a build's cubin and PTX from here instead of
# compiling everything again (about 350 CPU-seconds, a third of the suite's). Stored compressed; each module and
# arch keeps its artifact_cache.KEEP_PER_ARTIFACT most recent builds.
CACHE = default_cache_dir().parent / "nvcc-check"


def strict_build(arch: str, module: str, kernels: Path, keep_dir: Path) -> tuple[bytes, bytes, float | None]:
    """(cubin, PTX, seconds compiling; None when both came from ``CACHE``) of ``module`` for ``arch`` with the
    strict flags; the PTX is what nvcc writes on the way to the cubin (``--keep``)."""
    key = B.cache_key(module, B.BuildConfig(arch, kernels, nvcc=NVCC, extra_flags=B.STRICT_FLAGS), NVCC)[:24]
    entry = {kind: CACHE / f"{module}-{arch}-{key}.{kind}.z" for kind in ("cubin", "ptx")}
    cached = [read_cached(path) for path in entry.values()]
    if None not in cached:
        return zlib.decompress(cached[0]), zlib.decompress(cached[1]), None
    keep_dir.mkdir(parents=True)
    flags = (*B.STRICT_FLAGS, "--keep", "--keep-dir", str(keep_dir))
    t0 = time.perf_counter()
    cubin = B.compile_cubin(module, B.BuildConfig(arch, kernels, nvcc=NVCC, extra_flags=flags), NVCC)
    seconds = time.perf_counter() - t0
    ptx = (keep_dir / f"{module}.ptx").read_bytes()
    for kind, payload in (("cubin", cubin), ("ptx", ptx)):
        write_cached(entry[kind], zlib.compress(payload), f"{module}-{arch}-*.{kind}.z")
    return cubin, ptx, seconds


@pytest.fixture(scope="module")
def compiled(tmp_path_factory) -> Compiled:
    """The modules built once for the tests below, in parallel (nvcc one process a job): every module for
    ``ARCHS``, and the decode kernel for Turing, submitted first as it is one of the longest compiles (the two
    workers then finish close together)."""
    out = tmp_path_factory.mktemp("nvcc")
    kernels = find_kernel_sources().directory
    jobs = [TURING] + [(arch, module) for arch in ARCHS for module in B.module_names(kernels)]

    def build_one(job):
        arch, module = job
        cubin, ptx, seconds = strict_build(arch, module, kernels, out / "keep" / arch / module)
        (out / arch).mkdir(exist_ok=True)
        (out / arch / f"{module}.ptx").write_bytes(ptx)
        return job, (cubin, seconds)

    with ThreadPoolExecutor(max_workers=max(2, os.cpu_count() or 2)) as pool:
        return Compiled(dict(pool.map(build_one, jobs)), out)


def test_all_kernels_compile_for_all_archs_without_warnings(compiled):
    assert {m for a, m in compiled.cubins if a in ARCHS} == set(KERNEL_MODULES)
    assert {a for a, _ in compiled.cubins} == {*ARCHS, TURING[0]}
    for (arch, module), (cubin, seconds) in compiled.cubins.items():
        built = "from the cache" if seconds is None else f"{seconds:5.1f} s"
        print(f"{module:26s} {arch}: {built}, {len(cubin)} bytes")
        assert cubin[:4] == b"\x7fELF", f"{module} for {arch} is not a cubin"
        for kernel in KERNEL_MODULES[module]:
            assert kernel.encode() + b"\0" in cubin, f"{kernel} missing from {module}.cu ({arch})"


# A PTX instruction that reads or writes global memory: ld/st not of parameters, shared, local or constant
# space, an atomic/reduction, or an asynchronous copy from global memory.
MEMORY_OP = re.compile(
    r"\b(?:(?:ld|st)(?!\.param|\.shared|\.local|\.const)\.[a-z0-9.]+|atom\.|red\.|cp\.async\.c[ag]\.)"
)


def test_every_kernel_waits_for_the_one_before_it_on_hopper_and_not_on_orin(compiled):
    """Dependent launches are safe only if every kernel waits for its predecessor's stores before it touches
    memory (KERNEL_PROLOGUE): each entry's PTX for sm_90 lets the next kernel launch and waits before its
    first load or store (the GEMVs prefetch their weights into L2 in between); for sm_87 (no such
    instructions) the prologue is empty."""
    hopper = {module: compiled.ptx_entries(module, "sm_90") for module in KERNEL_MODULES}
    for module, entries in hopper.items():
        assert set(entries) == set(KERNEL_MODULES[module])
        for name, body in entries.items():
            code = body[body.index("{") :]
            memory = MEMORY_OP.search(code)  # the first global (or generic) load, store or atomic
            wait = code.find("griddepcontrol.wait")
            assert "griddepcontrol.launch_dependents" in code, name
            assert 0 <= wait < (memory.start() if memory else len(code)), f"{name} touches memory before the wait"
            if name.startswith("gemv_"):  # the weights, which no kernel writes, prefetched into L2 before the wait
                assert 0 <= code.find("prefetch.global.L2") < wait, name
    orin = compiled.ptx_entries("silu_mul", "sm_87")
    assert orin and not any("griddepcontrol" in body for body in orin.values())


def test_decode_stages_kv_with_async_copies_from_ampere_on_and_plain_loads_before(compiled):
    """Every decode kernel's PTX for Orin and Hopper copies K/V into shared memory asynchronously and waits for
    the copies; for Turing (sm_75, no cp.async) the same source compiles, warnings as errors, without them."""
    for arch in ARCHS:
        for name, body in compiled.ptx_entries("paged_decode_attention", arch).items():
            assert "cp.async.cg.shared.global" in body and "cp.async.wait_group" in body, (arch, name)
    turing = compiled.ptx_entries(TURING[1], TURING[0])
    assert "paged_decode_attention_f16_d128_g2" in turing and not any("cp.async" in b for b in turing.values())
