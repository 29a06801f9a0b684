"""Figures: repeated measurements reduced to min/median/max with a unit.

Why a figure keeps its raw samples: the JSON is the record a reader checks a claim against, so the
spread over repeats must be visible, not just one number. Ratios between two implementations are
computed per *pair* of alternating repeats (engine run i vs transformers run i), so a slow phase of a
shared machine hits both sides of a pair instead of biasing one side.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Figure:
    """One measured quantity over repeats."""

    unit: str
    samples: list[float]
    description: str = ""
    labels: dict[str, str] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        if not self.samples:
            raise ValueError(f"figure {self.description!r} has no samples")
        return {
            "unit": self.unit,
            "min": min(self.samples),
            "median": statistics.median(self.samples),
            "max": max(self.samples),
            "n": len(self.samples),
            "samples": [float(s) for s in self.samples],
            "description": self.description,
            "labels": dict(self.labels),
        }


def paired_ratio(numerator: Sequence[float], denominator: Sequence[float]) -> list[float]:
    """Per-pair ratios ``numerator[i] / denominator[i]`` (pairs with a zero denominator are dropped)."""
    if len(numerator) != len(denominator):
        raise ValueError(f"paired samples differ in length: {len(numerator)} vs {len(denominator)}")
    return [n / d for n, d in zip(numerator, denominator, strict=True) if d != 0]


def alternate(runs: dict[str, Callable[[], Any]], repeats: int, warmup: int = 1) -> dict[str, list[Any]]:
    """Run every callable ``repeats`` times, interleaved (a, b, a, b, ...), after ``warmup`` unrecorded
    rounds; the starting side flips every round so neither side always runs "second" (warm caches)."""
    names = list(runs)
    for _ in range(warmup):
        for name in names:
            runs[name]()
    out: dict[str, list[Any]] = {name: [] for name in names}
    for i in range(repeats):
        order = names if i % 2 == 0 else list(reversed(names))
        for name in order:
            out[name].append(runs[name]())
    return out


@contextmanager
def stopwatch() -> Iterator[list[float]]:
    """``with stopwatch() as t: ...`` then ``t[0]`` holds the elapsed seconds."""
    box: list[float] = []
    t0 = time.perf_counter()
    try:
        yield box
    finally:
        box.append(time.perf_counter() - t0)
