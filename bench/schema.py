"""The shape of ``bench/results/*.json`` and a validator for it.

Why hand-written: the schema is small, and a validator that names the exact path of a problem
("sections.ros.figures.ttft_s.median: missing") is what the CI smoke test and the report need; no extra
dependency for it.
"""

from __future__ import annotations

import math
from typing import Any

SCHEMA_VERSION = 1
SECTIONS = (
    "vs_transformers",
    "paged_vs_contiguous",
    "prefix_cache",
    "structured",
    "video",
    "batching",
    "quantization",
    "memory",
    "ros",
    "remote",
    "gpu",
)
MACHINE_KEYS = ("cpu_model", "cores", "ram_gib", "python", "torch", "transformers", "git_commit", "cuda_device")
FIGURE_KEYS = ("unit", "min", "median", "max", "n", "samples", "description", "labels")
SECTION_STATUS = ("ok", "skipped", "error")
GOAL_STATUS = ("met", "not_met", "not_measured")


class SchemaError(ValueError):
    """A result file does not have the documented shape; the message names the path."""


def _need(obj: dict[str, Any], key: str, types: type | tuple[type, ...], path: str) -> Any:
    if not isinstance(obj, dict) or key not in obj:
        raise SchemaError(f"{path}.{key}: missing")
    value = obj[key]
    if not isinstance(value, types):
        raise SchemaError(f"{path}.{key}: expected {types}, got {type(value).__name__}")
    return value


def _number(value: Any, path: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise SchemaError(f"{path}: expected a finite number, got {value!r}")
    return float(value)


def validate_figure(fig: dict[str, Any], path: str) -> None:
    for key in FIGURE_KEYS:
        _need(fig, key, object, path)
    if not isinstance(fig["unit"], str) or not fig["unit"]:
        raise SchemaError(f"{path}.unit: expected a non-empty string")
    samples = fig["samples"]
    if not isinstance(samples, list) or not samples:
        raise SchemaError(f"{path}.samples: expected a non-empty list")
    values = [_number(s, f"{path}.samples[{i}]") for i, s in enumerate(samples)]
    lo, med, hi = (_number(fig[k], f"{path}.{k}") for k in ("min", "median", "max"))
    if fig["n"] != len(values):
        raise SchemaError(f"{path}.n: {fig['n']} but {len(values)} samples")
    if not (lo <= med <= hi) or lo != min(values) or hi != max(values):
        raise SchemaError(f"{path}: min/median/max {lo}/{med}/{hi} inconsistent with the samples")
    if not isinstance(fig["labels"], dict):
        raise SchemaError(f"{path}.labels: expected an object")


def validate_result(result: dict[str, Any]) -> None:
    """Raise :class:`SchemaError` naming the first problem; return None when the file is well formed."""
    if not isinstance(result, dict):
        raise SchemaError("result: expected an object")
    if _need(result, "schema_version", int, "result") != SCHEMA_VERSION:
        raise SchemaError(f"result.schema_version: expected {SCHEMA_VERSION}")
    _need(result, "mode", str, "result")
    _need(result, "created", str, "result")
    _need(result, "duration_s", (int, float), "result")
    machine = _need(result, "machine", dict, "result")
    for key in MACHINE_KEYS:
        if key not in machine:
            raise SchemaError(f"result.machine.{key}: missing")
    _need(result, "config", dict, "result")
    sections = _need(result, "sections", dict, "result")
    for name in SECTIONS:
        sec = _need(sections, name, dict, "result.sections")
        path = f"result.sections.{name}"
        status = _need(sec, "status", str, path)
        if status not in SECTION_STATUS:
            raise SchemaError(f"{path}.status: {status!r} not in {SECTION_STATUS}")
        if status != "ok" and not sec.get("reason"):
            raise SchemaError(f"{path}.reason: a {status} section must say why")
        figures = _need(sec, "figures", dict, path)
        if status == "ok" and not figures:
            raise SchemaError(f"{path}.figures: an ok section must record at least one figure")
        for key, fig in figures.items():
            validate_figure(fig, f"{path}.figures.{key}")
        _need(sec, "setup", dict, path)
        for i, part in enumerate(_need(sec, "skipped_parts", list, path)):
            if not isinstance(part, dict) or not part.get("part") or not part.get("reason"):
                raise SchemaError(f"{path}.skipped_parts[{i}]: needs 'part' and 'reason'")
    goals = _need(result, "goals", list, "result")
    for i, goal in enumerate(goals):
        for key in ("id", "goal", "target", "unit", "value", "status", "source"):
            if key not in goal:
                raise SchemaError(f"result.goals[{i}].{key}: missing")
        if goal["status"] not in GOAL_STATUS:
            raise SchemaError(f"result.goals[{i}].status: {goal['status']!r} not in {GOAL_STATUS}")
