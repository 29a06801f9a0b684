"""Sessions and prefix caching.

* The token stream of a multi-turn session equals a fresh rendering of the whole conversation
  (``build_prompt_ids`` over all messages), checked with the scripted checkpoint whose answer text is
  known exactly.
* Turn 2 prefills only its own tokens, and its output equals transformers ``generate`` over the whole
  conversation (both turns' images, RoPE positions continuing after turn 1's image).
* A new session sharing the system prompt and image reuses cached blocks and answers exactly like
  an engine without prefix caching; a different image with the same size never hits past its start.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_engine_streaming import SCRIPT, make_scripted_checkpoint, scripted_engine

from orin_vlm_node.engine import Engine, EngineConfig, Request, SamplingParams, Turn
from orin_vlm_node.model import mrope_positions
from orin_vlm_node.processing import Tokenizer, build_prompt_ids
from support.checkpoints import cached_tiny_checkpoint

torch.set_num_threads(1)

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=12)
CHECKPOINT = dict(layers=2, deepstack=(0, 1), tie=True, seed=21)


def _image(h: int, w: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)


def _final(engine: Engine, request: Request):
    events = list(engine.generate(request))
    final = events[-1]
    assert final.finish_reason in ("stop", "length"), final.error
    return final


def test_session_stream_equals_fresh_rendering_of_whole_conversation(tmp_path_factory):
    engine, answer = scripted_engine(tmp_path_factory)
    img1, img2 = _image(64, 96, 1), _image(96, 64, 2)
    t1 = Turn("What is this?", (img1,))
    t2 = Turn("And this one? 这是什么？", (img2,))
    t3 = Turn("Thanks!")
    r1 = _final(engine, Request(t1, GREEDY, system_prompt="You are a robot.", session_id="s"))
    assert r1.text == SCRIPT[: len(r1.text)] and r1.finish_reason == "length"
    _final(engine, Request(t2, SamplingParams(temperature=0.0), session_id="s"))
    counts = [engine.parts.image_processor.num_image_tokens(*img.shape[:2]) for img in (img1, img2)]
    messages = [
        {"role": "system", "content": "You are a robot."},
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": t1.text}]},
        {"role": "assistant", "content": r1.text},
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": t2.text}]},
        {"role": "assistant", "content": SCRIPT},
    ]
    fresh = build_prompt_ids(
        engine.parts.tokenizer, engine.parts.turns.renderer.template, messages, counts, add_generation_prompt=False
    )
    # The fresh rendering ends with "<|im_end|>\n"; the session holds up to the answer's <|im_end|>.
    assert engine.session_token_ids("s") == fresh[:-1]
    # A third turn (text only) continues the same way.
    _final(engine, Request(t3, SamplingParams(temperature=0.0), session_id="s"))
    messages += [
        {"role": "user", "content": [{"type": "text", "text": t3.text}]},
        {"role": "assistant", "content": SCRIPT},
    ]
    fresh = build_prompt_ids(
        engine.parts.tokenizer, engine.parts.turns.renderer.template, messages, counts, add_generation_prompt=False
    )
    assert engine.session_token_ids("s") == fresh[:-1]
    engine.reset("s")
    assert engine.sessions() == [] and engine.parts.cache.stats()["blocks_used"] == 0


@pytest.mark.parametrize("chunk", [0, 6])
def test_turn_two_prefills_only_new_tokens_and_matches_transformers(chunk):
    """``chunk`` 6: both turns prefill in pieces of 6 tokens, turn 2's first piece right after the cached
    history, pieces ending inside the images' pads."""
    from transformers import Qwen3VLForConditionalGeneration

    path = cached_tiny_checkpoint(**CHECKPOINT)
    engine = Engine(EngineConfig(model_path=str(path), max_context_tokens=256, page_size=4, prefill_chunk_tokens=chunk))
    img1, img2 = _image(96, 128, 3), _image(64, 160, 4)
    t1, t2 = Turn("Describe this image.", (img1,)), Turn("Compare it with this one.", (img2,))
    r1 = _final(engine, Request(t1, GREEDY, session_id="s", system_prompt="Be brief."))
    history = engine.session_token_ids("s")  # turn 1 prompt + answer + <|im_end|>
    r2 = _final(engine, Request(t2, SamplingParams(temperature=0.0, max_new_tokens=24), session_id="s"))
    batch = engine.parts.image_processor.preprocess([img1, img2])
    delta, _ = engine.parts.turns.renderer.next_turn(
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": t1.text}]},
        ],
        r1.text,
        t2,
        batch.num_tokens[1:],
    )
    full = history + delta
    cached = len(history) - 2 if r1.token_ids[-1] not in engine.parts.tokenizer.eos_token_ids else len(history) - 1
    assert r2.metrics["prefill_tokens"] == len(full) - cached
    assert r2.metrics["prefix_hit_tokens"] == cached
    assert r2.metrics["prompt_tokens"] == len(full)

    hf = Qwen3VLForConditionalGeneration.from_pretrained(path, attn_implementation="eager", dtype=torch.float32).eval()
    mm = torch.tensor([[1 if t == engine.parts.model_config.image_token_id else 0 for t in full]], dtype=torch.int32)
    with torch.no_grad():
        out = hf.generate(
            input_ids=torch.tensor([full]),
            attention_mask=torch.ones(1, len(full), dtype=torch.long),
            pixel_values=batch.pixel_values,
            image_grid_thw=batch.grid_thw,
            mm_token_type_ids=mm,
            max_new_tokens=24,
            do_sample=False,
            top_k=None,
            top_p=None,
            temperature=None,
            eos_token_id=list(engine.parts.tokenizer.eos_token_ids),
            pad_token_id=0,
        )
    assert list(r2.token_ids) == out[0, len(full) :].tolist()


def test_prefix_cache_serves_new_session_with_same_system_prompt_and_image():
    path = cached_tiny_checkpoint(**CHECKPOINT)
    engine = Engine(EngineConfig(model_path=str(path), max_context_tokens=256, page_size=4))
    system = "You are the robot's eyes. Answer in one sentence."
    img, other = _image(96, 96, 5), _image(96, 96, 6)
    first = _final(engine, Request(Turn("What is on the table?", (img,)), GREEDY, system, session_id="a"))
    assert first.metrics["prefix_hit_tokens"] == 0
    second_req = Request(Turn("Is there a person?", (img,)), GREEDY, system, session_id="b")
    second = _final(engine, second_req)
    ids_b, _ = engine.parts.turns.renderer.first_turn(
        system, second_req.turn, [engine.parts.image_processor.num_image_tokens(96, 96)]
    )
    ids_a, _ = engine.parts.turns.renderer.first_turn(
        system, Turn("What is on the table?", (img,)), [engine.parts.image_processor.num_image_tokens(96, 96)]
    )
    shared = next(i for i, (a, b) in enumerate(zip(ids_a, ids_b, strict=False)) if a != b)
    first_pad = ids_b.index(engine.parts.model_config.image_token_id)
    last_pad = len(ids_b) - 1 - ids_b[::-1].index(engine.parts.model_config.image_token_id)
    hit = second.metrics["prefix_hit_tokens"]
    # Every token both prompts share, the image's included, comes from the cache: whole pages and the
    # shared head of the page where the questions part.
    assert last_pad < hit == shared, "the image tokens (same image) must come from the cache"
    assert second.metrics["prefill_tokens"] == len(ids_b) - hit

    # Same size, different pixels: the cache may serve the text before the image, never the image.
    third = _final(engine, Request(Turn("Is there a person?", (other,)), GREEDY, system, session_id="c"))
    assert third.metrics["prefix_hit_tokens"] <= first_pad

    # Reference: the same requests without prefix caching give the same tokens.
    engine.reconfigure(prefix_caching=False)
    assert _final(engine, Request(second_req.turn, GREEDY, system)).token_ids == second.token_ids
    engine.reset()
    assert engine.parts.cache.stats()["blocks_used"] == 0


def test_layout_change_drops_sessions_and_new_turn_starts_fresh():
    path = cached_tiny_checkpoint(**CHECKPOINT)
    engine = Engine(EngineConfig(model_path=str(path), max_context_tokens=256, page_size=4))
    _final(engine, Request(Turn("Hello there."), GREEDY, session_id="s"))
    assert engine.sessions() == ["s"] and engine.parts.cache.stats()["blocks_used"] > 0
    # Switching the decode path keeps the cache: the session continues with only its new tokens.
    engine.reconfigure(use_cuda_graph=False)
    assert engine.sessions() == ["s"]
    cached = len(engine.session_token_ids("s"))
    turn2 = _final(engine, Request(Turn("And now?"), GREEDY, session_id="s"))
    assert turn2.metrics["prefix_hit_tokens"] >= cached - 2
    engine.reconfigure(page_size=8)
    assert engine.sessions() == [] and engine.describe()["page_size"] == 8
    again = _final(engine, Request(Turn("Hello there."), GREEDY, session_id="s"))
    assert again.metrics["prefix_hit_tokens"] == 0


@pytest.mark.parametrize("chunk", [0, 2])
def test_a_turn_after_an_answer_cut_at_a_generated_image_pad_takes_it_as_text(tmp_path, chunk):
    """A model may generate the image-pad id; cut there, the answer's last token is fed first in the next
    turn, as text: the turn's own image still gets its rows and grid (``chunk`` 2: pieces end right
    after the generated pad and inside the image)."""
    pad = Tokenizer.from_pretrained(cached_tiny_checkpoint(layers=1, tie=False, deepstack=(0,), seed=11))
    path, answer = make_scripted_checkpoint(tmp_path / "scripted", "Sky:", tail=(pad.special.image_pad,))
    engine = Engine(EngineConfig(model_path=str(path), max_context_tokens=512, page_size=4, prefill_chunk_tokens=chunk))
    cut = SamplingParams(temperature=0.0, max_new_tokens=len(answer))
    first = _final(engine, Request(Turn("Hi."), cut, session_id="s"))
    assert first.token_ids[-1] == engine.parts.model_config.image_token_id and first.finish_reason == "length"
    session = engine.parts.session_store.get("s")
    turn = Turn("And this?", (_image(64, 96, 5),))
    prepared = engine.parts.turns.prepare(turn, None, session, 512)
    assert prepared.new_ids[0] == engine.parts.model_config.image_token_id and prepared.text_before == 2
    # Text positions do not depend on the id: the same turn with the generated pad replaced by another id.
    text = [answer[0], *prepared.new_ids[1:]]
    grids = prepared.images.grid_thw
    want, _ = mrope_positions(text, grids, engine.parts.model_config.image_token_id, 2, start=session.next_position)
    assert torch.equal(prepared.positions, want)
    assert prepared.extra_keys[0] is None and prepared.extra_keys.count(None) == len(text) - sum(
        prepared.images.num_tokens
    )
    second = _final(engine, Request(turn, cut, session_id="s"))  # was: "...more image-pad tokens than images"
    assert second.metrics["prompt_tokens"] == prepared.total_tokens
    third = _final(engine, Request(Turn("Thanks."), cut, session_id="s"))
    assert third.token_ids == first.token_ids
