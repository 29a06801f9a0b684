"""``make gpu-check``: prove the GPU path on a bare CUDA machine (torch + nvcc, no internet), one command.

What cannot be downloaded there travels in a folder made beforehand by ``make gpu-wheels`` on a machine
with a package index (default ``.gpu-wheels/``): the PyCUDA sdist, the wheels of its dependencies and of
the pinned transformers (the parity reference), and the Qwen3-VL-2B config whose dimensions the
benchmark checkpoint takes. The steps, each timed and recorded:

1. ``preflight``  python, torch (and its CUDA), nvcc, the wheel folder's contents;
2. ``wheels``     install the wheels into a private folder (``--target``; the system is not touched), and
                  of the parity reference's dependencies (``deps/``) those this Python lacks;
3. ``pycuda``     build PyCUDA from its sdist against this machine's CUDA (about 80 s), or take the
                  archive an earlier run made (``pycuda-built-cp<py>-cuda<release>.tgz`` in the wheel folder);
4. ``device``     the first GPU call: torch sees a CUDA device (name, architecture, memory);
5. ``diagnostics`` ``python -m orin_vlm_node.cuda``: the kernels build and load from this checkout;
6. ``gpu_tests``  the GPU tests (kernels against torch, CUDA-graph decode, the engine on CUDA);
7. ``cli_parity`` the CLI on a tiny random checkpoint against transformers on CUDA: fp32 must give the
                  same greedy tokens, bf16/fp16 report how far they agree;
8. ``bench``      the benchmarks' ``gpu`` section on a random checkpoint with every dimension of the 2B.

Writes ``gpu_check.json`` (every step's status, timing and figures) and ``gpu_check.log`` (everything the
steps printed) to ``--out`` (default ``$OUT`` when set, else ``gpu-check-out/``). A step whose
prerequisite failed is skipped with the reason; the exit status is 0 only when every step that ran
passed. Steps can be chosen with ``--steps`` and the benchmark's parts with ``--bench-parts`` (run first, in
the order given: what a change touched); on a machine without a GPU the steps before ``device`` run
and ``device`` fails with "no CUDA device".
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import shutil
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from bench.config import BenchConfig, chosen_parts, part_names
from bench.gpu_check_state import REPO, Check, StepFailed

STEPS = ("preflight", "wheels", "pycuda", "device", "diagnostics", "gpu_tests", "cli_parity", "bench")
NEEDS = {  # step -> steps that must have passed first
    "pycuda": ("wheels",),
    "device": (),
    "diagnostics": ("pycuda", "device"),
    "gpu_tests": ("pycuda", "device"),
    "cli_parity": ("pycuda", "device", "wheels"),
    "bench": ("pycuda", "device", "wheels"),
}
# The wheels must match what `make gpu-wheels` downloads (the Makefile's GPU_WHEELS list).
DEP_WHEELS = ("pytools", "platformdirs", "mako", "siphash24", "transformers")
CONFIG_2B = "Qwen3-VL-2B-Instruct.config.json"
GPU_TESTS = (
    "test/test_cuda_gpu.py",
    "test/test_cuda_gpu_engine.py",
    "test/test_cuda_nvcc_archs.py",
    "test/test_kvcache_attention.py",
)
PARITY_PROMPT = "Describe the image."
PARITY_TOKENS = 32
BENCH_PART_S = 90.0  # about the longest part of the GPU benchmark section (the decode of one dtype)


# ---------------------------------------------------------------------------------------------- steps


def preflight(c: Check) -> dict[str, Any]:
    info: dict[str, Any] = {"python": sys.version.split()[0], "executable": sys.executable}
    try:
        import torch
    except ImportError as exc:
        raise StepFailed(f"torch is not importable by {sys.executable}: {exc}") from exc
    info.update(torch=torch.__version__, torch_cuda=torch.version.cuda)
    from orin_vlm_node.cuda.build import KernelBuildError, find_nvcc, nvcc_version

    try:
        nvcc = find_nvcc()
        info.update(nvcc=nvcc, nvcc_version=nvcc_version(nvcc))
    except KernelBuildError as exc:
        raise StepFailed(str(exc)) from exc
    sdists = sorted(c.wheels.glob("pycuda-*.tar.gz"))
    missing = [name for name in DEP_WHEELS if not list(c.wheels.glob(f"{name}-*.whl"))]
    if not c.wheels.is_dir() or not sdists or missing or not (c.wheels / CONFIG_2B).is_file():
        raise StepFailed(
            f"{c.wheels} lacks " + ", ".join([*(["the PyCUDA sdist"] if not sdists else []), *missing, CONFIG_2B])
            + ": run `make gpu-wheels` on a machine with a package index first and bring the folder along"
        )  # fmt: skip
    info["files"] = sorted(p.name for p in c.wheels.iterdir())
    tags = {p.name.split("-")[-3] for p in c.wheels.glob("*.whl") if not p.name.endswith("py3-none-any.whl")}
    want = f"cp{sys.version_info.major}{sys.version_info.minor}"
    if tags - {want, "abi3"}:
        raise StepFailed(f"wheels built for {sorted(tags)} but this python is {want}: rerun make gpu-wheels")
    return info


def wheels(c: Check) -> dict[str, Any]:
    """The pinned wheels (PyCUDA's dependencies, the parity reference) into a private folder, and of the
    reference's dependencies (``deps/``) those this Python does not have: the folder comes first on the
    children's path, so a package the machine already has (numpy, which its torch was built with) must not
    be shadowed by another version."""
    site = c.work / "site"
    files = sorted(c.wheels.glob("*.whl"))
    deps = sorted((c.wheels / "deps").glob("*.whl"))
    missing = [p for p in deps if not _installed(p.name.split("-")[0])]
    c.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
           "--disable-pip-version-check", "--target", str(site), *map(str, files + missing)], 300)  # fmt: skip
    c.pythonpath.append(str(site))
    present = len(deps) - len(missing)
    return {"target": str(site), "installed": [p.name for p in files + missing], "dependencies_present": present}


def _installed(distribution: str) -> bool:
    """Whether this Python has ``distribution`` (a wheel's name: ``huggingface_hub``, ``PyYAML``...)."""
    import importlib.metadata

    try:
        importlib.metadata.distribution(distribution)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def pycuda(c: Check) -> dict[str, Any]:
    """PyCUDA from a prebuilt archive of an earlier run on a machine of the same Python and CUDA (seconds),
    else built from its sdist (about 80 s on 16 cores); a fresh build is archived into ``--out`` for the
    next run (bring it along in the wheel folder: ``make gpu-wheels`` keeps it)."""
    archive = c.wheels / prebuilt_name()
    if archive.is_file():
        try:
            return _use_prebuilt(c, archive)
        except (StepFailed, OSError, tarfile.TarError) as exc:
            c.log(f"prebuilt {archive.name} unusable ({exc}); building from the sdist")
    sdist = sorted(c.wheels.glob("pycuda-*.tar.gz"))[-1]
    with tarfile.open(sdist) as tar:
        tar.extractall(c.work, filter="data")
    src = c.work / sdist.name.removesuffix(".tar.gz")
    cuda_root = _cuda_root()
    # The node only uses the driver API: no CURAND (one library less to find, a faster build).
    c.run([sys.executable, "configure.py", f"--cuda-root={cuda_root}", "--no-cuda-enable-curand"], 120, cwd=src)
    jobs = str(os.cpu_count() or 4)
    c.run([sys.executable, "setup.py", "build_ext", "--inplace", "-j", jobs], 600, cwd=src)
    c.pythonpath.insert(0, str(src))
    version = c.python("import json, pycuda; print(json.dumps(pycuda.VERSION_TEXT))", 60)
    with tarfile.open(c.out / archive.name, "w:gz") as tar:
        tar.add(src / "pycuda", arcname="pycuda", filter=lambda m: None if m.name.endswith(".o") else m)
    return {"sdist": sdist.name, "cuda_root": str(cuda_root), "version": version, "archived": archive.name}


def prebuilt_name() -> str:
    """``pycuda-built-cp312-cuda13.0.tgz``: the archive of a PyCUDA built for this Python and CUDA release."""
    from orin_vlm_node.cuda.build import find_nvcc, nvcc_version

    release = nvcc_version(find_nvcc()).split("release ")[1].split(",")[0]
    return f"pycuda-built-cp{sys.version_info.major}{sys.version_info.minor}-cuda{release}.tgz"


def _use_prebuilt(c: Check, archive: Path) -> dict[str, Any]:
    target = c.work / "pycuda-prebuilt"
    with tarfile.open(archive) as tar:
        tar.extractall(target, filter="data")
    c.pythonpath.insert(0, str(target))
    version = c.python("import json, pycuda.driver, pycuda; print(json.dumps(pycuda.VERSION_TEXT))", 60)
    return {"prebuilt": archive.name, "version": version}


def _cuda_root() -> Path:
    """The CUDA toolkit PyCUDA compiles against: $CUDA_HOME, the toolkit of the nvcc in use, /usr/local/cuda."""
    from orin_vlm_node.cuda.build import find_nvcc

    candidates = [os.environ.get("CUDA_HOME", ""), str(Path(find_nvcc()).resolve().parent.parent), "/usr/local/cuda"]
    for root in filter(None, candidates):
        if (Path(root) / "include" / "cuda.h").is_file():
            return Path(root)
    raise StepFailed(f"no CUDA toolkit with include/cuda.h among {[c for c in candidates if c]}; set CUDA_HOME")


def device(c: Check) -> dict[str, Any]:
    code = (
        "import json, torch\n"
        "if not torch.cuda.is_available():\n"
        "    print(json.dumps({'error': 'no CUDA device (torch.cuda.is_available() is False)'}))\n"
        "else:\n"
        "    p = torch.cuda.get_device_properties(0)\n"
        "    print(json.dumps({'name': p.name, 'capability': f'{p.major}.{p.minor}', 'sm_count':\n"
        "        p.multi_processor_count, 'memory_gib': round(p.total_memory / 2**30, 1),\n"
        "        'integrated': bool(p.is_integrated)}))\n"
    )
    info = c.python(code, 120)
    if "error" in info:
        raise StepFailed(info["error"])
    return info


def diagnostics(c: Check) -> dict[str, Any]:
    t0 = time.monotonic()
    info = json.loads(c.run([sys.executable, "-m", "orin_vlm_node.cuda", "--json"], 600))
    info["seconds"] = round(time.monotonic() - t0, 1)
    return info


def gpu_tests(c: Check) -> dict[str, Any]:
    junit = c.out / "gpu_tests.xml"
    out = c.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--junitxml", str(junit),
                 *GPU_TESTS], 600)  # fmt: skip
    summary = [line for line in out.splitlines() if " passed" in line or " failed" in line or " skipped" in line]
    if " skipped" in (summary[-1] if summary else "") and " passed" not in summary[-1]:
        raise StepFailed(f"the GPU tests were all skipped: {summary[-1]}")
    return {"summary": summary[-1] if summary else out.strip().splitlines()[-1], "junit": junit.name}


PARITY_CODE = r"""
import json, sys
import numpy as np, torch
from support.checkpoints import make_tiny_checkpoint
from transformers import Qwen3VLForConditionalGeneration
from orin_vlm_node.engine import Engine, EngineConfig, Request, SamplingParams, Turn

out, prompt, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
ckpt = make_tiny_checkpoint(out, layers=2, tie=False, seed=3, num_heads=4, num_kv_heads=2, head_dim=64, hidden=128)
image = np.random.default_rng(0).integers(0, 256, size=(96, 128, 3), dtype=np.uint8)
result = {}
for dtype, torch_dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16), ("fp16", torch.float16)):
    engine = Engine(EngineConfig(model_path=str(ckpt), device="cuda", dtype=dtype, max_sessions=0, max_batch=1))
    sampling = SamplingParams(temperature=0.0, max_new_tokens=n, ignore_eos=True)
    ours = list(list(engine.generate(Request(Turn(prompt, (image,)), sampling)))[-1].token_ids)
    batch = engine.parts.image_processor.preprocess([image])
    ids, _ = engine.parts.turns.renderer.first_turn(None, Turn(prompt, (image,)), list(batch.num_tokens))
    model = Qwen3VLForConditionalGeneration.from_pretrained(ckpt, dtype=torch_dtype, attn_implementation="eager")
    model = model.to("cuda").eval()
    model.generation_config.eos_token_id = None  # like ignore_eos: EOS is an ordinary token, never a stop
    input_ids = torch.tensor([ids], device="cuda")
    with torch.inference_mode():
        ref = model.generate(
            input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
            pixel_values=batch.pixel_values.to("cuda", torch_dtype), image_grid_thw=batch.grid_thw.to("cuda"),
            mm_token_type_ids=(input_ids == model.config.image_token_id).to(torch.int32),
            max_new_tokens=n, do_sample=False, top_k=None, top_p=None, temperature=None,
        )[0, len(ids):].tolist()
    same = next((i for i, (a, b) in enumerate(zip(ours, ref)) if a != b), min(len(ours), len(ref)))
    result[dtype] = {"identical": ours == ref, "agreeing_prefix": same, "tokens": len(ours),
                     "path": engine.describe()["decode_path"], "kernels": engine.describe()["kernels"]}
    del engine, model
    torch.cuda.empty_cache()
print(json.dumps(result))
"""


def cli_parity(c: Check) -> dict[str, Any]:
    env_path = c.work / "parity_ckpt"
    result = json.loads(
        c.run([sys.executable, "-c", PARITY_CODE, str(env_path), PARITY_PROMPT, str(PARITY_TOKENS)], 600).splitlines()[
            -1
        ]
    )
    cli = json.loads(
        c.run([sys.executable, "-m", "orin_vlm_node.generate", "--model-path", str(env_path), "--device", "cuda",
               "--dtype", "fp32", "--prompt", "Hello robot.", "--temperature", "0", "--max-new-tokens", "8",
               "--json"], 300).splitlines()[-1]
    )  # fmt: skip
    result["cli"] = {"finish_reason": cli["finish_reason"], "backend": cli["backend"]}
    if not result["fp32"]["identical"]:
        raise StepFailed(f"fp32 greedy tokens differ from transformers after {result['fp32']['agreeing_prefix']}")
    if not cli["backend"]["kernels"].startswith("kernels: on"):
        raise StepFailed(f"the CLI did not use the kernels: {cli['backend']['kernels']}")
    return result


def bench(c: Check) -> dict[str, Any]:
    out = c.out / "bench_gpu.json"
    left = max(60.0, c.budget_s - c.elapsed())
    # The section starts no part after `left - BENCH_PART_S`, so it writes its file before the step's timeout.
    c.run([sys.executable, "-m", "bench.run", "--sections", "gpu", "--no-chart", "--out", str(out),
           "--big-config", str(c.wheels / CONFIG_2B), "--gpu-budget-s", str(max(1.0, left - BENCH_PART_S)),
           "--gpu-parts", c.bench_parts],
          left + BENCH_PART_S)  # fmt: skip
    result = json.loads(out.read_text())
    section = result["sections"]["gpu"]
    if section["status"] != "ok":
        raise StepFailed(f"gpu section {section['status']}: {section['reason']}")
    broken = [f"{p['part']}: {p['reason']}" for p in section["skipped_parts"] if p["reason"].startswith("error")]
    if broken:
        raise StepFailed(f"gpu section parts failed (the rest is in {out.name}): " + "; ".join(broken))
    return {
        "skipped_parts": section["skipped_parts"],
        "file": out.name,
        "summary": section["setup"].get("summary"),
        "goals": {g["id"]: [g["status"], g["value"]] for g in result["goals"] if g["id"].startswith("gpu")},
    }


STEP_FUNCTIONS: dict[str, Callable[[Check], dict[str, Any]]] = {
    "preflight": preflight,
    "wheels": wheels,
    "pycuda": pycuda,
    "device": device,
    "diagnostics": diagnostics,
    "gpu_tests": gpu_tests,
    "cli_parity": cli_parity,
    "bench": bench,
}


def run_steps(c: Check, steps: Sequence[str]) -> bool:
    ok = True
    for name in steps:
        blocked = [n for n in NEEDS.get(name, ()) if c.results.get(n, {}).get("status") != "ok"]
        if blocked:
            c.results[name] = {"status": "skipped", "reason": f"needs {', '.join(blocked)}"}
            c.log(f"{name}: skipped (needs {', '.join(blocked)})")
            continue
        if c.elapsed() > c.budget_s:
            c.results[name] = {"status": "skipped", "reason": f"time budget of {c.budget_s:.0f} s spent"}
            c.log(f"{name}: skipped (time budget)")
            ok = False
            continue
        c.log(f"{name}: start")
        t0 = time.monotonic()
        try:
            detail = STEP_FUNCTIONS[name](c)
            c.results[name] = {"status": "ok", **detail}
        except (StepFailed, OSError, ValueError, RuntimeError) as exc:
            c.results[name] = {"status": "failed", "reason": str(exc)}
            ok = False
        c.results[name]["seconds"] = round(time.monotonic() - t0, 1)
        c.log(f"{name}: {c.results[name]['status']} in {c.results[name]['seconds']} s"
              + (f" ({c.results[name]['reason']})" if "reason" in c.results[name] else ""))  # fmt: skip
    return ok


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--wheels", type=Path, default=REPO / ".gpu-wheels", help="folder made by `make gpu-wheels`")
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or REPO / "gpu-check-out"))
    ap.add_argument("--steps", default=",".join(STEPS), help=f"comma-separated subset of {','.join(STEPS)}")
    ap.add_argument("--budget-s", type=float, default=540.0, help="start no step after this many seconds")
    ap.add_argument("--keep-work", action="store_true", help="keep the temporary build folder (path is logged)")
    ap.add_argument("--bench-parts", default="", help="the bench step's GPU parts (bench.run --gpu-parts; default all)")
    args = ap.parse_args(argv)
    steps = [s.strip() for s in args.steps.split(",") if s.strip()]
    unknown = [s for s in steps if s not in STEPS]
    if unknown:
        ap.error(f"unknown step(s) {unknown}; choose from {list(STEPS)}")
    # Checked before any step: a misspelt part would otherwise end the bench step after the minutes of device
    # time the steps before it took.
    dtypes = BenchConfig().gpu_dtypes
    unknown = chosen_parts(args.bench_parts, dtypes)[1]
    if unknown:
        ap.error(f"unknown bench part(s) {unknown}; choose from {part_names(dtypes)}")
    args.out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="orin_vlm_gpu_check_"))
    with open(args.out / "gpu_check.log", "w", encoding="utf-8") as log_file:
        c = Check(wheels=args.wheels.resolve(), out=args.out.resolve(), work=work, budget_s=args.budget_s,
                  log_file=log_file, bench_parts=args.bench_parts)  # fmt: skip
        c.log(f"steps {', '.join(steps)}; wheels {c.wheels}; work {work}; out {c.out}")
        ok = run_steps(c, steps)
        report = {
            "created": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            "seconds": round(c.elapsed(), 1),
            "ok": ok,
            "steps": c.results,
        }
        (c.out / "gpu_check.json").write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")
        c.log(f"{'PASSED' if ok else 'FAILED'} in {c.elapsed():.0f} s; wrote {c.out / 'gpu_check.json'}")
    if not args.keep_work:
        shutil.rmtree(work, ignore_errors=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
