"""The default model's format data (``support/scene_formats.py``) against the product's own rules: every
grounding answer it is trained on is one the node's grammar accepts token by token (so the grammar never
forces a tokenization the model has not seen) and maps back, through the node's pixel mapping, onto the true
box of the shape it names; the shape-list answers fit their schema."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from orin_vlm_node.engine import output_format
from orin_vlm_node.engine.grounding import detections, grounding_request
from orin_vlm_node.engine.output_format import Grammars
from orin_vlm_node.processing import Tokenizer, token_spans
from support import scene_formats

MODEL_DIR = Path(__file__).resolve().parent.parent / "orin_vlm_node" / "default_model"


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_pretrained(MODEL_DIR)


@pytest.fixture(scope="module")
def grammars(tokenizer) -> Grammars:
    return Grammars(tokenizer, tokenizer.vocab_size)


def _accepted(grammars: Grammars, fmt, ids: list[int], vocab_size: int) -> bool:
    """Every token of ``ids`` is allowed by the format's mask when its turn comes, and the whole is complete."""
    constraint = grammars.compile(fmt)
    for token in ids:
        if bool(constraint.masked(torch.zeros(vocab_size))[token].isinf()):
            return False
        constraint.take(token)
    return constraint.complete


def test_grounding_answers_are_what_the_node_asks_and_accepts(grammars, tokenizer):
    for task in scene_formats.held_out_grounding(40):
        text, fmt = grounding_request(task.labels, 1, task.points)
        assert task.sample.question == text
        ids = tokenizer.encode(task.sample.answer)
        assert _accepted(grammars, fmt, ids, tokenizer.vocab_size), task.sample.answer


def test_grounding_answers_map_back_onto_the_true_boxes(tokenizer):
    for task in scene_formats.held_out_grounding(100):
        ids = tokenizer.encode(task.sample.answer)
        spans = token_spans(tokenizer, ids)
        found = detections(task.sample.answer, [1.0] * len(ids), spans, [task.sample.image.shape[:2]])
        assert [d.label for d in found] == [label for label, _ in task.truth]
        score = scene_formats.score_grounding(task, [(d.label, d.box) for d in found])
        assert (score.found, score.invented) == (len(task.truth), 0), task.sample.answer
        if not task.points:
            assert all(scene_formats.iou(d.box, box) >= 0.95 for d, (_, box) in zip(found, task.truth, strict=True))


def test_labels_the_picture_does_not_show_are_asked_for_and_left_out():
    tasks = scene_formats.held_out_grounding(100)
    absent = sum(len(t.labels) - len(t.truth) for t in tasks)
    assert absent >= 50 and sum(not t.truth for t in tasks) >= 1
    assert sum(t.points for t in tasks) >= 10 and sum(not t.points for t in tasks) >= 50


def test_shape_lists_fit_their_schema(grammars, tokenizer):
    fmt = output_format("json_schema", scene_formats.SHAPE_LIST_SCHEMA)
    for sample in scene_formats.held_out_shape_lists(20):
        assert _accepted(grammars, fmt, tokenizer.encode(sample.answer), tokenizer.vocab_size), sample.answer
        shapes = json.loads(sample.answer)
        assert 1 <= len(shapes) <= 3 and len({s["shape"] for s in shapes}) == len(shapes)


def test_answers_list_the_shapes_in_the_order_of_their_kinds():
    order = scene_formats.SHAPES.index
    for task in scene_formats.held_out_grounding(100):
        kinds = [label.split()[-1] for label, _ in task.truth]
        assert kinds == sorted(kinds, key=order), task.sample.answer
    for sample in scene_formats.held_out_shape_lists(20):
        kinds = [s["shape"] for s in json.loads(sample.answer)]
        assert kinds == sorted(kinds, key=order), sample.answer
