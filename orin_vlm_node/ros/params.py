"""The node's parameters: one table of specs, their ROS descriptors, and the node's own validation.

Why a table: the same facts (name, type, default, range, whether it can change at runtime, which
layer consumes it) drive the parameter declarations, the runtime validation, the mapping onto
``EngineConfig``/``SamplingParams`` and the README/YAML documentation, so they are written once.

Follow one parameter, say ``page_size``: declared here with range 1..256 (rclpy refuses values
outside it), checked here for being a power of two (:func:`check_changes`), then checked by
``Engine.validate_changes`` and finally applied between requests by ``Engine.reconfigure`` on the
node's worker thread (``node.py``).

Only :func:`declare_parameters` touches rclpy types; the rest is plain Python so it is unit-tested
without a ROS graph.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any, Literal

from ..engine.config import DEFAULT_MODEL_DIR, EngineConfig
from ..engine.events import SamplingParams

Target = Literal["engine", "sampling", "node"]
Value = bool | int | float | str


@dataclass(frozen=True)
class ParamSpec:
    """One ROS parameter. ``target`` says who consumes it:

    - ``engine``: an ``EngineConfig`` field, applied between requests with ``Engine.reconfigure``;
    - ``sampling``: a ``SamplingParams`` field, taken per request;
    - ``node``: used by the node itself (queue, images, sessions).
    """

    name: str
    default: Value
    description: str
    target: Target
    read_only: bool = False
    choices: tuple[str, ...] = ()
    min_value: int | float | None = None
    max_value: int | float | None = None


PARAMS: tuple[ParamSpec, ...] = (
    ParamSpec(
        "model_path",
        "",
        "Hugging Face format Qwen3-VL directory; '' = the embedded default model",
        "engine",
        read_only=True,
    ),
    ParamSpec(
        "device",
        "auto",
        "where the model runs: auto (CUDA when available), cuda, cpu",
        "engine",
        choices=("auto", "cuda", "cpu"),
    ),
    ParamSpec(
        "dtype",
        "auto",
        "weights/activations dtype: auto (checkpoint's on CUDA, fp32 on CPU), bf16, fp16, fp32",
        "engine",
        choices=("auto", "bf16", "fp16", "fp32"),
    ),
    ParamSpec("use_paged_attention", True, "paged KV cache (block pool); false = contiguous KV baseline", "engine"),
    ParamSpec("page_size", 16, "tokens per KV block; a power of two", "engine", min_value=1, max_value=256),
    ParamSpec(
        "kv_pool_mb",
        0,
        "KV pool size in MB; 0 = sized by need (contexts held + prefix share, capped by free memory)",
        "engine",
        min_value=0,
        max_value=262144,
    ),
    ParamSpec(
        "kv_pool_blocks",
        0,
        "KV pool size in blocks; > 0 wins over kv_pool_mb",
        "engine",
        min_value=0,
        max_value=16_777_216,
    ),
    ParamSpec(
        "kv_prefix_share",
        0.25,
        "automatic KV pool size: extra share for cached prefixes (0.25 = a quarter more blocks)",
        "engine",
        min_value=0.0,
        max_value=4.0,
    ),
    ParamSpec(
        "kv_memory_reserve_mb",
        1024,
        "automatic KV pool size: memory (MB) left free for the rest of the robot",
        "engine",
        min_value=0,
        max_value=1_048_576,
    ),
    ParamSpec("prefix_caching", True, "reuse the KV blocks of an identical prompt prefix", "engine"),
    ParamSpec("use_cuda_kernels", True, "custom CUDA attention kernels (CUDA only)", "engine"),
    ParamSpec("use_cuda_graph", True, "replay the decode step as CUDA graphs (CUDA only)", "engine"),
    ParamSpec(
        "allow_kernel_fallback",
        True,
        "true: run torch attention (reported as 'kernels: off') when the CUDA kernels cannot be used; "
        "false: that is a startup error",
        "engine",
    ),
    ParamSpec("kernel_dir", "", "CUDA kernel sources; '' = the ones installed with the package", "engine"),
    ParamSpec("kernel_cache_dir", "", "compiled kernel cache; '' = ~/.cache/orin_vlm_node/kernels", "engine"),
    ParamSpec(
        "max_context_tokens",
        4096,
        "longest sequence (prompt + image tokens + answer)",
        "engine",
        min_value=16,
        max_value=262144,
    ),
    ParamSpec(
        "image_min_pixels",
        0,
        "smallest image area after resizing; 0 = the checkpoint's value",
        "engine",
        min_value=0,
        max_value=64_000_000,
    ),
    ParamSpec(
        "image_max_pixels",
        0,
        "largest image area after resizing; 0 = the checkpoint's value",
        "engine",
        min_value=0,
        max_value=64_000_000,
    ),
    ParamSpec("max_new_tokens", 128, "longest answer in tokens", "sampling", min_value=1, max_value=32768),
    ParamSpec(
        "temperature", 0.0, "sampling temperature; 0 = greedy (deterministic)", "sampling", min_value=0.0, max_value=5.0
    ),
    ParamSpec("top_p", 1.0, "nucleus sampling mass; 1 = off", "sampling", min_value=0.0, max_value=1.0),
    ParamSpec("top_k", 0, "keep the k most likely tokens; 0 = off", "sampling", min_value=0, max_value=1_000_000),
    ParamSpec(
        "min_p", 0.0, "drop tokens below min_p x the top probability; 0 = off", "sampling", min_value=0.0, max_value=1.0
    ),
    ParamSpec(
        "repetition_penalty",
        1.0,
        "penalty on tokens already present; 1 = off",
        "sampling",
        min_value=0.01,
        max_value=10.0,
    ),
    ParamSpec(
        "presence_penalty",
        0.0,
        "subtracted from logits of tokens already generated; 0 = off",
        "sampling",
        min_value=-2.0,
        max_value=2.0,
    ),
    ParamSpec(
        "seed", -1, "sampling seed; -1 = a fresh random seed per request", "sampling", min_value=-1, max_value=2**31 - 1
    ),
    ParamSpec("system_prompt", "", "system message of every conversation; '' = none", "node"),
    ParamSpec("multi_turn", False, "keep the conversation (one engine session) until ~/reset", "node"),
    ParamSpec(
        "image_max_age_s",
        2.0,
        "a prompt uses the latest image not older than this; 0 = no images",
        "node",
        min_value=0.0,
        max_value=3600.0,
    ),
    ParamSpec(
        "max_queue",
        4,
        "prompts waiting behind the running one; overflow drops the oldest",
        "node",
        min_value=1,
        max_value=1000,
    ),
)

SPECS: dict[str, ParamSpec] = {p.name: p for p in PARAMS}
ENGINE_FIELDS: tuple[str, ...] = tuple(p.name for p in PARAMS if p.target == "engine")
RUNTIME_ENGINE_FIELDS: tuple[str, ...] = tuple(p.name for p in PARAMS if p.target == "engine" and not p.read_only)
SAMPLING_FIELDS: tuple[str, ...] = tuple(p.name for p in PARAMS if p.target == "sampling")


def defaults() -> dict[str, Value]:
    return {p.name: p.default for p in PARAMS}


def _is_power_of_two(n: int) -> bool:
    return n > 0 and (n & (n - 1)) == 0


def check_value(name: str, value: Any, cuda_available: Callable[[], bool] | None = None) -> str | None:
    """The node's own check of one value; returns a refusal reason or None.

    rclpy already enforces types, ranges and read-only flags from the descriptors; this adds what a
    descriptor cannot say (choices, powers of two, CUDA presence), so the caller of ``ros2 param set``
    gets a reason instead of a failure at the next request.
    """
    spec = SPECS.get(name)
    if spec is None:
        return f"unknown parameter {name!r}"
    if spec.choices and value not in spec.choices:
        return f"{name} must be one of {', '.join(spec.choices)}, got {value!r}"
    if name == "page_size" and not _is_power_of_two(int(value)):
        return f"page_size must be a power of two (1, 2, 4, ..., 256), got {value}"
    if name == "device" and value == "cuda":
        available = cuda_available() if cuda_available is not None else _torch_cuda_available()
        if not available:
            return (
                "device cuda requested but CUDA is not available on this machine (torch.cuda.is_available() is False)"
            )
    return None


def check_changes(
    changes: Mapping[str, Any], current: Mapping[str, Any], cuda_available: Callable[[], bool] | None = None
) -> str | None:
    """Check a batch of changes against the current values; returns a refusal reason or None.

    Cross-field rules are evaluated on the values as they would be after the change. Rules that need
    the model (is the KV pool big enough for its layers?) are ``Engine.validate_changes``'s job.
    """
    for name, value in changes.items():
        reason = check_value(name, value, cuda_available)
        if reason:
            return reason
    after = {**current, **changes}
    lo, hi = int(after["image_min_pixels"]), int(after["image_max_pixels"])
    if lo > 0 and hi > 0 and lo > hi:
        return f"image_min_pixels ({lo}) must not exceed image_max_pixels ({hi})"
    return None


def _torch_cuda_available() -> bool:
    import torch

    return bool(torch.cuda.is_available())


def model_path_of(values: Mapping[str, Any]) -> str:
    """The model directory a ``model_path`` value means ('' = the embedded default model)."""
    path = str(values.get("model_path", "") or "")
    return path if path else str(DEFAULT_MODEL_DIR)


def engine_kwargs(values: Mapping[str, Any], names: tuple[str, ...] | None = None) -> dict[str, Any]:
    """Parameter values -> ``EngineConfig`` field values (types the engine expects).

    ``max_sessions`` is not a parameter: the node keeps one conversation when ``multi_turn`` is on and
    none otherwise, and the engine sizes its KV pool for exactly that.
    """
    out: dict[str, Any] = {}
    for name in names if names is not None else ENGINE_FIELDS:
        value = values[name]
        if name == "model_path":
            value = model_path_of(values)
        elif name in ("kv_pool_mb", "kv_prefix_share"):
            value = float(value)
        out[name] = value
    out["max_sessions"] = 1 if values["multi_turn"] else 0
    return out


def sampling_params(values: Mapping[str, Any]) -> SamplingParams:
    """Parameter values -> the ``SamplingParams`` of the next request (seed -1 = None)."""
    seed = int(values["seed"])
    return SamplingParams(
        temperature=float(values["temperature"]),
        top_k=int(values["top_k"]),
        top_p=float(values["top_p"]),
        min_p=float(values["min_p"]),
        repetition_penalty=float(values["repetition_penalty"]),
        presence_penalty=float(values["presence_penalty"]),
        seed=None if seed < 0 else seed,
        max_new_tokens=int(values["max_new_tokens"]),
    )


def engine_config(values: Mapping[str, Any]) -> EngineConfig:
    """The startup ``EngineConfig`` for a full set of parameter values."""
    return replace(EngineConfig(), **engine_kwargs(values), sampling=sampling_params(values))


def declare_parameters(node: Any) -> dict[str, Value]:
    """Declare every parameter on ``node`` with a descriptor; return the resulting values.

    Integer and float ranges go into the descriptor (so ``ros2 param describe`` shows them and rclpy
    refuses out-of-range values itself); choices are listed in ``additional_constraints``.
    """
    from rcl_interfaces.msg import FloatingPointRange, IntegerRange, ParameterDescriptor

    values: dict[str, Value] = {}
    for spec in PARAMS:
        descriptor = ParameterDescriptor(name=spec.name, description=spec.description, read_only=spec.read_only)
        if spec.choices:
            descriptor.additional_constraints = "one of: " + ", ".join(spec.choices)
        if spec.min_value is not None and spec.max_value is not None:
            if isinstance(spec.default, float):
                descriptor.floating_point_range = [
                    FloatingPointRange(from_value=float(spec.min_value), to_value=float(spec.max_value), step=0.0)
                ]
            elif isinstance(spec.default, int) and not isinstance(spec.default, bool):
                descriptor.integer_range = [
                    IntegerRange(from_value=int(spec.min_value), to_value=int(spec.max_value), step=1)
                ]
        param = node.declare_parameter(spec.name, spec.default, descriptor)
        values[spec.name] = param.value
    return values
