"""What the node checks before it loads anything, and of each prompt as it arrives: parameter values that
cannot work (bounds, channel names, camera topic names, a model directory that is not one) stop the start
with a :class:`StartupError` that says what to fix; a prompt that cannot be answered as sent is refused."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from rclpy.exceptions import InvalidTopicNameException
from rclpy.validate_topic_name import validate_topic_name

from ..engine import EngineConfig
from ..remote.engine import RemoteEngine, remote_config
from .channel import channel_names_problem
from .params import channel_values, check_changes, engine_config, max_batch, max_sessions


def prompt_problem(text: str) -> str | None:
    """Why a prompt cannot be answered as it arrived, or None. A NUL is refused rather than cut at: ROS
    strings end at the first NUL on most paths, so the text could not be what the sender meant."""
    if "\x00" in text:
        return f"prompt contains a NUL character at position {text.index(chr(0))}: refused, not truncated"
    if not text.strip():
        return "empty prompt: nothing to answer"
    return None


class StartupError(RuntimeError):
    """The node cannot start (bad parameters, missing model); the message says what to fix."""


def check_startup_values(values: Mapping[str, Any]) -> None:
    """StartupError when the declared values are out of bounds or name channels or cameras that cannot be."""
    reason = (
        check_changes(values)
        or channel_names_problem(values["channels"])
        or image_topics_problem([t for ch in channel_list(values) for t in channel_values(values, ch)["image_topics"]])
    )
    if reason:
        raise StartupError(f"invalid parameter value: {reason}")


def remote_startup(values: Mapping[str, Any]) -> RemoteEngine:
    """The server's engine for ``backend`` openai (nothing loaded here; the server need not be up yet: it is
    reported in the diagnostics and each prompt waits a moment for it); StartupError for unusable settings."""
    check_startup_values(values)
    try:
        return RemoteEngine(remote_config(values, max_batch(values), max_sessions(values)))
    except ValueError as exc:
        raise StartupError(str(exc)) from exc


def startup_config(values: Mapping[str, Any]) -> EngineConfig:
    """The engine config of the declared parameter values; StartupError before anything loads when the
    values are out of bounds or the model directory is not one."""
    check_startup_values(values)
    config = engine_config(values)
    if not (config.model_dir / "config.json").is_file():
        if not values["model_path"]:
            raise StartupError(f"the embedded default model is missing at {config.model_dir} (reinstall the package)")
        raise StartupError(
            f"model_path {str(config.model_dir)!r} is not a Hugging Face model directory (no config.json there); "
            "pass -p model_path:=/path/to/Qwen3-VL-... or leave it empty for the embedded default model"
        )
    return config


def channel_list(values: Mapping[str, Any]) -> list[str]:
    """The node's channels: those of ``channels``, or the one unnamed channel on the plain topics."""
    return list(values["channels"]) or [""]


def image_topics_problem(topics: Sequence[str]) -> str | None:
    """Why an ``image_topics`` entry cannot be subscribed (ROS topic name rules), or None."""
    for topic in topics:
        try:
            validate_topic_name(f"{topic}/compressed")  # the raw topic's name is valid when this one is
        except InvalidTopicNameException as exc:
            return f"image_topics entry {topic!r} is not a valid ROS topic name: {str(exc).splitlines()[0]}"
    return None


def context_problem(values: Mapping[str, Any], shortest_prompt_tokens: Callable[[str | None], int]) -> str | None:
    """Why ``max_context_tokens`` cannot hold any prompt with a channel's ``system_prompt``, or None;
    ``shortest_prompt_tokens(system_prompt)``: the engine's count of the chat template's tokens around it."""
    limit = int(values["max_context_tokens"])
    for channel in channel_list(values):
        system_prompt = str(channel_values(values, channel)["system_prompt"]) or None
        floor = shortest_prompt_tokens(system_prompt)
        if limit < floor + 2:
            whose = f"channel {channel}'s system prompt" if channel else "system prompt"
            return (
                f"max_context_tokens={limit} leaves no room for a question: the chat template and {whose} "
                f"alone take {floor} tokens, and a question and its answer need at least one token each"
            )
    return None
