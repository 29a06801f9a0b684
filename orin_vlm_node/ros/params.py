"""The node's ROS parameters: every setting of the schema (``orin_vlm_node.settings``), declared with its
descriptor, checked on set, and mapped onto the engine's config and a request's sampling.

Follow one parameter, say ``page_size``: the schema gives its type, default and range 1..256, which
become its descriptor (rclpy itself refuses values outside the range, ``ros2 param describe`` shows
it); ``ros2 param set`` then reaches :func:`check_changes` (bounds, from the schema) and
``Engine.validate_changes``, where the KV cache's own rule (a power of two) and its pool planner (does
the pool fit) decide; the node applies it between two requests with ``Engine.reconfigure`` on its
worker thread (``node.py``), which rebuilds the cache.

Only :func:`declare_parameters` touches rclpy types; the rest is plain Python, unit-tested without a ROS
graph.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Mapping
from typing import Any

from .. import settings
from ..engine.config import EngineConfig, config_from_settings, sampling_from_settings
from ..engine.events import SamplingParams
from ..engine.output_format import format_from_json
from ..settings import SETTINGS, Value

ENGINE_FIELDS: tuple[str, ...] = tuple(s.name for s in settings.settings_for("engine"))
RUNTIME_ENGINE_FIELDS: tuple[str, ...] = tuple(
    s.name for s in settings.settings_for("engine") if s.applies != "read_only"
)
SAMPLING_FIELDS: tuple[str, ...] = tuple(s.name for s in settings.settings_for("sampling"))
CHANNEL_FIELDS: tuple[str, ...] = tuple(s.name for s in settings.CHANNEL_SETTINGS)


def defaults() -> dict[str, Value]:
    return settings.defaults()


def check_changes(changes: Mapping[str, Any]) -> str | None:
    """The node's check of a batch of changes: names and bounds (the schema); None when they pass.

    rclpy already enforces types, ranges and read-only flags from the descriptors; choices (``dtype``)
    have no descriptor field, so they are checked here. Everything beyond bounds is the engine's:
    ``Engine.validate_changes``. A channel's override (``arm.max_new_tokens``) is checked as the setting it
    overrides; None (not set) means "the node-wide value".
    """
    for name, value in changes.items():
        channel, _, base = name.rpartition(".")
        if channel and base not in CHANNEL_FIELDS:
            return f"unknown setting {name!r}"
        if channel and value is None:
            continue
        reason = settings.problem({base: value}) or (base == "output_format" and _output_format_problem(value))
        if reason:
            return f"{channel}.{reason}" if channel else reason
    return None


def _output_format_problem(text: str) -> str | None:
    try:
        format_from_json(text)
    except ValueError as exc:
        return f"output_format: {exc}"
    return None


def channel_values(values: Mapping[str, Any], channel: str) -> dict[str, Any]:
    """The values a channel's prompts use: the node-wide ones, with the channel's overrides that are set."""
    overrides = {name: values.get(f"{channel}.{name}") for name in CHANNEL_FIELDS} if channel else {}
    return {**values, **{name: value for name, value in overrides.items() if value is not None}}


def max_sessions(values: Mapping[str, Any]) -> int:
    """The conversations the node keeps: one per channel with ``multi_turn``, else none (the KV pool is sized
    for them)."""
    return max(1, len(values["channels"])) if values["multi_turn"] else 0


def engine_kwargs(values: Mapping[str, Any], names: tuple[str, ...] = ENGINE_FIELDS) -> dict[str, Any]:
    """Parameter values -> the ``EngineConfig`` fields ``names`` plus ``max_sessions`` (no parameter of its own),
    with ``max_batch`` as the node can use it (:func:`max_batch`; the automatic KV pool is sized by it)."""
    kwargs = {name: values[name] for name in names} | {"max_sessions": max_sessions(values)}
    if "max_batch" in kwargs:
        kwargs["max_batch"] = max_batch(values)
    return kwargs


def max_batch(values: Mapping[str, Any]) -> int:
    """Requests the node runs at once: ``max_batch``, but never more than it has channels."""
    return min(int(values["max_batch"]), len(values["channels"]) or 1)


def sampling_params(values: Mapping[str, Any]) -> SamplingParams:
    """Parameter values -> the ``SamplingParams`` of the next request."""
    return sampling_from_settings(values)


def engine_config(values: Mapping[str, Any]) -> EngineConfig:
    """The startup ``EngineConfig`` for a full set of parameter values."""
    return config_from_settings(values, max_sessions(values), max_batch(values))


def declare_parameters(node: Any) -> dict[str, Value]:
    """Declare every setting on ``node`` with a descriptor, then each channel's overrides
    (``<channel>.<name>``, declared without a value: not set = the node-wide value); return the values
    (an override not set is None).

    Integer and float ranges go into the descriptor (so ``ros2 param describe`` shows them and rclpy
    refuses out-of-range values itself); choices and units are written into ``additional_constraints``.
    A list whose default is empty is declared by type, since rclpy cannot tell an empty list's type.
    """
    values: dict[str, Value] = {}
    for s in SETTINGS:
        default = defaults()[s.name]
        typed = _parameter_type(s.type) if default == [] else default
        param = node.declare_parameter(s.name, typed, _descriptor(s, s.name))
        values[s.name] = _value(s, param.value)
    for channel in values["channels"]:
        for s in settings.CHANNEL_SETTINGS:
            name = f"{channel}.{s.name}"
            param = node.declare_parameter(name, _parameter_type(s.type), _descriptor(s, name, channel))
            values[name] = None if param.value is None else _value(s, param.value)
    return values


def unknown_parameters_problem(given: Iterable[str], known: Iterable[str]) -> str | None:
    """The parameters given at startup (a params file, ``-p``, launch overrides) that the node does not have,
    each with the nearest known name; None when there are none.

    Why: rclpy ignores a given parameter that is never declared without a word, so a typo in a robot's
    YAML file (``kv_pool_mbs``) would leave the setting at its default. A warning, not a refusal: a params
    file's ``/**`` section may hold parameters meant for other nodes.
    """
    known = list(known)
    unknown = sorted(set(given) - set(known))
    if not unknown:
        return None

    def named(name: str) -> str:
        near = difflib.get_close_matches(name, known, n=1)
        return f"{name} (did you mean {near[0]}?)" if near else name

    return f"unknown parameter(s) ignored: {', '.join(named(name) for name in unknown)}"


def _descriptor(s: settings.Setting, name: str, channel: str = "") -> Any:
    from rcl_interfaces.msg import FloatingPointRange, IntegerRange, ParameterDescriptor

    description = f"channel {channel}: {s.description}; not set = the node-wide {s.name}" if channel else s.description
    descriptor = ParameterDescriptor(name=name, description=description, read_only=s.applies == "read_only")
    notes = [f"one of: {', '.join(s.choices)}"] if s.choices else []
    notes += [f"unit: {s.unit}"] if s.unit else []
    notes += [f"{s.min}..{s.max} distinct names"] if s.type is list else []
    notes += [f"applies: {settings.APPLIES_TEXT[s.applies]}"]
    descriptor.additional_constraints = "; ".join(notes)
    if s.min is not None and s.max is not None and s.type is not list:
        if s.type is float:
            descriptor.floating_point_range = [
                FloatingPointRange(from_value=float(s.min), to_value=float(s.max), step=0.0)
            ]
        else:
            descriptor.integer_range = [IntegerRange(from_value=int(s.min), to_value=int(s.max), step=1)]
    return descriptor


def _value(s: settings.Setting, value: Any) -> Value:
    """A declared parameter's value as the schema types it (a string array as a list; not set as empty)."""
    return list(value or ()) if s.type is list else value


def _parameter_type(python_type: type) -> Any:
    from rclpy.parameter import Parameter

    return {bool: Parameter.Type.BOOL, int: Parameter.Type.INTEGER, float: Parameter.Type.DOUBLE,
            str: Parameter.Type.STRING, list: Parameter.Type.STRING_ARRAY}[python_type]  # fmt: skip
