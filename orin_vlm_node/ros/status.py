"""What the node reports: the JSON of ``status`` events and the key/values of ``/diagnostics``.

Why JSON on a ``std_msgs/String``: it needs no custom message package (which cannot be built from the
ROS wheels CI uses), any language can read it, and ``ros2 topic echo`` shows it as is.

More in docs/modules.md, ``orin_vlm_node/ros/status.py``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from typing import Any, Literal

EventName = Literal["ready", "accepted", "started", "finished", "error", "dropped", "reconfigured"]
TERMINAL_EVENTS = frozenset({"finished", "dropped", "error"})


def _clean(value: Any) -> Any:
    """JSON-safe values: NaN/inf become null, tuples lists, unknown objects their str()."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, (str, int, bool)) or value is None:
        return value
    if isinstance(value, Mapping):
        return {str(k): _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    return str(value)


def request_note(metrics: Mapping[str, float], *remarks: str | None) -> str | None:
    """The ``note`` of a request's terminal event: the given remarks, then that its conversation started over
    and its preemptions, if they happened."""
    parts = [r for r in remarks if r]
    if metrics.get("forgotten_tokens"):
        parts.append(
            f"the conversation was full ({int(metrics['forgotten_tokens'])} tokens of earlier turns): "
            "it started over with this prompt"
        )
    if metrics.get("preemptions"):
        parts.append(
            f"preempted {int(metrics['preemptions'])}x when the KV pool ran out "
            f"({int(metrics.get('preempted_tokens', 0))} tokens freed and recomputed)"
        )
    return "; ".join(parts) or None


def status_json(
    event: EventName,
    request_id: str | None = None,
    *,
    finish_reason: str | None = None,
    error: str | None = None,
    metrics: Mapping[str, float] | None = None,
    image_stamp: float | None = None,
    images: Sequence[tuple[str, float]] | None = None,
    videos: Sequence[tuple[str, int, float, float]] | None = None,
    note: str | None = None,
    changes: Mapping[str, Any] | None = None,
    output_format: str | None = None,
    output: Mapping[str, Any] | None = None,
) -> str:
    """One status event as a JSON string (the ``data`` of a ``status`` message)."""
    return json.dumps(
        _clean(
            {
                "event": event,
                "request_id": request_id,
                "finish_reason": finish_reason,
                "error": error,
                "metrics": dict(metrics) if metrics is not None else None,
                "image_stamp": image_stamp,
                "images": [{"topic": t, "stamp": st} for t, st in images] if images is not None else None,
                "videos": [{"topic": t, "frames": n, "first_stamp": a, "last_stamp": b} for t, n, a, b in videos]
                if videos is not None
                else None,
                "note": note,
                "changes": dict(changes) if changes is not None else None,
                "output_format": output_format,
                "output": dict(output) if output is not None else None,
            }
        ),
        ensure_ascii=False,
        sort_keys=True,
    )


def diagnostic_values(description: Mapping[str, Any], prefix: str = "") -> list[tuple[str, str]]:
    """Flatten ``Engine.describe()`` into sorted (key, value) strings; nested dicts get dotted keys."""
    out: list[tuple[str, str]] = []
    for key in sorted(description, key=str):
        value = description[key]
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.extend(diagnostic_values(value, prefix=f"{name}."))
        elif isinstance(value, float):
            out.append((name, f"{value:.4g}"))
        else:
            out.append((name, str(value)))
    return out


# diagnostic_msgs/DiagnosticStatus levels (the message package is not imported here).
OK, WARN = b"\x00", b"\x01"


def engine_diagnostics(
    described: Mapping[str, Any], state: str, waiting: int, completed: int, metrics: Mapping[str, float]
) -> tuple[bytes, str, list[tuple[str, str]]]:
    """(level, message, key/values) of the node's ``/diagnostics`` status.

    WARN when the engine cannot describe itself or runs without the kernels it was asked to use.
    """
    level, message = OK, f"{state}, {waiting} waiting"
    if "describe_error" in described:
        level = WARN
    elif described.get("kernels_degraded"):
        level, message = WARN, f"{message}; {described['kernels']}"
    elif described.get("server_problem"):
        level, message = WARN, f"{message}; {described['server_problem']}"
    values = [
        ("state", state),
        ("queue_waiting", str(waiting)),
        ("requests_completed", str(completed)),
        ("last_ttft_s", f"{metrics.get('ttft_s', 0.0):.4g}"),
        ("last_decode_tokens_per_s", f"{metrics.get('decode_tokens_per_s', 0.0):.4g}"),
    ] + diagnostic_values(described, prefix="engine.")
    return level, message, values


def history_diagnostics(stats: Sequence[tuple[str, int, int, float]], limit_mb: int) -> list[tuple[str, str]]:
    """The video history's key/values: all cameras' memory against ``video_history_mb``, then per camera
    the frames kept, their memory and the seconds they span."""
    total = sum(b for _, _, b, _ in stats)
    values = [("video_history.mb", f"{total / 2**20:.1f}"), ("video_history.limit_mb", str(limit_mb))]
    for topic, frames, size, span in stats:
        values += [
            (f"video_history.{topic}.frames", str(frames)),
            (f"video_history.{topic}.mb", f"{size / 2**20:.1f}"),
            (f"video_history.{topic}.seconds", f"{span:.1f}"),
        ]
    return values
