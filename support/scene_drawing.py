"""Pictures of a few flat coloured shapes, drawn with their label maps, and the layouts the questions use.

Everything is drawn with cv2 from a numpy ``Generator``: the same generator state gives the same picture on any
machine. The layouts keep every question unambiguous: shapes in one picture are of different kinds, a pair is
clearly side by side or one above the other, scattered shapes never overlap.
"""

from __future__ import annotations

from dataclasses import dataclass

import cv2
import numpy as np

SHAPES: tuple[str, ...] = ("circle", "square", "triangle", "star", "cross")

# Saturated RGB base colours; backgrounds are low-saturation so a shape's colour is never confused with them.
COLORS: dict[str, tuple[int, int, int]] = {
    "red": (220, 30, 30),
    "green": (30, 165, 50),
    "blue": (35, 75, 225),
    "yellow": (240, 210, 20),
    "purple": (140, 50, 185),
    "orange": (250, 130, 20),
}


@dataclass(frozen=True)
class Shape:
    """A shape placed in a scene: centre (x, y) and radius in pixels."""

    kind: str
    color: str
    x: float
    y: float
    r: float


# ----------------------------------------------------------------------------------------------------------------
# Drawing


def _background(rng: np.random.Generator, h: int, w: int) -> np.ndarray:
    """Plain, linear-gradient or noisy background of low saturation (light or dark)."""

    def tone() -> np.ndarray:
        level = rng.uniform(165, 250) if rng.random() < 0.75 else rng.uniform(25, 75)
        return np.clip(level + rng.uniform(-14, 14, size=3), 0, 255)

    kind = rng.choice(("plain", "gradient", "noisy"))
    base = tone()
    img = np.broadcast_to(base, (h, w, 3)).astype(np.float32)
    if kind == "gradient":
        other = tone() if rng.random() < 0.5 else np.clip(base + rng.uniform(-50, 50), 0, 255)
        angle = rng.uniform(0, 2 * np.pi)
        yy, xx = np.mgrid[0:h, 0:w].astype(np.float32)
        t = xx * np.cos(angle) + yy * np.sin(angle)
        t = (t - t.min()) / max(float(t.max() - t.min()), 1.0)
        img = base[None, None, :] * (1 - t[..., None]) + other[None, None, :] * t[..., None]
    elif kind == "noisy":
        img = img + rng.normal(0, rng.uniform(6, 18), size=(h, w, 3))
    return np.clip(img, 0, 255).astype(np.uint8)


def _star_points(x: float, y: float, r: float, rot: float) -> np.ndarray:
    angles = rot + np.arange(10) * np.pi / 5 - np.pi / 2
    radii = np.where(np.arange(10) % 2 == 0, r, r * 0.45)
    return np.stack([x + radii * np.cos(angles), y + radii * np.sin(angles)], axis=1)


def _outline(s: Shape, rng: np.random.Generator) -> np.ndarray | None:
    """Polygon of ``s`` (float (k, 2) x/y points), or None for a circle (drawn with cv2.circle)."""
    x, y, r = s.x, s.y, s.r
    if s.kind == "circle":
        return None
    if s.kind == "square":
        a = r * 0.85
        return np.array([[x - a, y - a], [x + a, y - a], [x + a, y + a], [x - a, y + a]])
    if s.kind == "triangle":
        ang = -np.pi / 2 + np.arange(3) * 2 * np.pi / 3
        return np.stack([x + r * np.cos(ang), y + 0.15 * r + r * np.sin(ang)], axis=1)
    if s.kind == "star":
        return _star_points(x, y, r, rng.uniform(-0.15, 0.15))
    if s.kind == "cross":
        a, b = r * 0.9, r * 0.3
        return np.array(
            [
                [x - b, y - a],
                [x + b, y - a],
                [x + b, y - b],
                [x + a, y - b],
                [x + a, y + b],
                [x + b, y + b],
                [x + b, y + a],
                [x - b, y + a],
                [x - b, y + b],
                [x - a, y + b],
                [x - a, y - b],
                [x - b, y - b],
            ]
        )
    raise ValueError(f"unknown shape kind {s.kind!r}")


def _fill(img: np.ndarray, s: Shape, outline: np.ndarray | None, color: tuple[int, ...], line: int) -> None:
    if outline is None:
        cv2.circle(img, (round(s.x), round(s.y)), round(s.r), color, -1, line)
    else:
        cv2.fillPoly(img, [np.round(outline).astype(np.int32)], color, line)


def render_with_labels(rng: np.random.Generator, h: int, w: int, shapes: list[Shape]) -> tuple[np.ndarray, np.ndarray]:
    """Draw ``shapes`` (with slightly jittered colours) on a random background.

    Returns the HWC uint8 RGB image and a (h, w) uint8 label map: 0 for background, ``i + 1`` where shape ``i``
    is visible (later shapes cover earlier ones, as in the image). The training script's dense vision objective
    learns from it which shape, hence which kind and colour, each image token shows.
    """
    img = np.ascontiguousarray(_background(rng, h, w))
    labels = np.zeros((h, w), dtype=np.uint8)
    for i, s in enumerate(shapes):
        base = np.array(COLORS[s.color], dtype=np.float64)
        rgb = np.clip(base + rng.uniform(-18, 18, size=3), 0, 255)
        outline = _outline(s, rng)
        _fill(img, s, outline, tuple(int(c) for c in rgb), cv2.LINE_AA)
        _fill(labels, s, outline, (i + 1,), cv2.LINE_8)
    return img, labels


# ----------------------------------------------------------------------------------------------------------------
# Layouts


def _size(rng: np.random.Generator, lo: int) -> tuple[int, int]:
    """Image (h, w): sides in [lo, 160] px, aspect ratios up to about 2:1 either way."""
    h = int(rng.integers(lo, 161))
    w = int(rng.integers(lo, 161))
    return h, w


def _kinds_colors(rng: np.random.Generator, n: int) -> list[tuple[str, str]]:
    kinds = rng.choice(len(SHAPES), size=n, replace=False)
    colors = rng.integers(len(COLORS), size=n)  # colours may repeat: questions name the shape, not the colour
    names = list(COLORS)
    return [(SHAPES[int(k)], names[int(c)]) for k, c in zip(kinds, colors, strict=True)]


def single_layout(rng: np.random.Generator) -> tuple[int, int, list[Shape]]:
    h, w = _size(rng, 64)
    m = min(h, w)
    r = max(12.0, rng.uniform(0.2, 0.36) * m)
    x = rng.uniform(r + 2, w - r - 2)
    y = rng.uniform(r + 2, h - r - 2)
    ((kind, color),) = _kinds_colors(rng, 1)
    return h, w, [Shape(kind, color, x, y, r)]


def pair_layout(rng: np.random.Generator, axis: str) -> tuple[int, int, list[Shape]]:
    """Two shapes clearly side by side (axis="x") or one above the other (axis="y"), list order = left/top first."""
    h, w = _size(rng, 80)
    along, across = (w, h) if axis == "x" else (h, w)
    # Radius so that two shapes plus a gap fit along the long axis of the pair.
    r = max(12.0, rng.uniform(0.15, 0.24) * min(along / 2, across))
    gap = rng.uniform(0.1, 0.25) * along
    c1 = rng.uniform(r + 2, max(r + 2.5, along / 2 - gap / 2 - r))
    c2 = rng.uniform(min(along - r - 2.5, along / 2 + gap / 2 + r), along - r - 2)
    jitter = 0.12 * across
    mid = across / 2
    d1 = np.clip(mid + rng.uniform(-jitter, jitter), r + 2, across - r - 2)
    d2 = np.clip(mid + rng.uniform(-jitter, jitter), r + 2, across - r - 2)
    (k1, col1), (k2, col2) = _kinds_colors(rng, 2)
    if axis == "x":
        return h, w, [Shape(k1, col1, c1, d1, r), Shape(k2, col2, c2, d2, r)]
    return h, w, [Shape(k1, col1, d1, c1, r), Shape(k2, col2, d2, c2, r)]


def scatter_layout(rng: np.random.Generator, n: int) -> tuple[int, int, list[Shape]]:
    """``n`` non-overlapping shapes at random places (rejection sampling, shrinking when crowded)."""
    h, w = _size(rng, 96 if n == 3 else 80)
    m = min(h, w)
    scale = 0.2 if n == 2 else 0.16
    for attempt in range(200):
        r = max(11.0, rng.uniform(0.7, 1.0) * scale * m * (0.98 ** (attempt // 20)))
        pts: list[tuple[float, float]] = []
        for _ in range(60):
            x = rng.uniform(r + 2, w - r - 2)
            y = rng.uniform(r + 2, h - r - 2)
            if all((x - px) ** 2 + (y - py) ** 2 > (2 * r + 6) ** 2 for px, py in pts):
                pts.append((x, y))
                if len(pts) == n:
                    kc = _kinds_colors(rng, n)
                    return h, w, [Shape(k, c, x0, y0, r) for (k, c), (x0, y0) in zip(kc, pts, strict=True)]
    raise RuntimeError("could not place shapes")  # unreachable with the sizes above
