"""The vision cache: a frame asked about again skips the vision tower, answers stay the same.

* Another question about the same image (a new session, prefix caching off) does not run the tower and
  gives the tokens an engine without the cache gives.
* A prefix-cache hit that ends inside an image's tokens takes the rest of the image's features from the
  cache.
* Two images of which one is cached: the features equal the tower's over both (the reference).
* The cache is an LRU bounded by ``vision_cache_images``; 0 keeps nothing; changing it empties it.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from orin_vlm_node.engine import Engine, EngineConfig, Request, SamplingParams, Turn
from orin_vlm_node.engine.images import VisionCache, encode_needed
from support.checkpoints import cached_tiny_checkpoint

torch.set_num_threads(1)

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=8)
CHECKPOINT = dict(layers=2, deepstack=(0, 1), tie=True, seed=21)
SYSTEM = "You are the robot's eyes. Answer in one sentence."


def _image(h: int, w: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)


def _engine(**overrides) -> Engine:
    path = cached_tiny_checkpoint(**CHECKPOINT)
    return Engine(EngineConfig(model_path=str(path), max_context_tokens=256, page_size=4, **overrides))


def _count_tower_calls(engine: Engine, monkeypatch) -> list[int]:
    """Images per call of the vision tower."""
    calls: list[int] = []
    encode = engine.parts.model.encode_images

    def counting(pixel_values, grid_thw):
        calls.append(int(grid_thw.shape[0]))
        return encode(pixel_values, grid_thw)

    monkeypatch.setattr(engine.parts.model, "encode_images", counting)
    return calls


def _final(engine: Engine, request: Request):
    final = list(engine.generate(request))[-1]
    assert final.finish_reason in ("stop", "length"), final.error
    return final


def test_same_frame_again_skips_the_tower_with_the_same_answer(monkeypatch):
    engine = _engine(prefix_caching=False)
    reference = _engine(prefix_caching=False, vision_cache_images=0)
    calls = _count_tower_calls(engine, monkeypatch)
    img = _image(96, 128, 1)
    for question in ("What is on the table?", "Is there a person?", "What colour is the floor?"):
        request = Request(Turn(question, (img,)), GREEDY, SYSTEM)
        assert _final(engine, request).token_ids == _final(reference, request).token_ids
    assert calls == [1], "the tower runs for the first question only"
    assert engine.describe()["vision_cache"] == {"images": 1, "capacity": 4, "hits": 2, "misses": 1}
    assert reference.describe()["vision_cache"]["images"] == 0


def test_prefix_hit_inside_an_image_takes_the_rest_from_the_cache(monkeypatch):
    engine = _engine()  # prefix caching on, page 4
    reference = _engine(prefix_caching=False, vision_cache_images=0)
    calls = _count_tower_calls(engine, monkeypatch)
    img = _image(96, 96, 5)
    _final(engine, Request(Turn("What is on the table?", (img,)), GREEDY, SYSTEM))
    second = Request(Turn("Is there a person?", (img,)), GREEDY, SYSTEM)
    ids, _ = engine.parts.turns.renderer.first_turn(
        SYSTEM, second.turn, [engine.parts.image_processor.num_image_tokens(96, 96)]
    )
    pad = engine.parts.model_config.image_token_id
    first_pad, last_pad = ids.index(pad), len(ids) - 1 - ids[::-1].index(pad)
    # The pool evicts the cached prompt's tail pages (least recently used first) until its chain ends
    # inside the image, as a busy pool would: take every free page and as many cached ones.
    cache, page = engine.parts.cache, 4
    pages = cache.stats()["blocks_free"] - last_pad // page  # all but the chain's pages up to the image's end
    others = []
    while pages > 0:  # sequences of at most a context each
        others.append(cache.new_sequence())
        take = min(pages, cache.config.max_context_tokens // page)
        cache.ensure_capacity(others[-1], take * page)
        pages -= take
    for other in others:
        cache.release(other)
    answer = _final(engine, second)
    assert first_pad < answer.metrics["prefix_hit_tokens"] <= last_pad, "the hit ends inside the image"
    assert calls == [1]
    assert answer.token_ids == _final(reference, second).token_ids


def test_partly_cached_images_equal_the_tower_over_all(monkeypatch):
    engine = _engine()
    a, b, c = _image(64, 96, 2), _image(96, 64, 3), _image(64, 64, 4)
    batch = engine.parts.image_processor.preprocess([a, b, c])
    reference = engine.parts.model.encode_images(batch.pixel_values, batch.grid_thw)
    cache = VisionCache(4)
    encode_needed(
        engine.parts.model, engine.parts.image_processor.preprocess([b]), 0, cache
    )  # b is cached, a and c are not
    calls = _count_tower_calls(engine, monkeypatch)
    skip = batch.num_tokens[0] // 2  # a prefix hit half-way through the first image
    got = encode_needed(engine.parts.model, batch, skip, cache)
    assert calls == [2], "a and c in one batch, b from the cache"
    want = reference.rows(skip, len(reference))
    torch.testing.assert_close(got.embeds, want.embeds, rtol=1e-5, atol=1e-5)
    for level, (g, w) in enumerate(zip(got.deepstack, want.deepstack, strict=True)):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5, msg=f"deepstack level {level}")
    assert len(cache) == 3
    assert encode_needed(engine.parts.model, batch, sum(batch.num_tokens), cache) is None  # all inside the hit
    assert calls == [2]


def test_cache_is_a_bounded_lru_and_a_new_capacity_empties_it():
    engine = _engine(vision_cache_images=2, prefix_caching=False)
    images = [_image(64, 64, seed) for seed in (10, 11, 12)]
    for img in images:
        _final(engine, Request(Turn("What is it?", (img,)), GREEDY))
    cache = engine.parts.vision_cache
    keys = [engine.parts.image_processor.preprocess([img]).digests[0] for img in images]
    assert len(cache) == 2 and cache.get(keys[0]) is None and cache.get(keys[2]) is not None
    engine.reconfigure(vision_cache_images=0)
    assert len(engine.parts.vision_cache) == 0
    _final(engine, Request(Turn("What is it?", (images[0],)), GREEDY))
    assert engine.describe()["vision_cache"] == {"images": 0, "capacity": 0, "hits": 0, "misses": 1}


@pytest.mark.parametrize("bad", [-1, 257])
def test_capacity_out_of_bounds_is_refused(bad):
    engine = _engine()
    with pytest.raises(ValueError, match="vision_cache_images"):
        engine.reconfigure(vision_cache_images=bad)
    assert engine.config.vision_cache_images == 4
