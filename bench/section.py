"""What one benchmark section hands back to the runner.

A section is ``ok`` when it measured something, ``skipped`` when its precondition is missing (no CUDA,
no engine yet, no 2B config) and ``error`` when it crashed; the reason is always recorded so a JSON with
a missing figure explains itself. Parts of a section can be skipped on their own (``skip_part``), e.g.
the 2B-shape checkpoint in quick mode, while the rest of the section still reports figures.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from bench.stats import Figure

Status = Literal["ok", "skipped", "error"]


@dataclass
class SectionResult:
    name: str
    status: Status = "ok"
    reason: str | None = None
    setup: dict[str, Any] = field(default_factory=dict)  # what was measured on (model shape, dtype, sizes)
    figures: dict[str, Figure] = field(default_factory=dict)
    skipped_parts: list[dict[str, str]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    duration_s: float = 0.0

    def add(self, key: str, unit: str, samples: list[float], description: str = "", **labels: str) -> Figure:
        """Record a figure under ``key`` (dotted id, unique in the section)."""
        if key in self.figures:
            raise ValueError(f"section {self.name}: figure {key!r} recorded twice")
        fig = Figure(unit=unit, samples=[float(s) for s in samples], description=description, labels=labels)
        self.figures[key] = fig
        return fig

    def skip_part(self, part: str, reason: str) -> None:
        self.skipped_parts.append({"part": part, "reason": reason})

    def as_dict(self) -> dict[str, Any]:
        return {
            "status": self.status,
            "reason": self.reason,
            "setup": self.setup,
            "figures": {k: f.as_dict() for k, f in self.figures.items()},
            "skipped_parts": list(self.skipped_parts),
            "notes": list(self.notes),
            "duration_s": self.duration_s,
        }


def skipped(name: str, reason: str) -> SectionResult:
    return SectionResult(name=name, status="skipped", reason=reason)
