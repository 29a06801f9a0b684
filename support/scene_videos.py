"""Short clips of the shape scenes in which one shape moves: the default model's questions about time.

"Which way did the circle move?" has one right answer when exactly one shape moves, straight and far
enough to cross image tokens: left, right, up or down. A second shape of another kind may stand still in
the clip, so the question must find the named shape and follow it across the frame pairs (the model sees
the clip as Qwen3-VL video: frames paired, each pair told its time). Frames are 0.5 s apart (the node's
default rate), every frame of a clip on the same background, drawn with cv2 from a numpy ``Generator``.
Held-out clips come from a seed namespace of their own.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .scene_drawing import COLORS, SHAPES, Shape, render_with_labels
from .synthetic_scenes import EVAL_NAMESPACE, SHAPES_ZH

MOTION_SEED = 19  # held-out clips: (EVAL_NAMESPACE, 19)
FRAME_GAP_S = 0.5
DIRECTIONS = ("left", "right", "up", "down")
ANSWERS = {
    "en": {"left": "To the left.", "right": "To the right.", "up": "Up.", "down": "Down."},
    "zh": {"left": "向左。", "right": "向右。", "up": "向上。", "down": "向下。"},
}
QUESTIONS = {
    "en": ("Which way did the {shape} move?", "In which direction did the {shape} move?", "Where did the {shape} go?"),
    "zh": ("{shape}往哪个方向移动了？", "{shape}向哪边移动了？"),
}


@dataclass(frozen=True)
class Clip:
    """A question about a clip: its frames (HWC uint8 RGB), their times in seconds, and the answer."""

    frames: tuple[np.ndarray, ...]
    times: tuple[float, ...]
    question: str
    answer: str
    qtype: str  # "motion"
    lang: str
    labels: tuple[np.ndarray, ...] = ()  # per frame (h, w) uint8: 1 where the moving shape is, 2 the still one
    direction: str = ""  # left | right | up | down


def _path(rng: np.random.Generator, h: int, w: int, r: float, direction: str) -> tuple[np.ndarray, np.ndarray]:
    """Start and end centre (x, y) of a straight move over at least 40% of the picture along its axis."""
    along = w if direction in ("left", "right") else h
    across = h if direction in ("left", "right") else w
    travel = rng.uniform(0.4, 0.9) * (along - 2 * r - 4)
    start = rng.uniform(r + 2, along - r - 2 - travel)
    first, last = (start + travel, start) if direction in ("left", "up") else (start, start + travel)
    side = rng.uniform(r + 2, across - r - 2)
    if direction in ("left", "right"):
        return np.array([first, side]), np.array([last, side])
    return np.array([side, first]), np.array([side, last])


def motion_clip(rng: np.random.Generator) -> Clip:
    """One clip of 3 to 6 frames: a shape moving one way, maybe another standing still, and the question."""
    lang = "en" if rng.random() < 0.6 else "zh"
    h, w = int(rng.integers(80, 161)), int(rng.integers(80, 161))
    kinds = rng.permutation(len(SHAPES))[:2]
    colors = list(COLORS)
    r = float(rng.uniform(0.12, 0.2) * min(h, w))
    direction = DIRECTIONS[int(rng.integers(4))]
    start, end = _path(rng, h, w, r, direction)
    still = None
    if rng.random() < 0.5:  # a shape that does not move, away from the moving one's path
        for _ in range(20):
            x, y = rng.uniform(r + 2, w - r - 2), rng.uniform(r + 2, h - r - 2)
            if all(np.hypot(x - p[0], y - p[1]) > 2.2 * r for p in np.linspace(start, end, 8)):
                color = colors[int(rng.integers(len(colors)))]
                still = Shape(SHAPES[int(kinds[1])], color, float(x), float(y), r)
                break
    kind, color = SHAPES[int(kinds[0])], colors[int(rng.integers(len(colors)))]
    count = int(rng.integers(3, 7))
    seed = int(rng.integers(2**31))  # every frame: the same background and colours
    frames, labels = [], []
    for t in np.linspace(0.0, 1.0, count):
        x, y = start + (end - start) * t
        shapes = [Shape(kind, color, float(x), float(y), r)] + ([still] if still else [])
        frame, label = render_with_labels(np.random.default_rng(seed), h, w, shapes)
        frames.append(frame)
        labels.append(label)
    questions = QUESTIONS[lang]
    name = kind if lang == "en" else SHAPES_ZH[kind]
    question = questions[int(rng.integers(len(questions)))].format(shape=name)
    times = tuple(i * FRAME_GAP_S for i in range(count))
    return Clip(tuple(frames), times, question, ANSWERS[lang][direction], "motion", lang, tuple(labels), direction)


def held_out_clips(n: int = 100) -> list[Clip]:
    """The fixed held-out clips the model card and the tests use."""
    rng = np.random.default_rng([EVAL_NAMESPACE, MOTION_SEED])
    return [motion_clip(rng) for _ in range(n)]


def all_texts() -> list[str]:
    """Every question and answer a clip can have (the tokenizer's corpus)."""
    texts = [a for answers in ANSWERS.values() for a in answers.values()]
    for lang, questions in QUESTIONS.items():
        for kind in SHAPES:
            texts += [q.format(shape=kind if lang == "en" else SHAPES_ZH[kind]) for q in questions]
    return texts


def engine_accuracy(engine, clips: list[Clip]) -> dict[str, float]:
    """Greedy exact match of ``engine``'s answers to ``clips`` (each sent as one video, as the node sends a
    camera's history), overall and per language."""
    from orin_vlm_node.engine import Request, SamplingParams, Turn, Video

    hits: dict[str, list[bool]] = {"overall": [], "en": [], "zh": []}
    for clip in clips:
        turn = Turn(clip.question, videos=(Video(clip.frames, clip.times),))
        *_, final = engine.generate(Request(turn, SamplingParams(temperature=0.0, max_new_tokens=16)))
        ok = final.text.strip() == clip.answer
        hits["overall"].append(ok)
        hits[clip.lang].append(ok)
    return {k: sum(v) / len(v) for k, v in hits.items() if v}
