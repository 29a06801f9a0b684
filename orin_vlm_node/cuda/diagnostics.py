"""``python -m orin_vlm_node.cuda``: what the CUDA path will use on this machine, checked where it runs.

Run it on the robot after installing (pip or colcon) to see, without starting the node: where the kernel
sources are and which modules they hold, which nvcc (and version) compiles them, the GPU and its
architecture (or "no CUDA device"), PyCUDA's version, the cubin cache directory and what it holds. On a
machine with a GPU it also builds (or takes from the cache) and loads every module for each dtype the node
may run (``--dtype``; the node builds its model's only), as the node builds them, and says how many of each
build's kernels loaded; the cache then holds what a node starting with any of them takes. Exit status: 0 when
the kernel sources are found (also without a GPU) and, on a GPU, every module built and loaded; 2 when no
kernel sources are found; 1 when a module fails to build or load.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from ..artifact_cache import cache_writable, default_cache_dir, in_parallel
from ..model.dtypes import resolve_dtype
from ..settings import BY_NAME
from . import build as B
from .launch import DTYPE_TAGS, KERNEL_MODULES, dtype_name
from .sources import KernelSourcesNotFound, find_kernel_sources

EXIT_OK, EXIT_BUILD_FAILED, EXIT_NO_SOURCES = 0, 1, 2
DTYPE_CHOICES = tuple(c for c in BY_NAME["dtype"].choices if c != "auto")  # the node's `dtype` values


def _nvcc() -> dict[str, Any]:
    try:
        path = B.find_nvcc()
    except B.KernelBuildError as exc:
        return {"path": None, "error": str(exc)}
    try:
        return {"path": path, "version": B.nvcc_version(path)}
    except B.KernelBuildError as exc:
        return {"path": path, "error": str(exc)}


def _gpu() -> dict[str, Any]:
    if not torch.cuda.is_available():
        return {"available": False, "reason": f"no CUDA device (torch {torch.__version__}: cuda not available)"}
    props = torch.cuda.get_device_properties(0)
    return {
        "available": True,
        "name": props.name,
        "arch": B.arch_from_capability(props.major, props.minor),
        "sm_count": props.multi_processor_count,
        "memory_gib": round(props.total_memory / 2**30, 1),
        "integrated": bool(getattr(props, "is_integrated", False)),
    }


def _pycuda() -> str | None:
    """PyCUDA's version, None when it is not importable. One built in place and put on the path (as the GPU
    check does) has no package metadata but loads the kernels all the same: its own VERSION_TEXT says then."""
    if importlib.util.find_spec("pycuda") is None:
        return None
    try:
        return importlib.metadata.version("pycuda")
    except importlib.metadata.PackageNotFoundError:
        import pycuda

        return pycuda.VERSION_TEXT


def _cache(cache_dir: str) -> dict[str, Any]:
    path = Path(cache_dir).expanduser() if cache_dir else default_cache_dir()
    problem = cache_writable(path)
    return {
        "directory": str(path),
        "writable": problem is None,
        "problem": problem,
        "cubins": [p.name for p in B.cached_cubins(path)],
    }


def _build_one(module: str, cfg: B.BuildConfig) -> tuple[dict[str, Any], B.CompiledModule | None]:
    """One module for ``cfg.dtype``: its report (built, cached, seconds, cubin size) and the module."""
    t0 = time.perf_counter()
    try:
        compiled = B.build_module(module, cfg)
    except B.KernelBuildError as exc:
        return {"built": False, "error": str(exc)}, None
    report = {
        "built": True,
        "cached": compiled.cache_hit,
        "seconds": round(time.perf_counter() - t0, 2),
        "cubin_bytes": len(compiled.cubin),
    }
    return report, compiled


def _build_and_load(
    kernel_dir: Path, arch: str, cache_dir: str, dtypes: Sequence[str]
) -> tuple[dict[str, Any], bool, str]:
    """Build every module for each of ``dtypes`` (in parallel, as the node does), load them all in torch's
    context; (report: "<module> <dtype>" -> the build's figures and kernels loaded, all ok, whether launches
    are programmatic-dependent: "on" or "off (why)")."""
    jobs = [(m, B.BuildConfig(arch=arch, kernel_dir=kernel_dir, cache_dir=cache_dir, dtype=d))
            for d in dtypes for m in sorted(KERNEL_MODULES)]  # fmt: skip
    keys = [f"{m} {cfg.dtype}" for m, cfg in jobs]
    outcomes = dict(zip(keys, in_parallel(lambda job: _build_one(*job), jobs, len(jobs)), strict=True))
    report = {key: r for key, (r, _) in outcomes.items()}
    built = {key: c for key, (_, c) in outcomes.items() if c is not None}
    ok = len(built) == len(jobs)
    if not built:
        return report, False, "off (no module built)"
    try:
        from .runtime import KernelRuntime

        runtime = KernelRuntime(list(built.values()), torch.device("cuda", 0))
    except (ImportError, OSError, RuntimeError) as exc:
        for key in built:
            report[key].update(loaded=0, error=f"loading failed: {type(exc).__name__}: {exc}")
        return report, False, "off (the kernels did not load)"
    loaded = set(runtime.kernels())
    for key, compiled in built.items():
        entry = report[key]
        entry["loaded"] = sum(name in loaded for name in compiled.kernels)
        entry["expected"] = len(compiled.kernels)
        ok = ok and entry["loaded"] == entry["expected"]
    status = runtime.programmatic_status
    runtime.close()
    return report, ok, status


def collect(
    kernel_dir: str = "", cache_dir: str = "", build: bool = True, dtypes: Sequence[str] = tuple(DTYPE_TAGS.values())
) -> tuple[dict[str, Any], int]:
    """Everything the command reports, as a dict, and the exit status; ``dtypes``: the storage types to build
    the kernels of (``launch.DTYPE_TAGS`` values)."""
    info: dict[str, Any] = {"python": sys.version.split()[0], "torch": torch.__version__}
    status = EXIT_OK
    try:
        sources = find_kernel_sources(kernel_dir)
        info["kernel_sources"] = {
            "directory": str(sources.directory),
            "found_by": sources.found_by,
            "modules": [f"{m}.cu" for m in sources.modules],
        }
    except KernelSourcesNotFound as exc:
        sources = None
        info["kernel_sources"] = {"directory": None, "error": str(exc)}
        status = EXIT_NO_SOURCES
    info["nvcc"] = _nvcc()
    info["gpu"] = _gpu()
    info["pycuda"] = _pycuda()
    info["cache"] = _cache(cache_dir)
    if sources is None:
        info["kernels"] = "not built: no kernel sources"
    elif not info["gpu"]["available"]:
        info["kernels"] = "not built: no CUDA device"
    elif not build:
        info["kernels"] = "not built: --no-build"
    else:
        report, ok, info["programmatic_launch"] = _build_and_load(
            sources.directory, info["gpu"]["arch"], cache_dir, dtypes
        )
        info["kernels"] = report
        if not ok:
            status = EXIT_BUILD_FAILED
    return info, status


def render(info: dict[str, Any]) -> str:
    """The human-readable report."""
    src = info["kernel_sources"]
    lines = ["orin_vlm_node CUDA diagnostics", f"python {info['python']}, torch {info['torch']}"]
    if src["directory"]:
        lines.append(f"kernel sources : {src['directory']} ({src['found_by']})")
        lines.append(f"  modules      : {', '.join(src['modules'])}")
    else:
        lines.append(f"kernel sources : NOT FOUND: {src['error']}")
    nvcc = info["nvcc"]
    lines.append(
        f"nvcc           : {nvcc['path']} ({nvcc['version']})" if "version" in nvcc else f"nvcc : {nvcc['error']}"
    )
    gpu = info["gpu"]
    if gpu["available"]:
        kind = "integrated, shares system memory" if gpu["integrated"] else "discrete"
        lines.append(
            f"GPU            : {gpu['name']} ({gpu['arch']}, {gpu['sm_count']} SMs, {gpu['memory_gib']} GiB, {kind})"
        )
    else:
        lines.append(f"GPU            : {gpu['reason']}")
    lines.append(f"PyCUDA         : {info['pycuda'] or 'not installed (pip install pycuda)'}")
    cache = info["cache"]
    state = "writable" if cache["writable"] else f"NOT writable ({cache['problem']}); cubins are rebuilt every start"
    lines.append(f"kernel cache   : {cache['directory']} ({state}), {len(cache['cubins'])} cubin(s) cached")
    lines.extend(f"  {name}" for name in cache["cubins"])
    kernels = info["kernels"]
    if isinstance(kernels, str):
        lines.append(f"kernels        : {kernels}")
    else:
        for module, r in kernels.items():
            if not r["built"]:
                lines.append(f"{module:29s}: BUILD FAILED: {r['error']}")
                continue
            how = "from cache" if r["cached"] else f"compiled in {r['seconds']} s"
            loaded = f"{r.get('loaded', 0)}/{r['expected']} kernels loaded" if "expected" in r else "not loaded"
            lines.append(f"{module:29s}: {how}, {loaded}" + (f" ({r['error']})" if "error" in r else ""))
        lines.append(f"programmatic dependent launch: {info['programmatic_launch']}")
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m orin_vlm_node.cuda", description=__doc__.splitlines()[0])
    ap.add_argument("--kernel-dir", default="", help="kernel sources to use instead of the installed ones")
    ap.add_argument("--kernel-cache-dir", default="", help="cubin cache (default: ~/.cache/orin_vlm_node/kernels)")
    ap.add_argument("--no-build", action="store_true", help="on a GPU, do not build and load the kernels")
    ap.add_argument("--dtype", choices=(*DTYPE_CHOICES, "all"), default="all",
                    help="the dtype whose kernels to build and load (the node's `dtype`; default all)")  # fmt: skip
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of the report")
    args = ap.parse_args(argv)
    dtypes = DTYPE_TAGS.values() if args.dtype == "all" else (DTYPE_TAGS[dtype_name(resolve_dtype(args.dtype))],)
    info, status = collect(args.kernel_dir, args.kernel_cache_dir, build=not args.no_build, dtypes=tuple(dtypes))
    sys.stdout.write(json.dumps(info, indent=1) + "\n" if args.json else render(info))
    if status == EXIT_NO_SOURCES:
        print(f"error: {info['kernel_sources']['error']}", file=sys.stderr)
    elif status == EXIT_BUILD_FAILED:
        print("error: some kernel modules failed to build or load (see above)", file=sys.stderr)
    return status
