"""Where the kernel sources (``kernels/*.cu``, ``*.cuh``) are, in every way the package gets installed.

The kernels are compiled on the robot at startup, so the ``.cu`` files must be found next to whichever
copy of ``orin_vlm_node`` is running. They are not Python package data; ``setup.py`` installs them as
data files, so their place depends on the install:

More in docs/modules.md, ``orin_vlm_node/cuda/sources.py``.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

from .build import KernelBuildError
from .launch import KERNEL_MODULES

PACKAGE = "orin_vlm_node"
# Ancestors of the package directory that may be an install prefix: site-packages (1), pythonX.Y (2),
# lib (3), prefix (4); Debian's local/lib/python3/dist-packages puts the prefix at 5.
_PREFIX_DEPTH = 6


class KernelSourcesNotFound(KernelBuildError):
    """No directory with the kernel sources was found; the message lists every place looked at."""


@dataclass(frozen=True)
class KernelSources:
    """A directory holding every kernel module, and how it was found (for logs and diagnostics)."""

    directory: Path
    found_by: str
    modules: tuple[str, ...]


def required_modules() -> tuple[str, ...]:
    """The ``.cu`` modules the runtime loads (``launch.KERNEL_MODULES``)."""
    return tuple(sorted(KERNEL_MODULES))


def _problem(path: Path) -> str | None:
    """Why ``path`` cannot serve as the kernel directory, or None when it can."""
    if not path.is_dir():
        return "does not exist or is not a directory"
    present = sorted(p.stem for p in path.glob("*.cu"))
    if not present:
        return "holds no .cu files"
    missing = [m for m in required_modules() if m not in present]
    if missing:
        return f"lacks {', '.join(m + '.cu' for m in missing)} (has {', '.join(p + '.cu' for p in present)})"
    return None


def check_kernel_dir(directory: str | Path) -> KernelSources:
    """Validate the ``kernel_dir`` setting; KernelSourcesNotFound says what is wrong with it."""
    path = Path(directory).expanduser()
    problem = _problem(path)
    if problem:
        raise KernelSourcesNotFound(f"kernel_dir {str(path)!r} {problem}")
    return KernelSources(path.resolve(), "kernel_dir setting", required_modules())


def candidate_dirs() -> list[tuple[str, Path]]:
    """(how, directory) pairs in the order they are tried when no kernel_dir is set."""
    here = Path(__file__).absolute().parent.parent  # the running orin_vlm_node package
    out: list[tuple[str, Path]] = []
    for package_dir in dict.fromkeys((here, here.resolve())):  # colcon --symlink-install links back to src
        if (package_dir.parent / "package.xml").is_file():
            out.append(("source checkout", package_dir.parent / "kernels"))
        for ancestor in list(package_dir.parents)[:_PREFIX_DEPTH]:
            out.append((f"install prefix {ancestor}", ancestor / "share" / PACKAGE / "kernels"))
    share = _ament_share_dir()
    if share is not None:
        out.append(("ament index", share / "kernels"))
    out.append((f"sys.prefix {sys.prefix}", Path(sys.prefix) / "share" / PACKAGE / "kernels"))
    seen: set[Path] = set()
    unique = []
    for how, path in out:
        if path not in seen:
            seen.add(path)
            unique.append((how, path))
    return unique


def _ament_share_dir() -> Path | None:
    """share/orin_vlm_node of the prefix AMENT_PREFIX_PATH registers for us (a sourced colcon install)."""
    try:
        from ament_index_python.packages import PackageNotFoundError, get_package_share_directory
    except ImportError:
        return None
    try:
        return Path(get_package_share_directory(PACKAGE))
    except (PackageNotFoundError, ValueError, OSError):
        return None


def find_kernel_sources(kernel_dir: str = "") -> KernelSources:
    """The kernel sources: ``kernel_dir`` when given (it must be valid), else the nearest valid candidate."""
    if kernel_dir:
        return check_kernel_dir(kernel_dir)
    tried = []
    for how, path in candidate_dirs():
        problem = _problem(path)
        if problem is None:
            return KernelSources(path.resolve(), how, required_modules())
        tried.append(f"{path} ({how}): {problem}")
    raise KernelSourcesNotFound(
        "kernel sources not found (reinstall the package, or set kernel_dir to the folder with "
        f"{', '.join(m + '.cu' for m in required_modules())}); looked in: " + "; ".join(tried)
    )
