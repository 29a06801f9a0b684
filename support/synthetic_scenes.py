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

import numpy as np

from .scene_drawing import COLORS, SHAPES, Shape, pair_layout, render_with_labels, scatter_layout, single_layout

SHAPES_ZH: dict[str, str] = {
    "circle": "圆形",
    "square": "正方形",
    "triangle": "三角形",
    "star": "星形",
    "cross": "十字形",
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
        h, w, shapes = single_layout(rng)
        s = shapes[0]
        answer = f"A {s.kind}." if lang == "en" else f"{SHAPES_ZH[s.kind]}。"
        question = pick(templates["shape"])
    elif qtype == "color":
        n = int(rng.integers(1, 4))
        h, w, shapes = single_layout(rng) if n == 1 else scatter_layout(rng, n)
        asked = int(rng.integers(len(shapes)))
        s = shapes[asked]
        answer = f"{s.color.capitalize()}." if lang == "en" else f"{COLORS_ZH[s.color]}。"
        question = pick(templates["color"]).format(shape=shape_name(s.kind, lang))
    elif qtype == "count":
        n = int(rng.integers(1, 4))
        h, w, shapes = single_layout(rng) if n == 1 else scatter_layout(rng, n)
        answer = (COUNT_EN if lang == "en" else COUNT_ZH)[n]
        question = pick(templates["count"])
    elif qtype == "position":
        axis = "x" if rng.random() < 0.5 else "y"
        h, w, shapes = pair_layout(rng, axis)
        sides = ("left", "right") if axis == "x" else ("top", "bottom")
        asked = int(rng.integers(2))
        answer = (WHERE_EN if lang == "en" else WHERE_ZH)[sides[asked]]
        question = pick(templates["position"]).format(shape=shape_name(shapes[asked].kind, lang))
    else:  # describe: one shape, or two side by side listed left to right
        h, w, shapes = single_layout(rng) if rng.random() < 0.4 else pair_layout(rng, "x")
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
