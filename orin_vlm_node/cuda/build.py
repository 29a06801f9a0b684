"""Compile ``kernels/*.cu`` with nvcc for the GPU we run on, with an on-disk cubin cache.

Kernels are built on the target itself at startup (a Jetson compiles with its own JetPack nvcc), never
shipped prebuilt: a cubin only runs on its architecture and a newer toolkit's PTX cannot be JIT-ed by an
older driver. Compiling costs seconds, so cubins are cached, keyed by everything that changes the
binary: the source and every header it includes, the architecture, the flags and the nvcc version.

Cache files are verified and written atomically (``artifact_cache``), so an interrupted write or a
corrupted file is rebuilt instead of crashing the module loader. Pure Python + subprocess: testable on a
machine without a GPU.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import logging
import os
import re
import shutil
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from ..artifact_cache import default_cache_dir, in_parallel, read_cached, run_compiler, write_cached
from .launch import DTYPE_TAGS, kernel_modules

_log = logging.getLogger(__name__)

# Never -ftz=true or --use_fast_math: the int4 GEMV widens its weights into subnormal floats (gemv.cuh),
# which flushing to zero would turn into zeros, and the attention kernels keep torch's rounding.
BASE_FLAGS: tuple[str, ...] = ("-O3", "-std=c++17")
# Used by the tests on every architecture we support: any warning fails the build.
STRICT_FLAGS: tuple[str, ...] = ("--Werror", "all-warnings", "-Xptxas", "-Werror")
NVCC_CANDIDATES = ("/usr/local/cuda/bin/nvcc", "/usr/local/bin/nvcc")
COMPILE_TIMEOUT_S = 600

_INCLUDE_RE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.MULTILINE)


class KernelBuildError(RuntimeError):
    """The kernels could not be built (no nvcc, a compile error, an unwritable cache); the message says which."""


@dataclass(frozen=True)
class BuildConfig:
    """How to build: target arch (e.g. ``sm_87``), the directory of the ``.cu`` sources (found by
    ``sources.find_kernel_sources``), cache directory ("" = :func:`default_cache_dir`), nvcc to use
    ("" = search), extra flags, and the one storage type to build the kernels of (a ``launch.DTYPE_TAGS``
    value: the node builds its model's only, ``kernels/compat.cuh``; "" = every type)."""

    arch: str
    kernel_dir: Path
    cache_dir: str | Path = ""
    nvcc: str = ""
    extra_flags: tuple[str, ...] = ()
    dtype: str = ""

    def __post_init__(self) -> None:
        if self.dtype and self.dtype not in DTYPE_TAGS.values():
            raise KernelBuildError(f"no kernels for dtype {self.dtype!r}: choose from {sorted(DTYPE_TAGS.values())}")

    @property
    def flags(self) -> tuple[str, ...]:
        only = (f"-DORIN_ONLY_DTYPE_{self.dtype}",) if self.dtype else ()
        return BASE_FLAGS + only + tuple(self.extra_flags)

    def family(self, module: str) -> str:
        """The start of the name of every cache entry of ``module`` built so (all but its key)."""
        return f"{module}-{self.arch}-{self.dtype or 'all'}-"

    @property
    def cache_path(self) -> Path:
        return Path(self.cache_dir).expanduser() if self.cache_dir else default_cache_dir()


@dataclass(frozen=True)
class CompiledModule:
    """One kernel module's cubin (its kernels for ``dtype``, "" = every type) and where it came from."""

    name: str
    arch: str
    cubin: bytes
    path: Path
    cache_hit: bool
    seconds: float = field(default=0.0, compare=False)
    dtype: str = ""

    @property
    def dtypes(self) -> tuple[str, ...]:
        """The storage types (``launch.DTYPE_TAGS`` values) the cubin has kernels for."""
        return (self.dtype,) if self.dtype else tuple(DTYPE_TAGS.values())

    @property
    def kernels(self) -> tuple[str, ...]:
        """The extern "C" kernels the cubin defines."""
        return kernel_modules(self.dtypes)[self.name]


def arch_from_capability(major: int, minor: int) -> str:
    """(8, 7) -> ``sm_87`` (Jetson Orin)."""
    return f"sm_{major}{minor}"


def find_nvcc(explicit: str = "") -> str:
    """The nvcc to use: ``explicit``, $CUDA_HOME/bin/nvcc, PATH, then the usual install locations."""
    if explicit:
        if Path(explicit).is_file() and os.access(explicit, os.X_OK):
            return explicit
        raise KernelBuildError(f"nvcc not found at {explicit!r}")
    candidates = []
    if os.environ.get("CUDA_HOME"):
        candidates.append(str(Path(os.environ["CUDA_HOME"]) / "bin" / "nvcc"))
    which = shutil.which("nvcc")
    if which:
        candidates.append(which)
    candidates.extend(NVCC_CANDIDATES)
    for c in candidates:
        if Path(c).is_file() and os.access(c, os.X_OK):
            return c
    raise KernelBuildError(
        "nvcc not found (looked at $CUDA_HOME/bin, PATH, /usr/local/cuda/bin): install the CUDA toolkit "
        "(JetPack on a Jetson) or set use_cuda_kernels:=false"
    )


@functools.lru_cache(maxsize=8)
def nvcc_version(nvcc: str) -> str:
    """The release line of ``nvcc --version`` (part of the cache key)."""
    try:
        proc = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=60, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise KernelBuildError(f"cannot run {nvcc} --version: {exc}") from exc
    if proc.returncode:
        raise KernelBuildError(f"{nvcc} --version failed: {proc.stderr.strip() or proc.stdout.strip()}")
    lines = [ln.strip() for ln in proc.stdout.splitlines() if ln.strip()]
    release = [ln for ln in lines if "release" in ln]
    return (release or lines or ["unknown"])[-1] + " | " + (lines[-1] if lines else "")


def module_names(kernel_dir: Path) -> list[str]:
    return sorted(p.stem for p in Path(kernel_dir).glob("*.cu"))


def source_closure(source: Path, kernel_dir: Path) -> list[Path]:
    """The .cu file and every quoted header it includes (recursively) that lives in ``kernel_dir``."""
    seen: dict[Path, None] = {}
    stack = [source]
    while stack:
        f = stack.pop()
        if f in seen:
            continue
        seen[f] = None
        for inc in _INCLUDE_RE.findall(f.read_text(encoding="utf-8")):
            dep = (f.parent / inc).resolve()
            if not dep.is_file():
                dep = (Path(kernel_dir) / inc).resolve()
            if dep.is_file():
                stack.append(dep)
    return list(seen)


def cache_key(module: str, cfg: BuildConfig, nvcc: str) -> str:
    """SHA-256 over the sources (with included headers), arch, flags and nvcc version."""
    src = Path(cfg.kernel_dir) / f"{module}.cu"
    if not src.is_file():
        raise KernelBuildError(f"kernel source {src} not found")
    h = hashlib.sha256()
    for f in sorted(source_closure(src.resolve(), Path(cfg.kernel_dir)), key=lambda p: p.name):
        h.update(f.name.encode() + b"\0" + f.read_bytes() + b"\0")
    h.update(cfg.arch.encode() + b"\0" + "\0".join(cfg.flags).encode() + b"\0" + nvcc_version(nvcc).encode())
    return h.hexdigest()


def cached_cubins(cache_dir: Path) -> list[Path]:
    """Cache entries (``<module>-<arch>-<dtype or all>-<key>.cubin``) in ``cache_dir``, for diagnostics."""
    try:
        return sorted(cache_dir.glob("*.cubin"))
    except OSError:
        return []


def compile_cubin(module: str, cfg: BuildConfig, nvcc: str) -> bytes:
    """Run nvcc on ``kernels/<module>.cu`` for ``cfg.arch`` and return the cubin bytes (no cache)."""
    src = Path(cfg.kernel_dir) / f"{module}.cu"

    def argv(out: Path) -> list[str]:
        return [nvcc, "-cubin", f"-arch={cfg.arch}", *cfg.flags, "-I", str(cfg.kernel_dir), "-o", str(out), str(src)]

    what = f"{src.name} for {cfg.arch}"
    return run_compiler(argv, f"{module}.cubin", what, KernelBuildError, COMPILE_TIMEOUT_S)


def build_module(module: str, cfg: BuildConfig) -> CompiledModule:
    """Cached cubin of one module: a verified cache entry, or a fresh compile written back atomically."""
    nvcc = find_nvcc(cfg.nvcc)
    key = cache_key(module, cfg, nvcc)
    family = cfg.family(module)
    path = cfg.cache_path / f"{family}{key[:24]}.cubin"
    payload = read_cached(path)
    what = f"{module} for {cfg.arch} ({cfg.dtype or 'every dtype'})"
    if payload is not None:
        _log.info("kernel cache hit: %s from %s", what, path)
        return CompiledModule(module, cfg.arch, payload, path, cache_hit=True, dtype=cfg.dtype)
    t0 = time.perf_counter()
    cubin = compile_cubin(module, cfg, nvcc)
    seconds = time.perf_counter() - t0
    write_cached(path, cubin, f"{family}*.cubin")
    _log.info("compiled %s in %.2f s (%d bytes) -> %s", what, seconds, len(cubin), path)
    return CompiledModule(module, cfg.arch, cubin, path, cache_hit=False, seconds=seconds, dtype=cfg.dtype)


def build_all(cfg: BuildConfig, modules: list[str] | None = None, dtypes: Sequence[str] = ()) -> list[CompiledModule]:
    """Every kernel module (default: all ``.cu`` in ``cfg.kernel_dir``) for each storage type of ``dtypes``
    (default: ``cfg.dtype`` alone), compiled or loaded from the cache.

    Builds run in parallel (one nvcc process each): a cold start on a Jetson then costs the slowest module,
    not the sum of all.
    """
    names = modules if modules is not None else module_names(Path(cfg.kernel_dir))
    jobs = [(name, dataclasses.replace(cfg, dtype=dtype)) for dtype in dtypes or (cfg.dtype,) for name in names]
    t0 = time.perf_counter()
    built = in_parallel(lambda job: build_module(*job), jobs, min(len(jobs), os.cpu_count() or 1))
    hits = sum(m.cache_hit for m in built)
    _log.info(
        "kernels ready for %s (%s) in %.2f s (%d cached, %d compiled)",
        cfg.arch,
        ", ".join(dtypes or (cfg.dtype or "every dtype",)),
        time.perf_counter() - t0,
        hits,
        len(built) - hits,
    )
    return built
