"""``make gpu-wheels`` and ``bench/gpu_check.py`` on a machine without a GPU: the download, and every step
up to the first GPU call, which must fail with a clear reason and leave a complete report behind.

The download needs the package index (as ``make test`` itself does); the wheels are fetched for this
interpreter's Python so the install step can run here. PyCUDA's build is not run: it cannot link here
(no libcuda), and takes minutes on two cores.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.starts_first

REPO = Path(__file__).resolve().parent.parent
CONFIG_2B = REPO.parent / "shared" / "model-configs" / "Qwen3-VL-2B-Instruct.config.json"


def _stand_in_prebuilt(folder: Path) -> Path:
    """An archive named as a CUDA machine's PyCUDA build is (``prebuilt_name``), holding a package that stands
    in for the build: importable, with a driver module."""
    import tarfile

    from bench.gpu_check import prebuilt_name

    package = folder.parent / "stand-in" / "pycuda"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text('VERSION_TEXT = "prebuilt-stand-in"\n')
    (package / "driver.py").write_text("")
    folder.mkdir(parents=True, exist_ok=True)
    with tarfile.open(folder / prebuilt_name(), "w:gz") as tar:
        tar.add(package, arcname="pycuda")
    return folder / prebuilt_name()


@pytest.fixture(scope="module")
def wheels(tmp_path_factory) -> Path:
    """``make gpu-wheels`` into a folder where an earlier run on a CUDA machine left its PyCUDA build: the
    download replaces what it fetches and keeps the build (which only a CUDA machine can make)."""
    if not CONFIG_2B.is_file():
        pytest.skip(f"{CONFIG_2B} not found (the 2B config travels with the wheels)")
    out = tmp_path_factory.mktemp("gpu") / "wheels"
    prebuilt = _stand_in_prebuilt(out)
    (out / "pycuda-0.1.tar.gz").write_text("an earlier download")  # fetched again: replaced
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    proc = subprocess.run(
        [
            "make",
            "-s",
            "gpu-wheels",
            f"GPU_WHEELS_DIR={out}",
            f"GPU_PY_VERSION={version}",
            f"GPU_BIG_CONFIG={CONFIG_2B}",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert prebuilt.is_file() and not (out / "pycuda-0.1.tar.gz").exists()
    return out


def test_gpu_wheels_holds_what_a_bare_cuda_machine_lacks(wheels):
    names = sorted(p.name for p in wheels.iterdir())
    assert any(n.startswith("pycuda-") and n.endswith(".tar.gz") for n in names), names
    for package in ("pytools", "platformdirs", "mako", "siphash24", "transformers-"):  # pins per Python: Makefile
        assert any(n.startswith(package) and n.endswith(".whl") for n in names), (package, names)
    deps = sorted(p.name for p in (wheels / "deps").iterdir())  # what transformers needs on a bare machine
    for package in ("tokenizers-", "huggingface_hub-", "safetensors-", "numpy-", "regex-"):
        assert any(n.startswith(package) for n in deps), (package, deps)
    assert not any(n.startswith("transformers-") for n in deps), deps
    assert json.loads((wheels / "Qwen3-VL-2B-Instruct.config.json").read_text())["text_config"]["num_hidden_layers"]


def test_gpu_wheels_for_a_jetson_resolve_for_its_python_and_arch(tmp_path):
    """JetPack 6 ships Python 3.10 on aarch64: the pins for that Python exist there (platformdirs and
    transformers stop supporting 3.10 before the default pins), with aarch64 builds where a wheel is native."""
    if not CONFIG_2B.is_file():
        pytest.skip(f"{CONFIG_2B} not found (the 2B config travels with the wheels)")
    out = tmp_path / "jetson"
    make = ["make", "-s", "gpu-wheels", f"GPU_WHEELS_DIR={out}", "GPU_PY_VERSION=3.10", "GPU_ARCH=aarch64",
            f"GPU_BIG_CONFIG={CONFIG_2B}"]  # fmt: skip
    proc = subprocess.run(make, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    names = sorted(p.name for p in out.iterdir())
    for package in ("pycuda-2026.1.tar.gz", "platformdirs-4.12.4-", "transformers-5.20.2-", "pytools-", "mako-"):
        assert any(n.startswith(package) for n in names), (package, names)
    native = [n for n in names if n.endswith(".whl") and not n.endswith("py3-none-any.whl")]
    assert native and all("cp310" in n and "aarch64" in n for n in native), names
    deps = sorted(p.name for p in (out / "deps").iterdir())
    assert any(n.startswith("tokenizers-") and "aarch64" in n for n in deps), deps
    assert any(n.startswith("numpy-") and "cp310" in n and "aarch64" in n for n in deps), deps


def test_gpu_check_runs_up_to_the_first_gpu_call_and_reports(wheels, tmp_path):
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "-m", "bench.gpu_check", "--wheels", str(wheels), "--out", str(out),
         "--steps", "preflight,wheels,device,diagnostics,bench"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )  # fmt: skip
    assert proc.returncode == 1, proc.stdout + proc.stderr
    report = json.loads((out / "gpu_check.json").read_text())
    steps = report["steps"]
    assert steps["preflight"]["status"] == "ok" and steps["preflight"]["nvcc"]
    wheels_step = steps["wheels"]
    assert wheels_step["status"] == "ok" and wheels_step["installed"][:5] == sorted(
        p.name for p in wheels.glob("*.whl")
    )
    # Of transformers' dependencies only what this Python lacks is installed (it has tokenizers, numpy...).
    extra = wheels_step["installed"][5:]
    assert not [n for n in extra if n.startswith(("tokenizers-", "numpy-", "safetensors-", "huggingface_hub-"))]
    assert wheels_step["dependencies_present"] + len(extra) == len(list((wheels / "deps").glob("*.whl")))
    assert steps["device"]["status"] == "failed"
    assert "no CUDA device" in steps["device"]["reason"]
    assert steps["diagnostics"]["status"] == "skipped" and "needs pycuda, device" in steps["diagnostics"]["reason"]
    assert steps["bench"]["status"] == "skipped" and report["ok"] is False
    log = (out / "gpu_check.log").read_text()
    assert "device: failed" in log and "FAILED in" in log


def test_gpu_check_without_the_wheels_says_how_to_get_them(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "bench.gpu_check", "--wheels", str(tmp_path / "none"), "--out", str(tmp_path / "out"),
         "--steps", "preflight"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )  # fmt: skip
    assert proc.returncode == 1
    reason = json.loads((tmp_path / "out" / "gpu_check.json").read_text())["steps"]["preflight"]["reason"]
    assert "make gpu-wheels" in reason and "PyCUDA sdist" in reason


def test_gpu_check_refuses_an_unknown_bench_part_before_any_step(tmp_path):
    """A misspelt part would otherwise end the bench step after the device minutes of the steps before it."""
    proc = subprocess.run(
        [sys.executable, "-m", "bench.gpu_check", "--wheels", str(tmp_path / "none"), "--out", str(tmp_path / "out"),
         "--bench-parts", "kernels,startup"],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 2 and "unknown bench part(s) ['startup']" in proc.stderr, proc.stderr
    assert "startup_memory" in proc.stderr and not (tmp_path / "out").exists()


def test_gpu_check_takes_the_pycuda_an_earlier_run_archived(wheels, tmp_path):
    """The fixture's folder holds a stand-in for the build (``_stand_in_prebuilt``): the check installs it
    instead of building the sdist."""
    from bench.gpu_check import prebuilt_name

    out = tmp_path / "out"
    subprocess.run(
        [sys.executable, "-m", "bench.gpu_check", "--wheels", str(wheels), "--out", str(out),
         "--steps", "preflight,wheels,pycuda"],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    step = json.loads((out / "gpu_check.json").read_text())["steps"]["pycuda"]
    assert step["status"] == "ok", step
    assert step["prebuilt"] == prebuilt_name() and step["version"] == "prebuilt-stand-in"
