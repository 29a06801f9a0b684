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


def _worst_over(section: str, suffix: str, higher_is_better: bool, prefix: str | tuple[str, ...] = ""):
    """Worst median among figures of ``section`` whose key starts with ``prefix`` (or one of them) and ends with
    ``suffix`` (every checkpoint/prompt measured must meet the goal, so the weakest one decides)."""

    def ev(result: dict[str, Any]) -> tuple[float | None, str]:
        sec, why = _section(result, section)
        if sec is None:
            return None, why
        found = {
            k: float(f["median"]) for k, f in sec["figures"].items() if k.startswith(prefix) and k.endswith(suffix)
        }
        if not found:
            shown = "|".join(prefix) if isinstance(prefix, tuple) else prefix
            return None, f"no {shown}*{suffix} figures in {section}"
        pick = min if higher_is_better else max
        key = pick(found, key=found.__getitem__)
        return found[key], f"worst of {len(found)}: {key}"

    return ev


PAGED_GOAL_KEYS = tuple(f"ctx{n}.{kv}.decode_overhead" for n in (4096, 16384) for kv in ("page16", "page16_churn"))


def _paged_overhead(result: dict[str, Any]) -> tuple[float | None, str]:
    """The worst of page 16 at 4k and 16k context, fresh and after churn: all four must be measured."""
    sec, why = _section(result, "paged_vs_contiguous")
    if sec is None:
        return None, why
    found = {key: _median(sec, key) for key in PAGED_GOAL_KEYS}
    missing = [key for key, value in found.items() if value is None]
    if missing:
        run = sec.get("setup", {}).get("context_lengths", [])
        return None, f"{', '.join(missing)} not measured (context lengths run: {run})"
    key = max(found, key=found.__getitem__)
    return found[key], f"worst of {len(found)}: {key}"


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


def _ros(key: str, section: str = "ros"):
    def ev(result: dict[str, Any]) -> tuple[float | None, str]:
        sec, why = _section(result, section)
        if sec is None:
            return None, why
        value = _median(sec, key)
        return (value, key) if value is not None else (None, f"{key} missing")

    return ev


def _gpu(suffix: str, higher_is_better: bool):
    """Worst median of the gpu section's figures ending in ``suffix`` (every dtype must meet the goal),
    with the device named: absolute GPU figures only mean something for the device they ran on."""
    worst = _worst_over("gpu", suffix, higher_is_better)

    def ev(result: dict[str, Any]) -> tuple[float | None, str]:
        value, where = worst(result)
        if value is None:
            return None, where
        return value, f"{where} on {result['sections']['gpu'].get('setup', {}).get('device', '?')}"

    return ev


GOALS: list[Goal] = [
    Goal(
        "cpu_decode_vs_hf",
        "CPU decode tok/s >= 1.2x transformers generate, default model (answers of 64+ tokens)",
        "x",
        1.2,
        True,
        _worst_over("vs_transformers", ".decode_ratio", True, prefix="default."),
    ),
    Goal(
        "cpu_decode_vs_hf_2b",
        "CPU decode tok/s >= 1.0x transformers generate, 2B-shape checkpoint (both run the same weight GEMVs)",
        "x",
        1.0,
        True,
        _worst_over("vs_transformers", ".decode_ratio", True, prefix="2b_"),
    ),
    Goal(
        "cpu_ttft_vs_hf",
        "CPU TTFT <= 0.8x transformers generate, default model",
        "x",
        0.8,
        False,
        _worst_over("vs_transformers", ".ttft_ratio", False, prefix="default."),
    ),
    Goal(
        "paged_overhead",
        "Paged decode overhead <= 5% vs contiguous at 4k and 16k context, fresh and after churn (page 16)",
        "fraction",
        0.05,
        False,
        _paged_overhead,
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
        "structured_decode",
        "A JSON-schema format keeps >= 95% of free text's decode tok/s (2B-shape checkpoint)",
        "ratio",
        0.95,
        True,
        _worst_over("structured", "decode.json_vs_free", True, prefix="2b_"),
    ),
    Goal(
        "structured_compile",
        "Compiling the grounding format or a 20-property schema takes <= 50 ms (worst)",
        "ms",
        50.0,
        False,
        _worst_over("structured", ".first_ms", False, prefix="compile."),
    ),
    Goal(
        "detection_found",
        "Default model: >= 90% of held-out objects found with IoU >= 0.5 in camera pixels",
        "fraction",
        0.90,
        True,
        _worst_over("structured", "detect.objects_found", True),
    ),
    Goal(
        "detection_clean",
        "Default model: no invented object on >= 90% of held-out grounding scenes",
        "fraction",
        0.90,
        True,
        _worst_over("structured", "detect.scenes_clean", True),
    ),
    Goal(
        "batching_4_cpu",
        "CPU: 4 requests decoding together >= 2x the aggregate decode tok/s of one, 2B-shape checkpoint",
        "x",
        2.0,
        True,
        _worst_over("batching", ".batch4.speedup", True, prefix="2b_"),
    ),
    Goal(
        "batching_4_gpu",
        "GPU: 4 requests decoding together >= 3x the aggregate decode tok/s of one (kernels + graphs, 2B shape)",
        "x",
        3.0,
        True,
        _gpu(".batch4.speedup", True),
    ),
    Goal(
        "batching_4_gpu_latency",
        "GPU: each of 4 requests decoding together has <= 1.5x the per-token latency of one alone",
        "x",
        1.5,
        False,
        _gpu(".batch4.member_latency_vs_one", False),
    ),
    Goal(
        "quant_int8_accuracy",
        "weight_quant=int8 loses <= 1 point of held-out exact match on the default model",
        "points",
        1.0,
        False,
        _worst_over("quantization", ".int8.exact_match_drop", False, prefix="default."),
    ),
    Goal(
        "quant_int4_accuracy",
        "weight_quant=int4 (group 128) loses <= 3 points of held-out exact match on the default model",
        "points",
        3.0,
        False,
        _worst_over("quantization", ".int4.exact_match_drop", False, prefix="default."),
    ),
    Goal(
        "fp8_checkpoint_accuracy",
        "the default model read from FP8 copies (128x128 blocks; per channel) loses <= 1 point of held-out exact match",
        "points",
        1.0,
        False,
        _worst_over("quantization", "_none.exact_match_drop", False, prefix="default.fp8"),
    ),
    Goal(
        "int4_checkpoint_accuracy",
        "the default model read from 4-bit copies (compressed-tensors W4A16, W4A16_ASYM; AutoAWQ GEMM; GPTQ; kept as "
        "int4) loses <= 3 points of held-out exact match",
        "points",
        3.0,
        False,
        _worst_over(
            "quantization", ".exact_match_drop", False, prefix=("default.w4a16", "default.awq", "default.gptq")
        ),
    ),
    Goal(
        "int8_checkpoint_accuracy",
        "the default model read from a W8A16 compressed-tensors copy (kept as int8) loses <= 1 point of held-out "
        "exact match",
        "points",
        1.0,
        False,
        _worst_over("quantization", ".exact_match_drop", False, prefix="default.w8a16"),
    ),
    Goal(
        "quant_int4_gpu_speedup",
        "GPU decode with weight_quant=int4 >= 1.8x fp16 weights (kernels + graphs, batch 1, 2B shape)",
        "x",
        1.8,
        True,
        _gpu("quant.int4.speedup", True),
    ),
    Goal(
        "quant_int8_gpu_speedup",
        "GPU decode with weight_quant=int8 >= 1.5x fp16 weights (kernels + graphs, batch 1, 2B shape)",
        "x",
        1.5,
        True,
        _gpu("quant.int8.speedup", True),
    ),
    Goal(
        "quant_gpu_bound",
        "GPU decode with int8 / int4 weights >= 75% of each one's bandwidth bound (bytes it reads per token)",
        "fraction",
        0.75,
        True,
        _worst_over("gpu", ".bound_fraction", True, prefix="quant.int"),
    ),
    Goal(
        "ros_decode_overhead",
        "ROS overhead <= 5% of decode time with 400-token answers (subscriber tokens/s vs engine alone)",
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
        "remote_decode",
        "backend openai: a ROS subscriber sees >= 95% of the tokens/s a direct streaming client of the same vLLM sees",
        "x",
        0.95,
        True,
        _ros("decode_ratio", "remote"),
    ),
    Goal(
        "remote_ttft_added",
        "backend openai: the node adds <= 10 ms to the server's TTFT, besides encoding the frame (reported)",
        "ms",
        10.0,
        False,
        _ros("ttft_added_beyond_encoding_ms", "remote"),
    ),
    Goal(
        "gpu_graphs_bound",
        "GPU decode, kernels + graphs >= 70% of the bandwidth bound (H100; a Jetson AGX Orin should reach 80%)",
        "fraction",
        0.70,
        True,
        _gpu(".graphs.bound_fraction", True),
    ),
    Goal(
        "gpu_graphs_vs_hf",
        "GPU decode, kernels + graphs >= 1.5x transformers generate (sdpa) on the same checkpoint",
        "x",
        1.5,
        True,
        _gpu(".graphs_vs_hf", True),
    ),
    Goal(
        "gpu_paged_kernel_4k",
        "Paged decode kernel <= 5% slower than contiguous attention (torch SDPA) at 4k context",
        "fraction",
        0.05,
        False,
        _gpu("ctx4096.page16.overhead", False),
    ),
    Goal(
        "gpu_warm_startup",
        "Startup to ready with a warm kernel cache <= 10 s (2B, fp16)",
        "s",
        10.0,
        False,
        _gpu("startup.warm_s", False),
    ),
    Goal(
        "gpu_memory_default_model",
        "The default model on CUDA uses < 1 GB of GPU memory in all (CUDA context included)",
        "MB",
        1024.0,
        False,
        _gpu("memory.default_model.used_mb", False),
    ),
    Goal(
        "gpu_memory_2b",
        "2B fp16 at 8192 context uses <= weights + 1.25 x one context of KV + 1 GB",
        "x",
        1.0,
        False,
        _gpu("memory.2b_fp16.used_vs_limit", False),
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
