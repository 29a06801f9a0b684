"""The performance goals of the project, evaluated from a result file.

Each goal reads medians of figures recorded by the sections (never numbers typed in here) and comes
out ``met``, ``not_met`` or ``not_measured`` (with the reason: section skipped, figure missing, run
too small). The report re-evaluates goals from the figures, so a JSON edited by hand cannot claim a
goal its own figures do not support.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

Status = str  # "met" | "not_met" | "not_measured"


@dataclass(frozen=True)
class Goal:
    id: str
    text: str
    unit: str
    target: float
    higher_is_better: bool
    evaluate: Callable[[dict[str, Any]], tuple[float | None, str]]  # -> (value, where it came from / why none)


def _section(result: dict[str, Any], name: str) -> tuple[dict[str, Any] | None, str]:
    sec = result.get("sections", {}).get(name)
    if sec is None:
        return None, f"section {name} not run"
    if sec.get("status") != "ok":
        return None, f"section {name} {sec.get('status')}: {sec.get('reason')}"
    return sec, ""


def _median(sec: dict[str, Any], key: str) -> float | None:
    fig = sec.get("figures", {}).get(key)
    return None if fig is None else float(fig["median"])


def _worst_over(section: str, suffix: str, higher_is_better: bool):
    """Worst median among figures of ``section`` whose key ends with ``suffix`` (every checkpoint/prompt
    measured must meet the goal, so the weakest one decides)."""

    def ev(result: dict[str, Any]) -> tuple[float | None, str]:
        sec, why = _section(result, section)
        if sec is None:
            return None, why
        found = {k: float(f["median"]) for k, f in sec["figures"].items() if k.endswith(suffix)}
        if not found:
            return None, f"no {suffix} figures in {section}"
        pick = min if higher_is_better else max
        key = pick(found, key=found.__getitem__)
        return found[key], f"worst of {len(found)}: {key}"

    return ev


def _paged_overhead_4k(result: dict[str, Any]) -> tuple[float | None, str]:
    sec, why = _section(result, "paged_vs_contiguous")
    if sec is None:
        return None, why
    key = "ctx4096.page16.decode_overhead"
    value = _median(sec, key)
    if value is None:
        longest = sec.get("setup", {}).get("context_lengths", [])
        return None, f"{key} not measured (context lengths run: {longest})"
    return value, key


def _prefix_cut(result: dict[str, Any]) -> tuple[float | None, str]:
    """The 2B-shape checkpoint when it was measured (there the vision tower and prefill dominate TTFT, as
    on a real model); else the default model, whose TTFT is mostly fixed per-request work."""
    sec, why = _section(result, "prefix_cache")
    if sec is None:
        return None, why
    for key in ("2b_bf16.image_system.ttft_cut", "image_system.ttft_cut"):
        value = _median(sec, key)
        if value is not None:
            return value, key
    return None, "image_system.ttft_cut missing"


def _ros(key: str):
    def ev(result: dict[str, Any]) -> tuple[float | None, str]:
        sec, why = _section(result, "ros")
        if sec is None:
            return None, why
        value = _median(sec, key)
        return (value, key) if value is not None else (None, f"{key} missing")

    return ev


def _gpu_fraction(result: dict[str, Any]) -> tuple[float | None, str]:
    sec, why = _section(result, "gpu")
    if sec is None:
        return None, why
    value = _median(sec, "graphs.bandwidth_fraction")
    device = sec.get("setup", {}).get("device", "?")
    model = sec.get("setup", {}).get("model", "?")
    if value is None:
        return None, "graphs.bandwidth_fraction missing"
    return value, f"on {device}, {model} (the goal is stated for Orin AGX + Qwen3-VL-2B fp16)"


GOALS: list[Goal] = [
    Goal(
        "cpu_decode_vs_hf",
        "CPU decode tok/s >= 1.5x transformers generate on the same checkpoint",
        "x",
        1.5,
        True,
        _worst_over("vs_transformers", ".decode_ratio", True),
    ),
    Goal(
        "cpu_ttft_vs_hf",
        "CPU TTFT <= 0.8x transformers generate on the same checkpoint",
        "x",
        0.8,
        False,
        _worst_over("vs_transformers", ".ttft_ratio", False),
    ),
    Goal(
        "paged_overhead_4k",
        "Paged decode overhead <= 5% vs contiguous at 4k context (page 16)",
        "fraction",
        0.05,
        False,
        _paged_overhead_4k,
    ),
    Goal(
        "prefix_cache_ttft_cut",
        "Prefix-cache hit cuts TTFT of a repeated image + system prompt by >= 80%",
        "fraction",
        0.80,
        True,
        _prefix_cut,
    ),
    Goal(
        "ros_decode_overhead",
        "ROS overhead <= 5% of decode time (subscriber tokens/s vs engine alone)",
        "fraction",
        0.05,
        False,
        _ros("decode_overhead"),
    ),
    Goal(
        "ros_first_token_delay",
        "First token over ROS within 20 ms of the engine's first token",
        "s",
        0.020,
        False,
        _ros("first_token_delay_s"),
    ),
    Goal(
        "gpu_bandwidth_fraction",
        "GPU decode >= 80% of the memory-bandwidth bound, graphs on (Orin AGX, batch 1, Qwen3-VL-2B fp16: >= 48 tok/s)",
        "fraction",
        0.80,
        True,
        _gpu_fraction,
    ),
]


def evaluate_goals(result: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for g in GOALS:
        value, where = g.evaluate(result)
        if value is None:
            status: Status = "not_measured"
        elif g.higher_is_better:
            status = "met" if value >= g.target else "not_met"
        else:
            status = "met" if value <= g.target else "not_met"
        out.append(
            {
                "id": g.id,
                "goal": g.text,
                "target": g.target,
                "unit": g.unit,
                "higher_is_better": g.higher_is_better,
                "value": value,
                "status": status,
                "source": where,
            }
        )
    return out
