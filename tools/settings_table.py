"""The README's parameter table, rendered from the settings schema: ``python -m tools.settings_table``.

``test/test_settings.py`` holds the README to this output, so the table can only change with the schema.
"""

from __future__ import annotations

from orin_vlm_node import settings

HEADER = (
    "| name | type | default | range / values | applies | a change rebuilds | meaning |\n|---|---|---|---|---|---|---|"
)


def _value(s: settings.Setting, value: settings.Value) -> str:
    if s.type is bool:
        return str(value).lower()
    if s.type is str:
        return f'"{value}"'
    if s.type is list:
        return "[" + ", ".join(f'"{v}"' for v in value) + "]"
    return str(value) if s.type is int else f"{value:g}"


def _bounds(s: settings.Setting) -> str:
    if s.choices:
        return " \\| ".join(s.choices)
    if s.min is None:
        return ""
    if s.type is list:
        return f"{s.min}…{s.max} {s.unit or 'entries'}"
    return f"{_value(s, s.min)}…{_value(s, s.max)}" + (f" {s.unit}" if s.unit else "")


def render() -> str:
    rows = [
        f"| `{s.name}` | {s.type.__name__} | `{_value(s, s.default)}` | {_bounds(s)} "
        f"| {settings.APPLIES_TEXT[s.applies]}{'; per channel' if s.per_channel else ''} "
        f"| {settings.REBUILDS_TEXT[s.rebuilds] if s.consumer == 'engine' else ''} | {s.description} |"
        for s in settings.SETTINGS
    ]
    return "\n".join([HEADER, *rows]) + "\n"


if __name__ == "__main__":
    print(render(), end="")
