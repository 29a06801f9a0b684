"""Kernel builder: cubin cache hit/miss/corruption and clear errors, with one real nvcc compile."""

from __future__ import annotations

import logging
import os
import shutil
import stat
import time
from pathlib import Path

import pytest

from orin_vlm_node import artifact_cache
from orin_vlm_node.cuda import build as B
from orin_vlm_node.cuda.sources import find_kernel_sources

NVCC = shutil.which("nvcc") or ("/usr/local/bin/nvcc" if os.path.exists("/usr/local/bin/nvcc") else None)
needs_nvcc = pytest.mark.skipif(NVCC is None, reason="nvcc not found on PATH or at /usr/local/bin/nvcc")

TINY_HEADER = "#pragma once\n__device__ __forceinline__ float twice(float x) { return 2.0f * x; }\n"
TINY_KERNEL = (
    '#include "tiny.cuh"\nextern "C" __global__ void tiny(float* y) { y[threadIdx.x] = twice(y[threadIdx.x]); }\n'
)


def _tiny_kernels(tmp_path: Path) -> Path:
    d = tmp_path / "kernels"
    d.mkdir()
    (d / "tiny.cuh").write_text(TINY_HEADER)
    (d / "tiny.cu").write_text(TINY_KERNEL)
    return d


def _fake_nvcc(tmp_path: Path, body: str) -> str:
    """A stand-in nvcc: answers --version, runs ``body`` for a compile, counts its compile calls."""
    script = tmp_path / "fake_nvcc"
    script.write_text(
        "#!/bin/sh\n"
        'if [ "$1" = "--version" ]; then echo "Cuda compilation tools, release 99.9, V99.9.0"; exit 0; fi\n'
        f'echo x >> "{tmp_path}/calls"\n' + body
    )
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return str(script)


FAKE_OK = 'out=""; while [ $# -gt 0 ]; do if [ "$1" = "-o" ]; then out="$2"; fi; shift; done\nprintf CUBIN > "$out"\n'


def _calls(tmp_path: Path) -> int:
    f = tmp_path / "calls"
    return len(f.read_text().splitlines()) if f.exists() else 0


@needs_nvcc
def test_real_nvcc_compile_then_cache_hit(tmp_path, caplog):
    kdir = _tiny_kernels(tmp_path)
    cfg = B.BuildConfig(arch="sm_87", cache_dir=tmp_path / "cache", nvcc=NVCC, kernel_dir=kdir)
    with caplog.at_level(logging.INFO, logger=B.__name__):
        first = B.build_module("tiny", cfg)
        second = B.build_module("tiny", cfg)
    assert not first.cache_hit and second.cache_hit
    assert first.cubin == second.cubin and first.cubin[:4] == b"\x7fELF"  # a real cubin is an ELF image
    assert "compiled tiny for sm_87" in caplog.text and "kernel cache hit" in caplog.text


def test_cache_miss_on_header_change_arch_and_flags(tmp_path):
    kdir = _tiny_kernels(tmp_path)
    nvcc = _fake_nvcc(tmp_path, FAKE_OK)
    cfg = B.BuildConfig(arch="sm_87", cache_dir=tmp_path / "cache", nvcc=nvcc, kernel_dir=kdir)
    assert not B.build_module("tiny", cfg).cache_hit
    assert B.build_module("tiny", cfg).cache_hit
    assert _calls(tmp_path) == 1
    (kdir / "tiny.cuh").write_text(TINY_HEADER.replace("2.0f", "3.0f"))  # only the included header changes
    assert not B.build_module("tiny", cfg).cache_hit
    assert not B.build_module("tiny", B.BuildConfig("sm_80", kdir, tmp_path / "cache", nvcc)).cache_hit
    assert not B.build_module("tiny", B.BuildConfig("sm_87", kdir, tmp_path / "cache", nvcc, ("-G",))).cache_hit
    assert _calls(tmp_path) == 4
    assert B.build_module("tiny", cfg).cache_hit


@pytest.mark.parametrize("damage", ["truncate", "flip", "garbage", "empty"])
def test_corrupt_cache_file_is_rebuilt(tmp_path, caplog, damage):
    kdir = _tiny_kernels(tmp_path)
    nvcc = _fake_nvcc(tmp_path, FAKE_OK)
    cfg = B.BuildConfig(arch="sm_87", cache_dir=tmp_path / "cache", nvcc=nvcc, kernel_dir=kdir)
    built = B.build_module("tiny", cfg)
    blob = built.path.read_bytes()
    damaged = {
        "truncate": blob[:-2],
        "flip": blob[:-1] + bytes([blob[-1] ^ 0xFF]),
        "garbage": b"not a cache file",
        "empty": b"",
    }[damage]
    built.path.write_bytes(damaged)
    with caplog.at_level(logging.WARNING, logger=artifact_cache.__name__):
        again = B.build_module("tiny", cfg)
    assert not again.cache_hit and again.cubin == b"CUBIN"
    assert "corrupt" in caplog.text
    assert B.build_module("tiny", cfg).cache_hit  # the rebuilt entry is intact
    assert not list(built.path.parent.glob("*.tmp"))  # atomic writes leave no temporaries


def test_missing_nvcc_and_compile_error_raise_kernel_build_error(tmp_path, monkeypatch):
    kdir = _tiny_kernels(tmp_path)
    with pytest.raises(B.KernelBuildError, match="nvcc not found"):
        B.build_module("tiny", B.BuildConfig("sm_87", kdir, tmp_path / "c", str(tmp_path / "no-nvcc")))
    monkeypatch.setenv("PATH", str(tmp_path / "empty-bin"))
    monkeypatch.delenv("CUDA_HOME", raising=False)
    monkeypatch.setattr(B, "NVCC_CANDIDATES", ())
    with pytest.raises(B.KernelBuildError, match="nvcc not found"):
        B.find_nvcc()
    failing = _fake_nvcc(tmp_path, 'echo "tiny.cu(2): error: identifier \\"oops\\" is undefined" >&2\nexit 2\n')
    with pytest.raises(B.KernelBuildError, match='identifier "oops" is undefined'):
        B.build_module("tiny", B.BuildConfig("sm_87", kdir, tmp_path / "c", failing))
    with pytest.raises(B.KernelBuildError, match="not found"):
        B.build_module("missing_module", B.BuildConfig("sm_87", kdir, tmp_path / "c", failing))


def test_source_closure_follows_includes_of_the_real_kernels():
    kernels = find_kernel_sources().directory
    names = {p.name for p in B.source_closure(kernels / "paged_decode_attention.cu", kernels)}
    assert {"paged_decode_attention.cu", "attention_common.cuh", "compat.cuh"} <= names
    assert set(B.module_names(kernels)) == {
        "paged_decode_attention",
        "paged_prefill_attention",
        "paged_kv_write",
        "gemv",
        "gemv_swiglu",
        "rms_norm",
        "silu_mul",
        "widen_int4",
    }
    assert B.arch_from_capability(8, 7) == "sm_87"


def test_unwritable_cache_still_builds_and_says_why(tmp_path, caplog):
    """A read-only or impossible cache directory (here: below a regular file, which fails for root too)
    costs a rebuild at every start, never the kernels."""
    kdir = _tiny_kernels(tmp_path)
    blocker = tmp_path / "not_a_dir"
    blocker.write_text("x")
    cache = blocker / "kernels"
    cfg = B.BuildConfig("sm_87", kdir, cache, _fake_nvcc(tmp_path, FAKE_OK))
    with caplog.at_level(logging.WARNING, logger=artifact_cache.__name__):
        first = B.build_module("tiny", cfg)
        second = B.build_module("tiny", cfg)
    assert first.cubin == second.cubin == b"CUBIN" and not second.cache_hit
    assert "could not write kernel cache" in caplog.text
    assert artifact_cache.cache_writable(cache) is not None and B.cached_cubins(cache) == []
    assert artifact_cache.cache_writable(tmp_path / "fresh" / "kernels") is None  # created on demand


def test_default_cache_dir_follows_xdg_cache_home(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert artifact_cache.default_cache_dir() == tmp_path / "orin_vlm_node" / "kernels"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert artifact_cache.default_cache_dir() == Path("~/.cache/orin_vlm_node/kernels").expanduser()


def test_the_cache_keeps_the_most_recently_used_builds_of_each_artifact(tmp_path):
    """A robot updated for years must not fill its disk with cubins: each artifact (module and arch) keeps
    KEEP_PER_ARTIFACT builds, the least recently used deleted first (a cache hit counts as a use); other
    artifacts' builds are left alone."""
    keep = artifact_cache.KEEP_PER_ARTIFACT

    def write(name: str, mtime: int) -> Path:
        path = tmp_path / name
        artifact_cache.write_cached(path, name.encode(), "gemv-sm_87-*.cubin" if "gemv-" in name else "x-*.cubin")
        os.utime(path, (mtime, mtime))
        return path

    other = [write("gemv_swiglu-sm_87-0.cubin", 1), write("x-0.cubin", 1)]  # other artifacts
    for i in range(keep + 2):
        write(f"gemv-sm_87-{i}.cubin", 1000 + i)
    kept = sorted(p.name for p in tmp_path.glob("gemv-sm_87-*.cubin"))
    assert kept == [f"gemv-sm_87-{i}.cubin" for i in range(2, keep + 2)]
    assert artifact_cache.read_cached(tmp_path / "gemv-sm_87-2.cubin") == b"gemv-sm_87-2.cubin"  # now the newest
    write(f"gemv-sm_87-{keep + 2}.cubin", 2000)
    assert (tmp_path / "gemv-sm_87-2.cubin").is_file() and not (tmp_path / "gemv-sm_87-3.cubin").exists()
    assert len(list(tmp_path.glob("gemv-sm_87-*.cubin"))) == keep
    assert all(p.is_file() for p in other)


def _entry(path: Path, size: int, mtime: float) -> Path:
    """A cache entry of ``size`` payload bytes, last used at ``mtime``."""
    path.write_bytes(artifact_cache.pack(bytes(size)))
    os.utime(path, (mtime, mtime))
    return path


def test_a_cache_folder_stays_within_its_budget_whatever_its_entries_are_named(tmp_path, monkeypatch, caplog):
    """The builds of modules a later release renamed or dropped match no artifact's rule: the folder's budget
    still removes them, least recently used first, and never the entry just written or a file that is not the
    cache's (``kernel_cache_dir`` may name a folder others use)."""
    entry_bytes = len(artifact_cache.pack(bytes(1000)))
    monkeypatch.setattr(artifact_cache, "CACHE_BUDGET_BYTES", 10 * entry_bytes)
    orphans = [_entry(tmp_path / f"gemv-sm_87-{i:024x}.cubin", 1000, 100 + i) for i in range(8)]  # old names
    current = [_entry(tmp_path / f"rms_norm-sm_87-fp16-{i:024x}.cubin", 1000, 200 + i) for i in range(4)]
    foreign = tmp_path / "someone_elses.cubin"
    foreign.write_bytes(bytes(50 * entry_bytes))
    os.utime(foreign, (1, 1))
    with caplog.at_level(logging.INFO, logger=artifact_cache.__name__):
        artifact_cache.write_cached(tmp_path / "gemv-sm_87-fp16-new.cubin", bytes(1000), "gemv-sm_87-fp16-*.cubin")
    left = {p.name for p in tmp_path.iterdir()}
    # the new entry and the 9 most recently used others fit: the 3 oldest orphans go
    assert left == {"gemv-sm_87-fp16-new.cubin", foreign.name} | {p.name for p in current + orphans[3:]}
    assert "least recently used beyond the folder's" in caplog.text
    monkeypatch.setattr(artifact_cache, "CACHE_BUDGET_BYTES", entry_bytes // 2)  # smaller than one entry
    artifact_cache.write_cached(tmp_path / "silu_mul-sm_87-fp16-new.cubin", bytes(1000), "silu_mul-*.cubin")
    assert {p.name for p in tmp_path.iterdir()} == {"silu_mul-sm_87-fp16-new.cubin", foreign.name}
    assert artifact_cache.read_cached(tmp_path / "silu_mul-sm_87-fp16-new.cubin") == bytes(1000)


def test_temporary_files_of_writes_that_never_finished_are_removed(tmp_path):
    """A power cut during a write leaves its temporary file: removed once it is older than any write takes,
    not while a write of another process may still be running, and only when it is the cache's own."""
    now = time.time()
    old = now - artifact_cache.ABANDONED_TEMP_S - 60
    abandoned = tmp_path / "gemv-sm_87-fp16-abc.cubin.k3j2h1ab.tmp"
    abandoned.write_bytes(artifact_cache.pack(bytes(5000))[:3000])  # cut short
    os.utime(abandoned, (old, old))
    running = tmp_path / "gemv-sm_87-fp16-abd.cubin.x9y8z7wv.tmp"
    running.write_bytes(artifact_cache.pack(bytes(5000))[:3000])
    foreign = tmp_path / "download.tmp"
    foreign.write_bytes(b"not the cache's")
    os.utime(foreign, (old, old))
    artifact_cache.write_cached(tmp_path / "gemv-sm_87-fp16-abe.cubin", b"CUBIN", "gemv-sm_87-fp16-*.cubin")
    assert not abandoned.exists()
    assert running.is_file() and foreign.is_file()
