"""Grounding as detections: Qwen3-VL's 0-1000 boxes mapped to the pixels of each original frame (plain
arithmetic), the answer held to the grounding JSON with the labels asked for, token probabilities that are
the model's own (softmax of teacher-forced logits, torch math), and an answer that does not parse refused."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch

from orin_vlm_node.engine import Engine, EngineConfig, Request, SamplingParams, Turn
from orin_vlm_node.engine.grounding import GRID, detections, grounding_request, parse_labels
from orin_vlm_node.processing import Tokenizer, token_spans
from support.checkpoints import cached_tiny_checkpoint

torch.set_num_threads(1)
SIZES = [(480, 640), (720, 1280)]  # (height, width) of two camera frames


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_pretrained(cached_tiny_checkpoint())


def answer_of(objects: list[dict]) -> str:
    return json.dumps(objects, separators=(", ", ": "))


def test_boxes_land_in_the_pixels_of_their_frame_clamped(tokenizer):
    text = answer_of([
        {"image": 1, "bbox_2d": [100, 250, 500, 1000], "label": "red cup"},
        {"image": 2, "bbox_2d": [0, 0, 1000, 999], "label": "person"},
    ])  # fmt: skip
    ids = tokenizer.encode(text)
    found = detections(text, [0.5] * len(ids), token_spans(tokenizer, ids), SIZES)
    assert [d.label for d in found] == ["red cup", "person"] and [d.image for d in found] == [0, 1]
    assert found[0].box == (100 / GRID * 640, 250 / GRID * 480, 500 / GRID * 640, 480.0)
    assert found[1].box == (0.0, 0.0, 1280.0, 999 / GRID * 720)
    assert all(d.score == pytest.approx(0.5) for d in found)  # the geometric mean of equal probabilities


def test_a_point_is_a_box_of_no_size(tokenizer):
    text = answer_of([{"point_2d": [500, 500], "label": "door"}])
    ids = tokenizer.encode(text)
    (found,) = detections(text, [1.0] * len(ids), token_spans(tokenizer, ids), SIZES[:1])
    assert found.point and found.box == (320.0, 240.0, 320.0, 240.0) and found.score == 1.0


@pytest.mark.parametrize(
    "text, message",
    [
        ('[{"bbox_2d": [1, 2', "is not valid JSON"),
        ('{"bbox_2d": [1, 2, 3, 4]}', "must be a JSON array, got dict"),
        ('[{"image": 3, "bbox_2d": [1, 2, 3, 4], "label": "x"}]', "names image 3 of 2"),
    ],
)
def test_an_answer_that_is_not_the_grounding_json_is_refused(tokenizer, text, message):
    with pytest.raises(ValueError, match=message):
        detections(text, [1.0], token_spans(tokenizer, tokenizer.encode(text)), SIZES)


def test_labels_are_read_from_a_list_and_a_request_needs_an_image():
    assert parse_labels(" red cup, person ,, red cup") == ("red cup", "person")
    with pytest.raises(ValueError, match="names what to find"):
        parse_labels(" , ")
    with pytest.raises(ValueError, match="needs an image"):
        grounding_request(("cup",), 0)


@pytest.mark.parametrize("images", [1, 2])
def test_the_engine_s_grounding_answer_is_detections_with_the_model_s_own_token_probabilities(images):
    """The tiny random model, held to at least one object (the product allows none: random weights would
    often answer []); each probability is the softmax of the teacher-forced logits at that token."""
    engine = Engine(EngineConfig(model_path=str(cached_tiny_checkpoint()), device="cpu"))
    frames = tuple(np.random.default_rng(i).integers(0, 256, (*SIZES[i][:1], 96, 3), dtype=np.uint8)
                   for i in range(images))  # fmt: skip
    sizes = [f.shape[:2] for f in frames]
    labels = ("red cup", "person")
    text, fmt = grounding_request(labels, images)
    schema = {**fmt.spec, "minItems": 1, "maxItems": 2}
    fmt = dataclasses.replace(fmt, spec=schema)
    sampling = SamplingParams(temperature=0.0, max_new_tokens=200)
    final = list(engine.generate(Request(Turn(text, frames), sampling, output=fmt, token_probs=True)))[-1]
    assert final.finish_reason == "stop" and final.output["complete"], final
    assert final.token_spans == token_spans(engine.parts.tokenizer, final.token_ids)
    assert final.token_spans[-1][1] == len(final.text)  # the spans cover the answer (its EOS writes nothing)
    found = detections(final.text, final.token_probs, final.token_spans, sizes)
    assert 1 <= len(found) <= 2 and all(d.label in labels for d in found)
    for d in found:
        height, width = sizes[d.image]
        x1, y1, x2, y2 = d.box
        assert 0 <= x1 <= width and 0 <= x2 <= width and 0 <= y1 <= height and 0 <= y2 <= height
        assert 0 < d.score <= 1
    assert ("image" in json.loads(final.text)[0]) == (images > 1)
    assert final.text.startswith('[{"image": ' if images > 1 else '[{"bbox_2d": [')  # Qwen's own separators


def test_token_probabilities_are_the_model_s_own_at_each_token():
    """Each probability is the softmax of the model's logits at that token, run teacher-forced (torch math)."""
    engine = Engine(EngineConfig(model_path=str(cached_tiny_checkpoint()), device="cpu"))
    sampling = SamplingParams(temperature=0.7, seed=3, max_new_tokens=24)
    final = list(engine.generate(Request(Turn("Say something."), sampling, token_probs=True)))[-1]
    generated = list(final.token_ids)
    ids = _prompt_ids(engine, "Say something.") + generated
    parts, n = engine.parts, len(ids)
    seq = parts.cache.new_sequence()
    rows = torch.arange(n - len(generated) - 1, n - 1)  # the logits each generated token was drawn from
    logits = parts.model.forward(
        torch.tensor(ids), torch.arange(n).expand(3, -1), parts.cache.step(seq, n), logits_index=rows
    )
    parts.cache.release(seq)
    want = torch.softmax(logits.float(), -1).gather(1, torch.tensor(generated).view(-1, 1)).view(-1)
    torch.testing.assert_close(torch.tensor(final.token_probs), want, rtol=1e-4, atol=1e-6)


def _prompt_ids(engine: Engine, text: str) -> list[int]:
    from orin_vlm_node.processing.prompt import build_prompt_ids

    messages = [{"role": "user", "content": [{"type": "text", "text": text}]}]
    return build_prompt_ids(engine.parts.tokenizer, engine.parts.turns.renderer.template, messages, [])
