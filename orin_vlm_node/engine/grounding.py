"""Qwen3-VL's grounding as detections in the pixels of the frames it was shown.

Asked to locate objects, Qwen3-VL answers ``[{"bbox_2d": [x1, y1, x2, y2], "label": "red cup"}, ...]`` (or
``"point_2d": [x, y]``) on a 0-1000 grid over the image it saw (not in pixels, unlike Qwen2.5-VL). The answer
is constrained to that JSON (labels among those asked for, coordinates integers 0..1000, the separators the
model was trained with), then mapped back: the resize keeps the whole frame, so ``x / 1000 * width`` is the
pixel column in the original camera frame, clamped to it. With several images an ``"image"`` number (1 is
the first) comes first in each object, so every box says which camera it is in. An object's score is the
geometric mean of the model's own probabilities of the tokens it wrote for that object (:func:`detections`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from .output_format import OutputFormat, parsed_json

GRID = 1000  # Qwen3-VL's coordinates: 0..GRID over the image's width and height
MAX_OBJECTS = 50
# Qwen's own separators: the answers it was trained on are written ``{"bbox_2d": [1, 2, 3, 4], "label": "x"}``.
SEPARATORS = {"item_separator": ", ", "key_separator": ": ", "whitespace_flexible": False}


@dataclass(frozen=True)
class Detection:
    """One object found: ``box`` (x1, y1, x2, y2) in pixels of its original frame (a point: a box of no size),
    ``image`` the index of that frame among the prompt's images, ``score`` in (0, 1]."""

    label: str
    box: tuple[float, float, float, float]
    image: int
    score: float
    point: bool = False

    def as_dict(self) -> dict:
        return {"label": self.label, "box": list(self.box), "image": self.image, "score": self.score,
                "point": self.point}  # fmt: skip


def parse_labels(text: str) -> tuple[str, ...]:
    """``"red cup, person"`` -> ("red cup", "person"); ValueError when none is named."""
    labels = tuple(dict.fromkeys(part.strip() for part in text.split(",") if part.strip()))
    if not labels:
        raise ValueError("a detection request names what to find, e.g. 'red cup, person'")
    return labels


def grounding_request(labels: Sequence[str], images: int, points: bool = False) -> tuple[str, OutputFormat]:
    """The prompt that asks Qwen3-VL to locate ``labels`` in ``images`` images, and the format of its answer."""
    if images < 1:
        raise ValueError("a detection request needs an image: no camera frame was available")
    names = ", ".join(f'"{label}"' for label in labels)
    where = "the image" if images == 1 else f"the {images} images (numbered 1 to {images} in the order shown)"
    what = "point coordinates" if points else "bbox coordinates"
    text = (
        f"Locate every instance that belongs to the following categories in {where}: {names}. "
        f"Report {what} in JSON format."
    )
    key, size = ("point_2d", 2) if points else ("bbox_2d", 4)
    coordinate = {"type": "integer", "minimum": 0, "maximum": GRID}
    properties = {key: {"type": "array", "items": coordinate, "minItems": size, "maxItems": size},
                  "label": {"enum": list(labels)}}  # fmt: skip
    if images > 1:
        properties = {"image": {"type": "integer", "minimum": 1, "maximum": images}, **properties}
    item = {"type": "object", "properties": properties, "required": list(properties), "additionalProperties": False}
    schema = {"type": "array", "items": item, "maxItems": MAX_OBJECTS, "x-guidance": SEPARATORS}
    return text, OutputFormat("json_schema", schema)


def detections(
    text: str,
    token_probs: Sequence[float],
    token_spans: Sequence[tuple[int, int]],
    sizes: Sequence[tuple[int, int]],
) -> list[Detection]:
    """The objects of a grounding answer, each in the pixels of its image (``sizes``: (height, width) of each
    original frame); ``token_probs`` and ``token_spans`` (``Finished``'s) score each object by the tokens
    that wrote it. ValueError when the answer is not the grounding JSON."""
    objects = parsed_json(text, f"the grounding answer {text[:200]!r}", list)
    spans = _object_spans(text)
    found = []
    for obj, (start, end) in zip(objects, spans, strict=True):
        image = int(obj.get("image", 1)) - 1
        if not 0 <= image < len(sizes):
            raise ValueError(f"the grounding answer names image {image + 1} of {len(sizes)}")
        height, width = sizes[image]
        point = "point_2d" in obj
        coords = obj["point_2d"] * 2 if point else obj["bbox_2d"]
        x1, y1, x2, y2 = (_pixel(c, width if i % 2 == 0 else height) for i, c in enumerate(coords))
        probs = [p for p, (a, b) in zip(token_probs, token_spans, strict=False) if a < end and b > start]
        score = math.exp(sum(math.log(max(p, 1e-30)) for p in probs) / len(probs)) if probs else 0.0
        found.append(Detection(str(obj["label"]), (x1, y1, x2, y2), image, score, point))
    return found


def _pixel(coordinate: float, extent: int) -> float:
    """A 0..GRID coordinate in pixels of an ``extent``-pixel side, clamped to it."""
    return min(max(coordinate / GRID * extent, 0.0), float(extent))


def _object_spans(text: str) -> list[tuple[int, int]]:
    """(start, end) characters of each top-level object of the JSON array ``text`` (strings skipped)."""
    spans, depth, start, in_string, escaped = [], 0, 0, False, False
    for i, ch in enumerate(text):
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
            continue
        if ch == '"':
            in_string = True
        elif ch in "[{":
            depth += 1
            if depth == 2 and ch == "{":
                start = i
        elif ch in "]}":
            if depth == 2 and ch == "}":
                spans.append((start, i + 1))
            depth -= 1
    return spans
