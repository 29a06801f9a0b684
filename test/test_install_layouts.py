"""The package as users install it, used from outside the checkout.

Two installs into temporary prefixes: ``pip install --prefix`` (what ``make install`` and a venv do) and
colcon's ament_python layout (the exact ``setup.py egg_info build install --single-version-externally-
managed`` sequence colcon runs, with ``AMENT_PREFIX_PATH`` as a sourced workspace sets it). In each the
ROS 2 files are where ``ros2 run`` / ``ros2 launch`` look, and ``python -m orin_vlm_node.cuda`` run from
another directory finds the kernel sources of *that* install. Neither install may touch the venv's own
copy of the package (pip would uninstall it without ``--ignore-installed``).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PACKAGE = "orin_vlm_node"


def _venv_copy() -> list[str]:
    """The package's files in this interpreter's own site-packages (what must stay as it is)."""
    purelib = Path(sysconfig.get_paths()["purelib"])
    return sorted(str(p.relative_to(purelib)) for p in purelib.glob(f"{PACKAGE}*") for p in [p, *p.rglob("*")])


def _site_packages(prefix: Path) -> Path:
    found = sorted(prefix.glob("lib/python3*/site-packages")) + sorted(prefix.glob("local/lib/python3*/dist-packages"))
    assert found, f"no site-packages under {prefix}"
    return found[0]


def _run(args: list[str], cwd: Path, pythonpath: Path, ament_prefix: Path | None) -> subprocess.CompletedProcess:
    """Run with only the install on PYTHONPATH, from ``cwd`` (never the checkout)."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "AMENT_PREFIX_PATH")}
    env["PYTHONPATH"] = str(pythonpath)
    if ament_prefix is not None:
        env["AMENT_PREFIX_PATH"] = str(ament_prefix)
    return subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def pip_prefix(tmp_path_factory) -> Path:
    prefix = tmp_path_factory.mktemp("pip") / "prefix"
    before = _venv_copy()
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--ignore-installed"]
    env = dict(os.environ, PIP_DISABLE_PIP_VERSION_CHECK="1")
    subprocess.run([*cmd, "--prefix", str(prefix), str(REPO)], check=True, env=env, cwd=prefix.parent, timeout=300)
    assert _venv_copy() == before, "pip install --prefix changed the venv's own installation"
    return prefix


@pytest.fixture(scope="module")
def colcon_prefix(tmp_path_factory) -> Path:
    """install/orin_vlm_node as ``colcon build`` (ament_python, no --symlink-install) lays it out."""
    root = tmp_path_factory.mktemp("colcon")
    build, prefix = root / "build" / PACKAGE, root / "install" / PACKAGE
    build.mkdir(parents=True)
    python_lib = prefix / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages"
    python_lib.mkdir(parents=True)
    before = _venv_copy()
    cmd = [sys.executable, "setup.py", "egg_info", "--egg-base", os.path.relpath(build, REPO)]
    cmd += ["build", "--build-base", str(build / "build"), "install", "--prefix", str(prefix)]
    cmd += ["--record", str(build / "install.log"), "--single-version-externally-managed"]
    env = dict(os.environ, PYTHONPATH=str(python_lib))
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert _venv_copy() == before, "the colcon-style install changed the venv's own installation"
    return prefix


@pytest.mark.parametrize("layout", ["pip_prefix", "colcon_prefix"])
def test_ros_files_are_where_ros2_looks(layout, request):
    prefix: Path = request.getfixturevalue(layout)
    share = prefix / "share" / PACKAGE
    assert (share / "package.xml").is_file()
    assert (prefix / "share" / "ament_index" / "resource_index" / "packages" / PACKAGE).is_file()
    assert list((share / "launch").glob("*.launch.py"))
    assert (share / "config" / "orin_vlm.yaml").is_file()
    assert {p.name for p in (share / "kernels").iterdir()} >= {
        "paged_decode_attention.cu",
        "paged_prefill_attention.cu",
        "paged_kv_write.cu",
        "attention_common.cuh",
        "compat.cuh",
        "cpu_gemm.cpp",
    }
    assert (_site_packages(prefix) / PACKAGE / "default_model" / "model.safetensors").is_file()


@pytest.mark.parametrize("layout", ["pip_prefix", "colcon_prefix"])
def test_the_ros2_run_launcher_starts_the_installed_node(layout, request, tmp_path):
    """``ros2 run orin_vlm_node vlm_node`` executes lib/orin_vlm_node/vlm_node; it must reach the node of
    this install (a bad parameter makes it stop right after parsing, before the model loads)."""
    prefix: Path = request.getfixturevalue(layout)
    launcher = prefix / "lib" / PACKAGE / "vlm_node"
    for name in ("vlm_node", "vlm_lifecycle_node"):  # the managed node's launcher is installed beside it
        assert os.access(prefix / "lib" / PACKAGE / name, os.X_OK), name
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "AMENT_PREFIX_PATH")}
    env.update(PYTHONPATH=str(_site_packages(prefix)), ROS_LOG_DIR=str(tmp_path / "ros_log"))
    # pip keeps the launcher's "#!/usr/bin/env python3": the python of the active environment (as with a
    # sourced ROS install or an activated venv), here the interpreter running the tests.
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    proc = subprocess.run(
        [str(launcher), "--ros-args", "-p", "page_size:=3"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "page_size must be a power of two" in proc.stdout + proc.stderr


@pytest.mark.parametrize("layout", ["pip_prefix", "colcon_prefix"])
def test_diagnostics_find_the_kernels_of_the_install_from_outside_the_checkout(layout, request, tmp_path):
    prefix: Path = request.getfixturevalue(layout)
    site = _site_packages(prefix)
    which = _run(["-c", "import orin_vlm_node; print(orin_vlm_node.__file__)"], tmp_path, site, prefix)
    assert which.stdout.strip() == str(site / PACKAGE / "__init__.py"), which.stderr
    proc = _run(["-m", "orin_vlm_node.cuda"], tmp_path, site, prefix)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    kernels = prefix / "share" / PACKAGE / "kernels"
    assert f"kernel sources : {kernels} (install prefix {prefix})" in proc.stdout
    assert "paged_decode_attention.cu, paged_kv_write.cu, paged_prefill_attention.cu" in proc.stdout
    for line in ("nvcc ", "GPU ", "PyCUDA ", "kernel cache "):
        assert any(row.startswith(line) for row in proc.stdout.splitlines()), f"no {line.strip()} line"


@pytest.mark.parametrize("layout", ["pip_prefix", "colcon_prefix"])
def test_the_install_builds_its_cpu_kernel_from_outside_the_checkout(layout, request, tmp_path):
    """The CPU decode path's GEMM is compiled from the install's own ``share/.../kernels`` at startup."""
    prefix: Path = request.getfixturevalue(layout)
    code = (
        "import sys; from orin_vlm_node.cpu import load_cpu_gemm; import orin_vlm_node.cuda.sources as s; "
        "print(s.find_kernel_sources().directory); print(load_cpu_gemm(cache_dir=sys.argv[1]).origin)"
    )
    proc = _run(["-c", code, str(tmp_path / "cache")], tmp_path, _site_packages(prefix), prefix)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    directory, origin = proc.stdout.split("\n")[:2]
    assert directory == str(prefix / "share" / PACKAGE / "kernels") and origin.startswith("compiled in")
    assert list((tmp_path / "cache").glob("cpu_gemm-*.so.cache"))


def test_colcon_install_is_found_through_the_ament_index(colcon_prefix, tmp_path):
    """A package directory away from its prefix (as an overlay can arrange) still finds the prefix's kernels
    through AMENT_PREFIX_PATH, as ``ros2 pkg prefix`` would."""
    elsewhere = tmp_path / "elsewhere"
    shutil.copytree(_site_packages(colcon_prefix) / PACKAGE, elsewhere / PACKAGE)
    proc = _run(["-m", "orin_vlm_node.cuda", "--json"], tmp_path, elsewhere, colcon_prefix)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f'"directory": "{colcon_prefix / "share" / PACKAGE / "kernels"}"' in proc.stdout
    assert '"found_by": "ament index"' in proc.stdout


def test_a_kernel_dir_that_is_not_one_exits_nonzero_with_the_reason(pip_prefix, tmp_path):
    site = _site_packages(pip_prefix)
    missing = _run(["-m", "orin_vlm_node.cuda", "--kernel-dir", str(tmp_path / "nope")], tmp_path, site, None)
    assert missing.returncode == 2
    assert f"kernel_dir '{tmp_path / 'nope'}' does not exist" in missing.stderr
    (tmp_path / "empty").mkdir()
    empty = _run(["-m", "orin_vlm_node.cuda", "--kernel-dir", str(tmp_path / "empty")], tmp_path, site, None)
    assert empty.returncode == 2 and "holds no .cu files" in empty.stderr
