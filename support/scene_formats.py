"""Questions about the shape scenes whose answers come in a format: Qwen3-VL grounding and a JSON list.

The default model learns these besides the plain questions of :mod:`support.synthetic_scenes`, so a robot
developer can try constrained output and detections without a real checkpoint:

- **grounding**: the node's own detection prompt (``grounding_request``: the same text, the same JSON with Qwen's
  separators) naming shapes as ``"red circle"`` or ``"circle"``; the answer lists the asked shapes the picture
  shows, in :data:`SHAPES` order (see :func:`in_kind_order`), as ``bbox_2d`` (the tight box of the shape's pixels)
  or ``point_2d`` (the centre of its pixels) on Qwen3-VL's 0..1000 grid. Labels the picture does not show (another
  kind, or the right kind in another colour) are asked for too and must be left out;
- **shape list**: "List the shapes as JSON." answered in compact JSON ``[{"shape":"circle","color":"red"}]``,
  in :data:`SHAPES` order, which fits :data:`SHAPE_LIST_SCHEMA`.

Held-out sets come from their own seed namespaces, apart from training and from the plain questions' set.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np

from orin_vlm_node.engine.grounding import GRID, grounding_request

from .scene_drawing import COLORS, SHAPES, Shape, pair_layout, render_with_labels, scatter_layout, single_layout
from .synthetic_scenes import EVAL_NAMESPACE, Sample, Scene

SHAPE_LIST_SCHEMA = {
    "type": "array",
    "items": {
        "type": "object",
        "properties": {"shape": {"enum": list(SHAPES)}, "color": {"enum": list(COLORS)}},
        "required": ["shape", "color"],
        "additionalProperties": False,
    },
    "maxItems": 3,
}
SHAPE_LIST_QUESTIONS = {
    "en": ("List the shapes as JSON.", "List every shape and its color in JSON.", "Give the shapes as a JSON list."),
    "zh": ("用JSON列出图中的形状和颜色。", "以JSON格式列出所有形状。"),
}
GROUNDING_SEED = 13  # held-out grounding scenes: (EVAL_NAMESPACE, 13); shape lists: (EVAL_NAMESPACE, 17)
SHAPE_LIST_SEED = 17


@dataclass(frozen=True)
class GroundingTask:
    """A grounding sample and what a correct answer holds: ``truth`` (label, (x1, y1, x2, y2) pixel box) per
    object in answer order, the box's right and bottom edges exclusive."""

    sample: Sample
    scene: Scene
    labels: tuple[str, ...]
    points: bool
    truth: tuple[tuple[str, tuple[int, int, int, int]], ...]


def pixel_box(labels: np.ndarray, index: int) -> tuple[int, int, int, int]:
    """The tight box of shape ``index``'s pixels in a label map (right and bottom edges exclusive)."""
    ys, xs = np.nonzero(labels == index + 1)
    return int(xs.min()), int(ys.min()), int(xs.max()) + 1, int(ys.max()) + 1


def on_grid(values: tuple[float, ...], height: int, width: int) -> list[int]:
    """Pixel x, y, x, y, ... on Qwen3-VL's 0..GRID grid over a ``width`` x ``height`` picture."""
    return [round(v / (width if i % 2 == 0 else height) * GRID) for i, v in enumerate(values)]


def answer_boxes(text: str, height: int, width: int) -> list[tuple[str, tuple[float, float, float, float]]]:
    """(label, pixel box) per object of a grounding answer (a point as a box of no size); ValueError when the
    text is not a list of such objects."""
    try:
        objects = json.loads(text)
        found = []
        for obj in objects:
            coords = obj["point_2d"] * 2 if "point_2d" in obj else obj["bbox_2d"]
            x1, y1, x2, y2 = (c / GRID * (width if i % 2 == 0 else height) for i, c in enumerate(coords))
            found.append((str(obj["label"]), (x1, y1, x2, y2)))
        return found
    except (TypeError, KeyError, ValueError) as e:
        raise ValueError(f"not a grounding answer: {text[:200]!r}") from e


def _layout(rng: np.random.Generator):
    u = rng.random()
    if u < 0.3:
        return single_layout(rng)
    if u < 0.6:
        return pair_layout(rng, "x" if rng.random() < 0.5 else "y")
    return scatter_layout(rng, int(rng.integers(2, 4)))


def _asked_labels(rng: np.random.Generator, shapes, near_miss: float = 0.0) -> tuple[list[str], dict[str, int]]:
    """Labels to ask for: most shapes of the picture, by kind or by colour and kind, and up to two it does not
    show (a kind it lacks, or a kind it has in another colour); with probability ``near_miss`` one more that
    it does not show either: the colour of one of its shapes with a kind it lacks. Returns the labels and
    which shape each names."""
    named = {}
    for i, s in enumerate(shapes):
        if rng.random() < 0.8:
            named[f"{s.color} {s.kind}" if rng.random() < 0.7 else s.kind] = i
    absent = []
    for _ in range(int(rng.integers(0, 3))):
        kind = SHAPES[int(rng.integers(len(SHAPES)))]
        colors = [c for c in COLORS if all(s.kind != kind or s.color != c for s in shapes)]
        present = any(s.kind == kind for s in shapes)
        absent.append(f"{colors[int(rng.integers(len(colors)))]} {kind}" if present or rng.random() < 0.5 else kind)
    if near_miss and rng.random() < near_miss:
        lacking = [k for k in SHAPES if all(s.kind != k for s in shapes)]
        color = shapes[int(rng.integers(len(shapes)))].color
        absent.append(f"{color} {lacking[int(rng.integers(len(lacking)))]}")
    labels = list(dict.fromkeys([*named, *(a for a in absent if a not in named)]))
    if not labels:
        labels = [f"{shapes[0].color} {shapes[0].kind}"]
        named[labels[0]] = 0
    order = rng.permutation(len(labels))
    return [labels[int(i)] for i in order], named


def in_kind_order(shape: Shape) -> int:
    """The place of ``shape`` in an answer that lists several: by kind, in :data:`SHAPES` order. A picture's
    shapes are of different kinds, so the order is always defined; answering in the order the labels were
    asked, or left to right, makes the model search the question or compare positions at every object (and a
    pair one above the other has no left-to-right order), which a 4-layer decoder learned far more slowly."""
    return SHAPES.index(shape.kind)


def grounding_task(rng: np.random.Generator, near_miss: float = 0.0) -> GroundingTask:
    """One grounding sample: a scene, the labels asked for, and the answer in Qwen3-VL's format; ``near_miss``:
    training asks, that often, for a shape of the right colour and the wrong kind too (a model that matched
    labels by colour alone answered it; the held-out set keeps the plain mixture)."""
    h, w, shapes = _layout(rng)
    labels, named = _asked_labels(rng, shapes, near_miss)
    points = rng.random() < 0.25
    image, label_map = render_with_labels(rng, h, w, shapes)
    question, _ = grounding_request(labels, 1, points)
    objects, truth, subjects = [], [], []
    for label in sorted(named, key=lambda name: in_kind_order(shapes[named[name]])):
        box = pixel_box(label_map, named[label])
        if points:
            ys, xs = np.nonzero(label_map == named[label] + 1)
            objects.append({"point_2d": on_grid((float(xs.mean()) + 0.5, float(ys.mean()) + 0.5), h, w)})
        else:
            objects.append({"bbox_2d": on_grid(box, h, w)})
        objects[-1]["label"] = label
        truth.append((label, box))
        subjects.append(named[label])
    answer = json.dumps(objects)  # Qwen's separators: ", " and ": "
    starts = _object_starts(answer)
    scene = Scene(shapes, label_map, None, tuple(zip(starts, subjects, strict=True)))
    return GroundingTask(Sample(image, question, answer, "ground", "en"), scene, tuple(labels), points, tuple(truth))


def _object_starts(answer: str) -> list[int]:
    """The character where each object of a flat JSON list of objects starts (the first at 0: the list's
    opening bracket already belongs to it)."""
    return [0 if n == 0 else i for n, i in enumerate(i for i, ch in enumerate(answer) if ch == "{")]


def shape_list_sample(rng: np.random.Generator) -> tuple[Sample, Scene]:
    """ "List the shapes as JSON." about one to three shapes, answered in kind order in compact JSON."""
    lang = "en" if rng.random() < 0.5 else "zh"
    h, w, shapes = _layout(rng)
    order = sorted(range(len(shapes)), key=lambda i: in_kind_order(shapes[i]))
    image, label_map = render_with_labels(rng, h, w, shapes)
    questions = SHAPE_LIST_QUESTIONS[lang]
    question = questions[int(rng.integers(len(questions)))]
    answer = json.dumps([{"shape": shapes[i].kind, "color": shapes[i].color} for i in order], separators=(",", ":"))
    subjects = tuple(zip(_object_starts(answer), order, strict=True))
    return Sample(image, question, answer, "json", lang), Scene(shapes, label_map, None, subjects)


def held_out_grounding(n: int = 100) -> list[GroundingTask]:
    """The fixed held-out grounding set the model card, the benchmark and the tests use."""
    rng = np.random.default_rng([EVAL_NAMESPACE, GROUNDING_SEED])
    return [grounding_task(rng) for _ in range(n)]


def held_out_shape_lists(n: int = 50) -> list[Sample]:
    """The fixed held-out shape-list questions."""
    rng = np.random.default_rng([EVAL_NAMESPACE, SHAPE_LIST_SEED])
    return [shape_list_sample(rng)[0] for _ in range(n)]


def iou(a: tuple[float, ...], b: tuple[float, ...]) -> float:
    """Intersection over union of two (x1, y1, x2, y2) boxes."""
    iw = max(0.0, min(a[2], b[2]) - max(a[0], b[0]))
    ih = max(0.0, min(a[3], b[3]) - max(a[1], b[1]))
    inter = iw * ih
    union = (a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter
    return inter / union if union > 0 else 0.0


@dataclass(frozen=True)
class GroundingScore:
    """How one answer compares with the truth: objects found (same label, IoU >= 0.5, or for points the point
    inside the true box), and objects the answer holds that the picture does not show under that label."""

    found: int
    expected: int
    invented: int


def score_grounding(task: GroundingTask, answer: list[tuple[str, tuple[float, float, float, float]]]) -> GroundingScore:
    """Score ``answer`` ((label, pixel box) per object; a point is a box of no size) against ``task.truth``."""
    truth = dict(task.truth)
    found = invented = 0
    for label, box in answer:
        want = truth.pop(label, None)
        if want is None:
            invented += 1
        elif (box[0] == box[2] and want[0] <= box[0] <= want[2] and want[1] <= box[1] <= want[3]) or iou(
            box, want
        ) >= 0.5:
            found += 1
    return GroundingScore(found, len(task.truth), invented)


@dataclass(frozen=True)
class FormatAccuracy:
    """The default model's answers in a format, through an engine: grounding (objects found, scenes without
    an invented object, answers that did not parse) and shape lists (parsed JSON equal to the truth)."""

    objects_found: float
    scenes_clean: float
    unparsed: int
    shape_lists: float


def engine_detections(engine, task: GroundingTask):
    """The engine's detections for ``task``, asked exactly as the node asks (grounding prompt and format,
    greedy, token probabilities kept); ValueError when the answer does not parse."""
    from orin_vlm_node.engine import Request, SamplingParams, Turn
    from orin_vlm_node.engine.grounding import detections

    text, fmt = grounding_request(task.labels, 1, task.points)
    request = Request(
        Turn(text, (task.sample.image,)), SamplingParams(temperature=0.0, max_new_tokens=320), output=fmt,
        token_probs=True,
    )  # fmt: skip
    *_, final = engine.generate(request)
    if final.finish_reason != "stop":
        raise ValueError(f"the answer ended with {final.finish_reason}: {final.error or final.text[-80:]!r}")
    return detections(final.text, final.token_probs or (), final.token_spans or (), [task.sample.image.shape[:2]])


def engine_accuracy(engine, tasks: list[GroundingTask], lists: list[Sample]) -> FormatAccuracy:
    """Score ``engine`` on grounding ``tasks`` and shape-list questions, each held to its format."""
    from orin_vlm_node.engine import Request, SamplingParams, Turn, output_format

    found = expected = clean = unparsed = 0
    for task in tasks:
        expected += len(task.truth)
        try:
            found_objects = engine_detections(engine, task)
        except ValueError:
            unparsed += 1
            continue
        score = score_grounding(task, [(d.label, d.box) for d in found_objects])
        found += score.found
        clean += score.invented == 0
    fmt = output_format("json_schema", SHAPE_LIST_SCHEMA)
    listed = 0
    for s in lists:
        request = Request(Turn(s.question, (s.image,)), SamplingParams(temperature=0.0, max_new_tokens=160), output=fmt)
        *_, final = engine.generate(request)
        listed += final.output is not None and final.output["value"] == json.loads(s.answer)
    return FormatAccuracy(found / max(1, expected), clean / max(1, len(tasks)), unparsed, listed / max(1, len(lists)))
