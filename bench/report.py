"""Render a benchmark result file as Markdown: the goals table, then every section's figures.

Usage: ``python -m bench.report bench/results/latest.json [--goals-only]``. Goals are re-evaluated
from the figures in the file (see goals.py), so the table always agrees with the numbers under it.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from bench.goals import evaluate_goals
from bench.schema import SECTIONS, validate_result

STATUS_MARK = {"met": "met", "not_met": "**not met**", "not_measured": "not measured"}
TITLES = {
    "vs_transformers": "Engine vs transformers (same checkpoint, alternating repeats)",
    "paged_vs_contiguous": "Paged vs contiguous KV cache",
    "prefix_cache": "Prefix cache and multi-turn sessions",
    "structured": "Structured output (formats, grounding)",
    "video": "Video prompts (a camera's recent past)",
    "batching": "Continuous batching (requests decoding together)",
    "quantization": "Weight-only quantization (accuracy, weight bytes, CPU decode speed)",
    "memory": "Memory",
    "ros": "Through ROS 2 (localhost DDS)",
    "remote": "From a vLLM server (backend openai) vs a direct client",
    "gpu": "GPU",
}


def fmt(value: float | None) -> str:
    if value is None:
        return "–"
    a = abs(value)
    if a == 0:
        return "0"
    if a >= 1000:
        return f"{value:,.0f}"
    if a >= 100:
        return f"{value:.1f}"
    if a >= 1:
        return f"{value:.2f}"
    if a >= 0.01:
        return f"{value:.3f}"
    return f"{value:.2e}"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def machine_line(result: dict[str, Any]) -> str:
    m = result["machine"]
    commit = (m.get("git_commit") or "unknown")[:10] + (" (dirty)" if m.get("git_dirty") else "")
    cuda = m.get("cuda_device")
    gpu = f", GPU {cuda['name']}" if cuda else ", no CUDA device"
    return (
        f"Mode `{result['mode']}`, {result['created']}, {result['duration_s']:.0f} s. "
        f"{m['cpu_model']}, {m['cores']} cores, {m['ram_gib']} GiB RAM{gpu}; "
        f"torch {m['torch']}, transformers {m['transformers']}; commit {commit}."
    )


def goals_table(result: dict[str, Any]) -> list[str]:
    lines = ["| Goal | Target | Measured | Status | From |", "|---|---|---|---|---|"]
    for g in evaluate_goals(result):
        op = ">=" if g["higher_is_better"] else "<="
        unit = "" if g["unit"] in ("x", "fraction") else f" {g['unit']}"
        target = f"{op} {fmt(g['target'])}{unit}"
        if g["unit"] == "fraction":
            target = f"{op} {g['target'] * 100:.0f}%"
        if g["value"] is None:
            measured = "–"
        elif g["unit"] == "fraction":
            measured = f"{g['value'] * 100:.1f}%"
        elif g["unit"] == "x":
            measured = f"{fmt(g['value'])}x"
        else:
            measured = f"{fmt(g['value'])}{unit}"
        lines.append(
            f"| {_cell(g['goal'])} | {target} | {measured} | {STATUS_MARK[g['status']]} | {_cell(g['source'])} |"
        )
    return lines


def section_table(name: str, sec: dict[str, Any]) -> list[str]:
    lines = [f"### {TITLES.get(name, name)}", ""]
    if sec["status"] != "ok":
        lines.append(f"*{sec['status']}*: {sec.get('reason')}")
        return lines
    setup = sec.get("setup", {})
    if setup.get("summary"):
        lines += [str(setup["summary"]), ""]
    lines += ["| Figure | Median | Min | Max | Unit | n |", "|---|---|---|---|---|---|"]
    for key, f in sec["figures"].items():
        lines.append(f"| `{key}` | {fmt(f['median'])} | {fmt(f['min'])} | {fmt(f['max'])} | {f['unit']} | {f['n']} |")
    for part in sec.get("skipped_parts", []):
        lines.append("")
        lines.append(f"Skipped `{part['part']}`: {part['reason']}")
    for note in sec.get("notes", []):
        lines.append("")
        lines.append(f"Note: {note}")
    return lines


def render(result: dict[str, Any], goals_only: bool = False) -> str:
    lines = [machine_line(result), "", *goals_table(result)]
    if not goals_only:
        for name in SECTIONS:
            lines += ["", *section_table(name, result["sections"][name])]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("result", type=Path, help="a bench/results/*.json file")
    ap.add_argument("--goals-only", action="store_true", help="print only the machine line and the goals table")
    args = ap.parse_args(argv)
    try:
        result = json.loads(args.result.read_text(encoding="utf-8"))
        validate_result(result)
    except (OSError, ValueError) as exc:
        print(f"report: {args.result}: {exc}", file=sys.stderr)
        return 2
    sys.stdout.write(render(result, goals_only=args.goals_only))
    return 0


if __name__ == "__main__":
    sys.exit(main())
