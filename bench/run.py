"""Run the benchmarks and write ``bench/results/latest.json`` + ``latest.png``.

Usage: ``python -m bench.run [--quick | --medium] [--out PATH] [--sections a,b] [--no-chart]``
(``make bench`` / ``make bench-quick``), from the repository root so this checkout's ``orin_vlm_node`` is the
one measured, never an older installed copy.

Every section runs in a fresh process of its own (this module again, with ``--child-section``), one after
another, on the run's one scratch directory (a checkpoint an earlier section built is reused). Why: a section
measures its engines side by side, and what an earlier section left in the process skewed it. In one process
the full run of 8027b8d measured the churned paged engine 5.6% slower than contiguous at 4k and the ROS
overhead at 8.3%; the same sections run alone from the same code gave 0.9% and 0.5%. The process held
5.5-5.9 GB after the 2B sections (freed memory the allocator keeps, engines in reference cycles: one run
went past 24 GiB and was killed). A section's process also reports its peak resident memory.

A section that cannot run records ``skipped`` with its reason, one that crashes (or whose process dies, say
killed for memory) records ``error`` with the exception or the exit status, and the run still writes a
complete, schema-valid file. Goals are evaluated at the end and printed as a Markdown table
(``bench/report.py`` prints the whole report from the JSON later).
"""

from __future__ import annotations

import argparse
import datetime as dt
import importlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import replace
from pathlib import Path

from bench.config import PRESETS, REPO, BenchConfig, chosen_parts, part_names
from bench.context import BenchContext
from bench.goals import evaluate_goals
from bench.machine import machine_info
from bench.rss_probe import vm_kib
from bench.schema import SCHEMA_VERSION, SECTIONS, validate_result
from bench.section import SectionResult, skipped

BENCH = Path(__file__).resolve().parent

# section name -> module holding ``run(ctx) -> SectionResult``
MODULES = {
    "vs_transformers": "vs_transformers",
    "paged_vs_contiguous": "paged",
    "prefix_cache": "prefix_cache",
    "structured": "structured",
    "video": "video",
    "batching": "batching",
    "quantization": "quantization",
    "memory": "memory",
    "ros": "ros_overhead",
    "remote": "remote_overhead",
    "gpu": "gpu",
}


def run_section(name: str, ctx: BenchContext) -> SectionResult:
    """Run section ``name`` in this process (a section's own, see the module docstring)."""
    t0 = time.perf_counter()
    ctx.log(f"section {name}: start")
    try:
        result = importlib.import_module(f"bench.{MODULES[name]}").run(ctx)
    except Exception as exc:  # noqa: BLE001 - one broken section must not lose the others' figures
        tb = traceback.format_exc()
        print(tb, file=sys.stderr)
        last = tb.strip().splitlines()[-3:]
        result = SectionResult(name, status="error", reason=f"{type(exc).__name__}: {exc} | {' / '.join(last)}"[:2000])
    if result.status == "ok" and not result.figures:
        result.status, result.reason = (
            "skipped",
            result.reason
            or "nothing measured: " + "; ".join(f"{p['part']}: {p['reason']}" for p in result.skipped_parts),
        )
    result.duration_s = time.perf_counter() - t0
    result.setup["process_peak_rss_mb"] = round(vm_kib("VmHWM") / 1024)
    ctx.log(
        f"section {name}: {result.status} in {result.duration_s:.1f} s, peak {result.setup['process_peak_rss_mb']} "
        "MB resident" + (f" ({result.reason})" if result.reason else "")
    )
    return result


def section_in_child(name: str, command: list[str], out: Path) -> dict:
    """Run ``command`` (a section's process, which writes its result to ``out``) and return the section's
    result as ``SectionResult.as_dict`` gives it: the child's, or an ``error`` saying how the process ended
    when it wrote none (a crash outside the section's code, a kill for memory)."""
    t0 = time.perf_counter()
    # The child's stdout joins this process's stderr: stdout carries only the goals table at the end.
    proc = subprocess.run(command, cwd=REPO, stdout=sys.stderr, check=False)
    if proc.returncode == 0 and out.is_file():
        return json.loads(out.read_text(encoding="utf-8"))
    how = f"killed by signal {-proc.returncode}" if proc.returncode < 0 else f"exit status {proc.returncode}"
    if proc.returncode == -signal.SIGKILL:  # the child is python itself, not a shell: no 128 + 9
        how += " (SIGKILL: out of memory?)"
    result = SectionResult(name, status="error", reason=f"the section's process ended ({how}) without a result")
    result.duration_s = time.perf_counter() - t0
    return result.as_dict()


def _child_options(args: argparse.Namespace) -> list[str]:
    """The options of this run a section's process needs (all but output, chart and section choice)."""
    options = ["--quick"] if args.quick else ["--medium"] if args.medium else []
    options += ["--threads", str(args.threads), "--gpu-budget-s", str(args.gpu_budget_s)]
    for flag, value in (
        ("--checkpoint-cache", args.checkpoint_cache),
        ("--big-config", args.big_config),
        ("--gpu-parts", args.gpu_parts),
    ):
        if value:
            options += [flag, value]
    return options


def main(argv: list[str] | None = None) -> int:
    # The ROS section's client runs in this process and its node in a child: both discover on this machine
    # only, also when the benchmark is started directly rather than through `make bench`.
    os.environ["ROS_AUTOMATIC_DISCOVERY_RANGE"] = "LOCALHOST"
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="CI smoke mode: tiny checkpoint, few repeats (< 3 min)")
    mode.add_argument("--medium", action="store_true", help="2B-shape checkpoint in bf16 only, fewer repeats")
    ap.add_argument("--out", type=Path, default=BENCH / "results" / "latest.json", help="result JSON path")
    ap.add_argument("--sections", default="", help=f"comma-separated subset of {','.join(SECTIONS)}")
    ap.add_argument("--no-chart", action="store_true", help="do not write the PNG chart")
    ap.add_argument(
        "--checkpoint-cache",
        default="",
        help="directory to keep the 2B-shape random checkpoint in and reuse across runs (default: temp dir)",
    )
    ap.add_argument(
        "--big-config",
        default="",
        help="config.json giving the 2B-shape checkpoint's dimensions (default: ../shared/model-configs/...)",
    )
    ap.add_argument(
        "--threads",
        type=int,
        default=0,
        help="torch threads for this process, the node and probes (0 = torch default; use 1 on a busy machine)",
    )
    ap.add_argument(
        "--gpu-budget-s",
        type=float,
        default=0.0,
        help="GPU section: start no further part after this many seconds, so a fixed-length lease ends with "
        "the figures measured so far (0 = no limit)",
    )
    ap.add_argument(
        "--gpu-parts",
        default="",
        help="GPU section: comma-separated parts to run, in this order (decode.<dtype>, step_profile, "
        "startup_memory, kernels, gemv, quant, batching; default: all), to measure again what a change touched",
    )
    # A section's own process (see the module docstring): which section, the run's scratch, where to write.
    ap.add_argument("--child-section", choices=SECTIONS, help=argparse.SUPPRESS)
    ap.add_argument("--scratch", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--child-out", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)

    config = PRESETS["quick" if args.quick else "medium" if args.medium else "full"]
    if args.sections:
        wanted = tuple(s.strip() for s in args.sections.split(",") if s.strip())
        unknown = [s for s in wanted if s not in SECTIONS]
        if unknown:
            ap.error(f"unknown section(s) {unknown}; choose from {list(SECTIONS)}")
        config = replace(config, sections=wanted)
    if args.threads < 0:
        ap.error("--threads must be >= 0")
    if args.gpu_budget_s < 0:
        ap.error("--gpu-budget-s must be >= 0")
    gpu_parts, unknown = chosen_parts(args.gpu_parts, config.gpu_dtypes)
    if unknown:
        ap.error(f"unknown GPU part(s) {unknown}; choose from {part_names(config.gpu_dtypes)}")
    if args.child_section and not (args.scratch and args.child_out):
        ap.error("--child-section needs --scratch and --child-out")
    if args.threads:
        # Every process of the run (sections, the ROS node, the RSS probe) starts with this thread count.
        os.environ["OMP_NUM_THREADS"] = str(args.threads)
    config = replace(
        config,
        threads=args.threads,
        checkpoint_cache=args.checkpoint_cache,
        gpu_budget_s=args.gpu_budget_s,
        gpu_parts=gpu_parts,
    )
    if args.big_config:
        config = replace(config, big_config_path=args.big_config)
    if args.child_section:
        return _child(args.child_section, config, args.scratch, args.child_out)

    started = time.perf_counter()
    created = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
    machine = machine_info()  # before the run: the commit measured, not one made while it ran
    sections: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="orin_vlm_bench_") as scratch:
        print(f"[bench] mode {config.mode}, sections {', '.join(config.sections)}, scratch {scratch}", file=sys.stderr)
        for name in SECTIONS:
            if name not in config.sections:
                sections[name] = skipped(name, "not selected (--sections)").as_dict()
                continue
            out = Path(scratch) / f"section-{name}.json"
            command = [sys.executable, "-m", "bench.run", *_child_options(args), "--child-section", name]
            sections[name] = section_in_child(name, [*command, "--scratch", scratch, "--child-out", str(out)], out)

    result = {
        "schema_version": SCHEMA_VERSION,
        "mode": config.mode,
        "created": created,
        "duration_s": round(time.perf_counter() - started, 2),
        "machine": machine,
        "config": config.as_dict(),
        "sections": sections,
    }
    result["goals"] = evaluate_goals(result)
    validate_result(result)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.out.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(result, indent=1, sort_keys=False) + "\n", encoding="utf-8")
    os.replace(tmp, args.out)
    print(f"wrote {args.out}", file=sys.stderr)
    if not args.no_chart:
        from bench.chart import write_chart

        png = args.out.with_suffix(".png")
        write_chart(result, png)
        print(f"wrote {png}", file=sys.stderr)
    from bench.report import render

    sys.stdout.write(render(result, goals_only=True))
    return 0


def _child(name: str, config: BenchConfig, scratch: Path, out: Path) -> int:
    """A section's own process: run it on the run's scratch directory and write its result to ``out``."""
    if config.threads:
        import torch

        torch.set_num_threads(config.threads)
    result = run_section(name, BenchContext(config, scratch))
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(result.as_dict()), encoding="utf-8")
    os.replace(tmp, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
