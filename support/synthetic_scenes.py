"""Procedural shape scenes with English and Chinese questions: the training and test data of the default model.

Why synthetic: no model or data set can be downloaded, yet the embedded default model must really look at the
picture. Scenes of a few flat shapes give questions whose answers are short and unambiguous (which shape, which
colour, how many, where, a one-sentence description), so exact-match accuracy is a meaningful test of the whole
pipeline (image processing, vision tower, M-RoPE, decoding).

Everything is drawn with cv2 from a numpy ``Generator``: the same seed gives the same samples, on any machine.
Scenes are designed so every question has exactly one correct answer:
- colour questions name a shape type that occurs exactly once (shapes in a scene have distinct types);
- position questions use two shapes placed clearly side by side or one above the other, so the asked shape is
  unambiguously "left"/"right" or "top"/"bottom" of the other;
- descriptions list the shapes left to right in a side-by-side layout.

Public API: ``sample(rng) -> Sample``, ``sample_with_scene(rng) -> (Sample, Scene)``, ``make_samples(seed, n)``,
``train_rng(seed, index)``, ``held_out_samples(n)``, ``all_texts()`` (every question/answer string, for the
tokenizer), ``shape_name(kind, lang)``.
"""

from __future__ import annotations

from dataclasses import dataclass

import cv2
import numpy as np

SHAPES: tuple[str, ...] = ("circle", "square", "triangle", "star", "cross")
SHAPES_ZH: dict[str, str] = {
    "circle": "圆形",
    "square": "正方形",
    "triangle": "三角形",
    "star": "星形",
    "cross": "十字形",
}
# Saturated RGB base colours; backgrounds are low-saturation so a shape's colour is never confused with them.
COLORS: dict[str, tuple[int, int, int]] = {
    "red": (220, 30, 30),
    "green": (30, 165, 50),
    "blue": (35, 75, 225),
    "yellow": (240, 210, 20),
    "purple": (140, 50, 185),
    "orange": (250, 130, 20),
}
COLORS_ZH: dict[str, str] = {
    "red": "红色",
    "green": "绿色",
    "blue": "蓝色",
    "yellow": "黄色",
    "purple": "紫色",
    "orange": "橙色",
}
COUNT_EN = {1: "One.", 2: "Two.", 3: "Three."}
COUNT_ZH = {1: "一个。", 2: "两个。", 3: "三个。"}
WHERE_EN = {"left": "On the left.", "right": "On the right.", "top": "At the top.", "bottom": "At the bottom."}
AND = {"en": " and ", "zh": "和"}  # joins the shapes of a description
WHERE_ZH = {"left": "在左边。", "right": "在右边。", "top": "在上边。", "bottom": "在下边。"}

Q_EN: dict[str, tuple[str, ...]] = {
    "shape": (
        "What shape is this?",
        "What shape is in the picture?",
        "Which shape do you see?",
        "Name the shape in the image.",
    ),
    "color": ("What color is the {shape}?", "Which color does the {shape} have?", "Tell me the color of the {shape}."),
    "count": ("How many shapes are there?", "How many shapes are in the picture?", "Count the shapes."),
    "position": (
        "Where is the {shape}?",
        "Where is the {shape} in the image?",
        "Is the {shape} on the left, right, top or bottom?",
    ),
    "describe": ("Describe the image in one sentence.", "Describe this picture.", "What is in the image?"),
}
Q_ZH: dict[str, tuple[str, ...]] = {
    "shape": ("这是什么形状？", "图片里是什么形状？", "你看到了什么形状？"),
    "color": ("{shape}是什么颜色？", "{shape}的颜色是什么？"),
    "count": ("图片里有几个形状？", "有多少个形状？", "数一数图中的形状。"),
    "position": ("{shape}在哪里？", "{shape}在图片的什么位置？"),
    "describe": ("用一句话描述这张图片。", "描述一下这张图。", "图片里有什么？"),
}
CHAT: dict[str, dict[str, tuple[tuple[str, ...], str]]] = {
    "en": {
        "greet": (("Hello!", "Hi", "Hello, who are you?", "Hi there!"), "Hello! I am a tiny demo vision model."),
        "ability": (
            ("What can you do?", "What are you able to do?", "How can you help me?"),
            "I can tell the shapes in a picture, their colors, how many there are and where they are.",
        ),
    },
    "zh": {
        "greet": (("你好！", "你好", "你是谁？", "嗨"), "你好！我是一个小型演示视觉模型。"),
        "ability": (
            ("你能做什么？", "你会做什么？", "你能帮我做什么？"),
            "我可以说出图片中形状的名字、颜色、数量和位置。",
        ),
    },
}
# How often each question type is drawn (text-only chat included); weights sum to 1.
QTYPE_WEIGHTS: dict[str, float] = {
    "shape": 0.18,
    "color": 0.20,
    "count": 0.16,
    "position": 0.20,
    "describe": 0.16,
    "chat": 0.10,
}


@dataclass(frozen=True)
class Sample:
    """One exchange. ``image`` is HWC uint8 RGB, or None for text-only chat."""

    image: np.ndarray | None
    question: str
    answer: str
    qtype: str  # shape | color | count | position | describe | chat
    lang: str  # en | zh


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


def _single(rng: np.random.Generator) -> tuple[int, int, list[Shape]]:
    h, w = _size(rng, 64)
    m = min(h, w)
    r = max(12.0, rng.uniform(0.2, 0.36) * m)
    x = rng.uniform(r + 2, w - r - 2)
    y = rng.uniform(r + 2, h - r - 2)
    ((kind, color),) = _kinds_colors(rng, 1)
    return h, w, [Shape(kind, color, x, y, r)]


def _pair(rng: np.random.Generator, axis: str) -> tuple[int, int, list[Shape]]:
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


def _scatter(rng: np.random.Generator, n: int) -> tuple[int, int, list[Shape]]:
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


# ----------------------------------------------------------------------------------------------------------------
# Questions


def _describe(shapes: list[Shape], lang: str) -> str:
    if lang == "en":
        parts = [f"{'an' if s.color[0] in 'aeiou' else 'a'} {s.color} {s.kind}" for s in shapes]
        text = AND["en"].join(parts)
        return text[0].upper() + text[1:] + "."
    return AND["zh"].join(f"一个{COLORS_ZH[s.color]}的{SHAPES_ZH[s.kind]}" for s in shapes) + "。"


def shape_name(kind: str, lang: str) -> str:
    return kind if lang == "en" else SHAPES_ZH[kind]


@dataclass(frozen=True)
class Scene:
    """What a sample's picture shows (its shapes, the (h, w) label map of ``render_with_labels``, the sides of a
    pair layout) and which shape each part of the answer is about: the training script's per-token targets and
    attention targets come from it."""

    shapes: list[Shape]
    labels: np.ndarray | None  # None for text-only chat
    sides: tuple[str, ...] | None = None  # pair layouts: where each shape is ("left", "right") / ("top", "bottom")
    # What the answer talks about: (first character, shape index) pairs in answer order; the characters from
    # one start to the next are about that shape (for colour and position questions: the shape the question
    # names). Empty for counting and chat.
    subjects: tuple[tuple[int, int], ...] = ()


def sample(rng: np.random.Generator) -> Sample:
    """Draw one sample (scene, question, answer); deterministic given the generator's state."""
    return sample_with_scene(rng)[0]


def sample_with_scene(rng: np.random.Generator) -> tuple[Sample, Scene]:
    """Like ``sample`` (same draws, same result) but also returns what the picture shows; the training script
    uses it for its curriculum, its dense vision objective and its attention targets."""
    qtypes = list(QTYPE_WEIGHTS)
    qtype = qtypes[int(rng.choice(len(qtypes), p=np.array(list(QTYPE_WEIGHTS.values()))))]
    lang = "en" if rng.random() < 0.5 else "zh"
    templates = Q_EN if lang == "en" else Q_ZH

    def pick(options: tuple[str, ...]) -> str:
        return options[int(rng.integers(len(options)))]

    if qtype == "chat":
        topic = "greet" if rng.random() < 0.5 else "ability"
        questions, answer = CHAT[lang][topic]
        return Sample(None, pick(questions), answer, qtype, lang), Scene([], None)

    sides: tuple[str, ...] | None = None
    asked: int | None = None
    if qtype == "shape":
        h, w, shapes = _single(rng)
        s = shapes[0]
        answer = f"A {s.kind}." if lang == "en" else f"{SHAPES_ZH[s.kind]}。"
        question = pick(templates["shape"])
    elif qtype == "color":
        n = int(rng.integers(1, 4))
        h, w, shapes = _single(rng) if n == 1 else _scatter(rng, n)
        asked = int(rng.integers(len(shapes)))
        s = shapes[asked]
        answer = f"{s.color.capitalize()}." if lang == "en" else f"{COLORS_ZH[s.color]}。"
        question = pick(templates["color"]).format(shape=shape_name(s.kind, lang))
    elif qtype == "count":
        n = int(rng.integers(1, 4))
        h, w, shapes = _single(rng) if n == 1 else _scatter(rng, n)
        answer = (COUNT_EN if lang == "en" else COUNT_ZH)[n]
        question = pick(templates["count"])
    elif qtype == "position":
        axis = "x" if rng.random() < 0.5 else "y"
        h, w, shapes = _pair(rng, axis)
        sides = ("left", "right") if axis == "x" else ("top", "bottom")
        asked = int(rng.integers(2))
        answer = (WHERE_EN if lang == "en" else WHERE_ZH)[sides[asked]]
        question = pick(templates["position"]).format(shape=shape_name(shapes[asked].kind, lang))
    else:  # describe: one shape, or two side by side listed left to right
        h, w, shapes = _single(rng) if rng.random() < 0.4 else _pair(rng, "x")
        sides = ("left", "right") if len(shapes) == 2 else None
        answer = _describe(shapes, lang)
        question = pick(templates["describe"])
    subjects: tuple[tuple[int, int], ...] = ()
    if asked is not None:
        subjects = ((0, asked),)
    elif qtype == "shape":
        subjects = ((0, 0),)
    elif qtype == "describe":
        subjects = ((0, 0),) if len(shapes) == 1 else ((0, 0), (answer.index(AND[lang]), 1))
    image, labels = render_with_labels(rng, h, w, shapes)
    return Sample(image, question, answer, qtype, lang), Scene(shapes, labels, sides, subjects)


# ----------------------------------------------------------------------------------------------------------------
# Seeds: training and held-out evaluation draw from disjoint SeedSequence namespaces.

TRAIN_NAMESPACE = 1000
EVAL_NAMESPACE = 2000
EVAL_SEED = 7


def train_rng(seed: int, index: int) -> np.random.Generator:
    """Generator for training sample ``index`` of run ``seed``; never overlaps the held-out stream."""
    return np.random.default_rng([TRAIN_NAMESPACE, seed, index])


def make_samples(seed: int, n: int, namespace: int = EVAL_NAMESPACE) -> list[Sample]:
    """``n`` samples from one generator seeded by (namespace, seed)."""
    rng = np.random.default_rng([namespace, seed])
    return [sample(rng) for _ in range(n)]


def held_out_samples(n: int = 200, seed: int = EVAL_SEED) -> list[Sample]:
    """The fixed held-out set the acceptance tests and the model card use."""
    return make_samples(seed, n, EVAL_NAMESPACE)


def all_texts() -> list[str]:
    """Every question and answer string the generator can produce (tokenizer training corpus)."""
    texts: list[str] = []
    for lang, templates in (("en", Q_EN), ("zh", Q_ZH)):
        for kind in SHAPES:
            name = shape_name(kind, lang)
            for qs in templates.values():
                texts.extend(q.format(shape=name) for q in qs)
        for topic in CHAT[lang].values():
            texts.extend(topic[0])
            texts.append(topic[1])
    texts += list(COUNT_EN.values()) + list(COUNT_ZH.values()) + list(WHERE_EN.values()) + list(WHERE_ZH.values())
    for kind in SHAPES:
        texts += [f"A {kind}.", f"{SHAPES_ZH[kind]}。"]
    for color in COLORS:
        texts += [f"{color.capitalize()}.", f"{COLORS_ZH[color]}。"]
    for k1 in SHAPES:
        for c1 in COLORS:
            one = [Shape(k1, c1, 0, 0, 1)]
            texts += [_describe(one, "en"), _describe(one, "zh")]
            for k2 in SHAPES:
                if k2 != k1:
                    c2 = "red" if c1 != "red" else "blue"
                    two = one + [Shape(k2, c2, 0, 0, 1)]
                    texts += [_describe(two, "en"), _describe(two, "zh")]
    return texts
