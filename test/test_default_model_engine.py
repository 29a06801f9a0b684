"""Acceptance tests of the embedded default model, run through OUR engine on the CPU.

What they establish:
- the model answers held-out synthetic questions (never seen in training) with >= 90% exact match;
- it really looks at the picture: with another scene's image swapped in, colour and shape answers change;
- our engine and transformers (the reference implementation) give identical greedy answers;
- Chinese answers stream as whole characters.

The held-out set comes from ``support/synthetic_scenes.py`` (a seed namespace disjoint from training).
Engine answers are computed once per module and shared by the tests to keep the runtime small.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import numpy as np
import pytest
import torch

from orin_vlm_node.engine import Engine, Finished, Request, SamplingParams, TextDelta, Turn
from support import synthetic_scenes as scenes

REPO = Path(__file__).resolve().parent.parent
MODEL_DIR = REPO / "orin_vlm_node" / "default_model"

N_HELD_OUT = 200
MAX_NEW_TOKENS = 40
DONOR_SEED = 11  # image donors for the swap test: another held-out stream, never used in training

pytestmark = pytest.mark.skipif(
    not (MODEL_DIR / "model.safetensors").is_file(), reason="default model checkpoint not built"
)


def _request(question: str, image: np.ndarray | None) -> Request:
    images = (image,) if image is not None else ()
    return Request(
        turn=Turn(text=question, images=images),
        sampling=SamplingParams(temperature=0.0, max_new_tokens=MAX_NEW_TOKENS),
    )


def _run(engine: Engine, question: str, image: np.ndarray | None) -> tuple[list[TextDelta], Finished]:
    events = list(engine.generate(_request(question, image)))
    finished = events[-1]
    assert isinstance(finished, Finished), f"last event is {type(finished).__name__}, not Finished"
    assert finished.finish_reason == "stop", f"{question!r}: finished with {finished.finish_reason} {finished.error}"
    deltas = [e for e in events[:-1] if isinstance(e, TextDelta)]
    assert len(deltas) == len(events) - 1, "only TextDelta events may precede Finished"
    return deltas, finished


@pytest.fixture(scope="module")
def engine(default_model_engine) -> Engine:
    return default_model_engine


@pytest.fixture(scope="module")
def held_out() -> list[scenes.Sample]:
    return scenes.held_out_samples(N_HELD_OUT)


@pytest.fixture(scope="module")
def answers(engine: Engine, held_out: list[scenes.Sample]) -> list[str]:
    return [_run(engine, s.question, s.image)[1].text for s in held_out]


def test_held_out_exact_match_at_least_90_percent(held_out, answers):
    hits: dict[str, list[bool]] = defaultdict(list)
    for s, a in zip(held_out, answers, strict=True):
        ok = a.strip() == s.answer
        hits["overall"].append(ok)
        hits[f"{s.qtype}/{s.lang}"].append(ok)
    report = {k: f"{np.mean(v):.2f} (n={len(v)})" for k, v in sorted(hits.items())}
    misses = [(s.question, s.answer, a) for s, a in zip(held_out, answers, strict=True) if a.strip() != s.answer][:10]
    assert np.mean(hits["overall"]) >= 0.90, f"accuracy {report}; first misses {misses}"
    # Every question type and language must be represented, so the number above means what it says.
    assert {s.qtype for s in held_out} == set(scenes.QTYPE_WEIGHTS)
    assert {s.lang for s in held_out} == {"en", "zh"}


def _swap_pairs(held_out: list[scenes.Sample]) -> list[tuple[int, np.ndarray]]:
    """For held-out colour/shape questions: a donor image from another scene whose correct answer to the SAME
    question differs (same shape named, different colour; or a different shape), so a model that uses the image
    must change its answer."""
    donors = [d for d in scenes.make_samples(DONOR_SEED, 600) if d.qtype in ("color", "shape")]
    pairs = []
    for i, s in enumerate(held_out):
        if s.qtype not in ("color", "shape"):
            continue
        donor = next((d for d in donors if d.question == s.question and d.answer != s.answer), None)
        if donor is not None:
            pairs.append((i, donor.image))
    return pairs


def test_swapping_the_image_changes_colour_and_shape_answers(engine, held_out, answers):
    pairs = _swap_pairs(held_out)[:40]
    assert len(pairs) >= 30, "not enough colour/shape questions with a donor image"
    changed = [_run(engine, held_out[i].question, image)[1].text != answers[i] for i, image in pairs]
    assert np.mean(changed) >= 0.80, f"only {np.mean(changed):.2f} of {len(pairs)} answers changed"


def _hf_inputs(tokenizer, image_processor, question: str, image: np.ndarray | None) -> dict[str, torch.Tensor]:
    """Reference inputs built with transformers' own tokenizer, chat template and PIL image processor."""
    from PIL import Image

    content: list[dict] = [{"type": "image"}] if image is not None else []
    content.append({"type": "text", "text": question})
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False
    )
    extra: dict[str, torch.Tensor] = {}
    if image is not None:
        pix = image_processor([Image.fromarray(image)], return_tensors="pt")
        n = int(pix["image_grid_thw"][0].prod()) // 4
        text = text.replace("<|image_pad|>", "<|image_pad|>" * n)
        extra = {"pixel_values": pix["pixel_values"], "image_grid_thw": pix["image_grid_thw"]}
    ids = tokenizer(text, return_tensors="pt", add_special_tokens=False)["input_ids"]
    image_pad = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    return {
        "input_ids": ids,
        "attention_mask": torch.ones_like(ids),
        "mm_token_type_ids": (ids == image_pad).long(),
        **extra,
    }


def test_engine_matches_transformers_greedy(engine, held_out):
    from transformers import AutoTokenizer, Qwen3VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    tokenizer = AutoTokenizer.from_pretrained(str(MODEL_DIR))
    image_processor = Qwen2VLImageProcessorPil.from_pretrained(str(MODEL_DIR))
    model = Qwen3VLForConditionalGeneration.from_pretrained(str(MODEL_DIR), dtype=torch.float32).eval()
    eos = [tokenizer.convert_tokens_to_ids("<|im_end|>"), tokenizer.convert_tokens_to_ids("<|endoftext|>")]
    # Every question type and language, plus the text-only chat turns.
    picked = []
    seen: dict[tuple[str, str], int] = defaultdict(int)
    for i, s in enumerate(held_out):
        if seen[(s.qtype, s.lang)] < 2:
            seen[(s.qtype, s.lang)] += 1
            picked.append(i)
    assert len(picked) >= 20
    mismatches = []
    for i in picked:
        s = held_out[i]
        inputs = _hf_inputs(tokenizer, image_processor, s.question, s.image)
        with torch.no_grad():
            out = model.generate(
                **inputs, max_new_tokens=MAX_NEW_TOKENS, do_sample=False, eos_token_id=eos, pad_token_id=eos[1]
            )
        hf_ids = out[0, inputs["input_ids"].shape[1] :].tolist()
        hf_text = tokenizer.decode([t for t in hf_ids if t not in eos])
        _, fin = _run(engine, s.question, s.image)
        if list(fin.token_ids) != hf_ids or fin.text != hf_text:
            mismatches.append((s.question, hf_text, fin.text))
    assert not mismatches, f"engine and transformers disagree: {mismatches}"


def test_chinese_answers_stream_whole_characters(engine, held_out):
    zh = [s for s in held_out if s.lang == "zh"]
    picked = [next(s for s in zh if s.qtype == q) for q in ("describe", "chat", "color", "position")]
    for s in picked:
        deltas, fin = _run(engine, s.question, s.image)
        texts = [d.text for d in deltas]
        assert "".join(texts) == fin.text
        assert any(ord(c) > 0x2E7F for c in fin.text), f"expected a Chinese answer, got {fin.text!r}"
        for t in texts:
            assert "\ufffd" not in t, f"delta {t!r} splits a character: {texts}"
            assert t.encode("utf-8").decode("utf-8") == t
        # Tokens carry whole characters, so the stream is not merely re-assembled: each token is one delta.
        assert sum(len(d.token_ids) for d in deltas) <= len(fin.token_ids)
        assert all(len(d.token_ids) == 1 for d in deltas), f"a delta had to wait for more tokens: {deltas}"
