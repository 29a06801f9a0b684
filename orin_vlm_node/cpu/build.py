"""Compile a ``kernels/*.cpp`` source into a shared library with the machine's C++ compiler, cached.

Like the CUDA kernels, the CPU kernels are built on the machine that runs them, never shipped prebuilt:
``-march=native`` makes the compiler use the vector units this CPU has (AVX2 on a workstation, NEON on a
Jetson's Cortex-A78AE), which a portable binary could not. The cache key covers the source, the flags and
what ``-march=native`` resolves to on this machine (the compiler's own driver line, which names its version
and the target CPU and features), so another compiler, CPU or board rebuilds. Cache files are verified and
written atomically (``artifact_cache``).

More in docs/modules.md, ``orin_vlm_node/cpu/build.py``.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import re
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from ..artifact_cache import read_cached, run_compiler, write_cached

_log = logging.getLogger(__name__)

FLAGS: tuple[str, ...] = ("-O3", "-march=native", "-ffp-contract=off", "-std=c++17", "-fPIC", "-shared", "-fopenmp")
COMPILERS = ("c++", "g++", "clang++")
COMPILE_TIMEOUT_S = 300


class CpuKernelUnavailable(RuntimeError):
    """A CPU kernel cannot be used here (no compiler, a compile error, a failed probe); the message says why."""


def find_compiler() -> str:
    """``$CXX`` when set (it must run), else the first of ``c++``, ``g++``, ``clang++`` on PATH."""
    explicit = os.environ.get("CXX", "")
    if explicit:
        found = shutil.which(explicit)
        if found is None:
            raise CpuKernelUnavailable(f"CXX={explicit!r} is not an executable")
        return found
    for name in COMPILERS:
        found = shutil.which(name)
        if found is not None:
            return found
    raise CpuKernelUnavailable(f"no C++ compiler ({', '.join(COMPILERS)} not on PATH; install g++ or set CXX)")


@functools.lru_cache(maxsize=4)
def compiler_identity(cxx: str) -> str:
    """What the compiler would run for ``-march=native`` here (``-###``: version, target CPU and features),
    with the names of its temporary files (new in every process: ``/tmp/ccAb12Cd.s``) taken out, so the key
    is the same in the next process and the cache is hit."""
    cmd = [cxx, *FLAGS, "-###", "-x", "c++", "-c", os.devnull, "-o", os.devnull]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise CpuKernelUnavailable(f"cannot run {cxx}: {exc}") from exc
    if proc.returncode:
        raise CpuKernelUnavailable(f"{cxx} refuses {' '.join(FLAGS)}: {(proc.stderr or proc.stdout).strip()}")
    return re.sub(re.escape(tempfile.gettempdir()) + r'/[^\s"\']+', "<temporary file>", proc.stderr + proc.stdout)


def library_key(source: Path, cxx: str) -> str:
    """SHA-256 over the source, the flags and the compiler's resolved target (:func:`compiler_identity`)."""
    h = hashlib.sha256()
    for part in (source.read_bytes(), " ".join(FLAGS).encode(), compiler_identity(cxx).encode()):
        h.update(part + b"\0")
    return h.hexdigest()


def compile_library(source: Path, cxx: str) -> bytes:
    """The shared library built from ``source`` (no cache)."""
    return run_compiler(
        lambda out: [cxx, *FLAGS, "-o", str(out), str(source)],
        f"{source.stem}.so",
        source.name,
        CpuKernelUnavailable,
        COMPILE_TIMEOUT_S,
    )


def build_library(source: Path, cache_dir: Path) -> tuple[bytes, bool]:
    """(the library's bytes, whether they came from the cache): a verified cache entry, or a fresh compile
    written back."""
    cxx = find_compiler()
    key = library_key(source, cxx)
    family = f"{source.stem}-{platform.machine()}-"
    path = cache_dir / f"{family}{key[:24]}.so.cache"
    payload = read_cached(path)
    if payload is not None:
        _log.info("kernel cache hit: %s from %s", source.name, path)
        return payload, True
    t0 = time.perf_counter()
    payload = compile_library(source, cxx)
    write_cached(path, payload, f"{family}*.so.cache")
    _log.info("compiled %s with %s in %.2f s -> %s", source.name, cxx, time.perf_counter() - t0, path)
    return payload, False


def load_library(payload: bytes, cache_dir: Path) -> ctypes.CDLL:
    """``payload`` loaded as a shared library: written to a private file (in the cache directory, else the
    temporary directory, which may be mounted noexec), loaded, and unlinked (the mapping stays)."""
    errors = []
    for directory in (cache_dir, Path(tempfile.gettempdir())):
        try:
            directory.mkdir(parents=True, exist_ok=True)
            fd, name = tempfile.mkstemp(dir=directory, prefix=".load.", suffix=".so")
        except OSError as exc:
            errors.append(f"{directory}: {exc}")
            continue
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(payload)
            return ctypes.CDLL(name)
        except OSError as exc:
            errors.append(f"{directory}: {exc}")
        finally:
            Path(name).unlink(missing_ok=True)
    raise CpuKernelUnavailable(f"cannot load the compiled library ({'; '.join(errors)})")
