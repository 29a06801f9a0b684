"""Acceptance tests of the default model's answers in a format, through OUR engine on the CPU.

What they establish, on held-out scenes (``support/scene_formats.py``, seed namespaces apart from training):
- asked to locate shapes exactly as the node asks (Qwen3-VL's grounding prompt, its JSON held by the grammar),
  every answer parses, it finds at least 90% of the objects (IoU >= 0.5 in the picture's pixels) and invents
  none on at least 90% of the scenes (the goal, also the benchmark's: ``bench/goals.py``, ``detection_found``
  and ``detection_clean``; measured: found 0.95, clean 0.92 of 100 scenes);
- the boxes come back in the pixels of the frame the camera sent, whatever its size: the same scenes at
  five times their size give the same boxes, five times larger, found as often; camera frames are read at the
  resolution the training pictures were;
- "List the shapes as JSON." held to its schema gives the shapes and colours in the order of their kinds.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import cv2
import pytest

from bench import goals as bench_goals
from orin_vlm_node.engine import Engine
from support import scene_formats

MODEL_DIR = Path(__file__).resolve().parent.parent / "orin_vlm_node" / "default_model"
N_GROUNDING = 100
N_LISTS = 50
GOALS = {goal.id: goal.target for goal in bench_goals.GOALS}
SHAPE_LISTS_FLOOR = 0.80  # no goal: a regression floor under the measured 0.88

pytestmark = pytest.mark.skipif(
    not (MODEL_DIR / "model.safetensors").is_file(), reason="default model checkpoint not built"
)


@pytest.fixture(scope="module")
def engine(default_model_engine) -> Engine:
    return default_model_engine


@pytest.fixture(scope="module")
def tasks() -> list[scene_formats.GroundingTask]:
    return scene_formats.held_out_grounding(N_GROUNDING)


@pytest.fixture(scope="module")
def accuracy(engine, tasks) -> scene_formats.FormatAccuracy:
    return scene_formats.engine_accuracy(engine, tasks, scene_formats.held_out_shape_lists(N_LISTS))


def test_grounding_finds_the_objects_and_invents_none(accuracy):
    assert accuracy.unparsed == 0, accuracy
    assert accuracy.objects_found >= GOALS["detection_found"], accuracy
    assert accuracy.scenes_clean >= GOALS["detection_clean"], accuracy


def test_boxes_are_in_the_pixels_of_the_frame_the_camera_sent(engine, tasks):
    """The same scenes sent five times larger: the boxes come back five times larger, as right as before. Both
    frames are resized to the same token grid from different pixels, so the answers may differ a little (an
    object more or less, a box a few pixels off); boxes mapped through the wrong size would land far off."""
    boxes = [t for t in tasks[:12] if not t.points and t.truth]
    found = {"small": 0, "big": 0}
    shared = agreeing = expected = 0
    for task in boxes:
        small = scene_formats.engine_detections(engine, task)
        h, w = task.sample.image.shape[:2]
        big_image = cv2.resize(task.sample.image, (w * 5, h * 5), interpolation=cv2.INTER_NEAREST)
        big = scene_formats.engine_detections(engine, _with_image(task, big_image))
        for b in big:
            assert 0 <= b.box[0] <= b.box[2] <= w * 5 and 0 <= b.box[1] <= b.box[3] <= h * 5, b
        small_boxes = {d.label: d.box for d in small}
        for b in big:
            if b.label in small_boxes:
                shared += 1
                agreeing += scene_formats.iou(tuple(5 * v for v in small_boxes[b.label]), b.box) >= 0.5
        truth = tuple((label, tuple(5 * v for v in box)) for label, box in task.truth)
        big_task = scene_formats.GroundingTask(task.sample, task.scene, task.labels, False, truth)
        found["big"] += scene_formats.score_grounding(big_task, [(d.label, d.box) for d in big]).found
        found["small"] += scene_formats.score_grounding(task, [(d.label, d.box) for d in small]).found
        expected += len(task.truth)
    assert len(boxes) >= 6 and shared >= 0.8 * expected and agreeing >= 0.8 * shared, (shared, agreeing, expected)
    assert found["big"] >= found["small"] - 2 and found["big"] >= 0.6 * expected, (found, expected)


def test_shape_lists_held_to_their_schema_name_the_shapes_in_kind_order(accuracy):
    assert accuracy.shape_lists >= SHAPE_LISTS_FLOOR, accuracy


def test_camera_frames_are_read_at_the_resolution_the_training_pictures_were():
    """Training pictures (64-160 px a side) are enlarged to at least 36 tokens, which rounds up to 36-48; a
    camera frame is shrunk to at most the maximum, rounding down: with a maximum of 36 a 720p frame read 32
    tokens, a grid the model never saw, and found 7 of 15 objects where the scenes at their own size found 10."""
    from orin_vlm_node.processing import ImageProcessor

    processor = ImageProcessor.from_pretrained(MODEL_DIR)
    trained = {processor.num_image_tokens(h, w) for h in range(64, 161, 8) for w in range(64, 161, 8)}
    for h, w in ((480, 640), (720, 1280), (1080, 1920), (1280, 720), (400, 400)):
        assert min(trained) <= processor.num_image_tokens(h, w) <= max(trained), (h, w, sorted(trained))


def _with_image(task: scene_formats.GroundingTask, image) -> scene_formats.GroundingTask:
    return replace(task, sample=replace(task.sample, image=image))
