"""The static-buffer decode step against the ordinary one, after an image and across page boundaries.

Two sequences get the same image prompt; one decodes with ``DynamicDecodeStep`` (fresh tensors, the
cache's normal step), the other with ``StaticDecodeStep`` (fixed buffers only, what a CUDA graph
captures; eager on the CPU), each through ``prepare`` + ``run``. Logits must agree at every step, the
fixed buffers must never move, ``prepare`` must be what allocates a new block when the next slot starts a
page, and the static step must move to the next context bucket exactly when the sequence outgrows one.
"""

from __future__ import annotations

import pytest
import torch

from orin_vlm_node.engine.decode_step import (
    DynamicDecodeStep,
    StaticDecodeStep,
    build_decode_steps,
    context_buckets,
)
from orin_vlm_node.kvcache import ContiguousKVCache, KVCacheConfig
from orin_vlm_node.kvcache.paged import PagedKVCache
from orin_vlm_node.model import load_model, mrope_positions
from support.checkpoints import cached_tiny_checkpoint, image_prompt, random_pixel_values

torch.set_num_threads(1)

STEPS = 40


@pytest.fixture(scope="module")
def model():
    return load_model(cached_tiny_checkpoint(layers=2, tie=False, seed=9), torch.float32, "cpu")


@pytest.mark.parametrize("kind,page_size", [("paged", 1), ("paged", 4), ("paged", 16), ("contiguous", 16)])
def test_static_step_matches_dynamic_step(model, kind, page_size):
    cfg = model.config
    kv = KVCacheConfig(
        cfg.text.num_hidden_layers,
        cfg.text.num_key_value_heads,
        cfg.text.head_dim,
        page_size=page_size,
        num_blocks=2 * (-(-256 // page_size)) if kind == "paged" else 2 * 256 // page_size,
        max_context_tokens=256,
        prefix_caching=False,
    )
    cache = PagedKVCache(kv) if kind == "paged" else ContiguousKVCache(kv)
    grids = [[1, 6, 10]]
    ids = image_prompt([[30, 31], [32, 33, 34]], grids)
    pixels, grid = random_pixel_values(grids, seed=4)
    positions, next_position = mrope_positions(ids, grid, cfg.image_token_id, cfg.vision.spatial_merge_size)
    delta = next_position - len(ids)
    assert delta < 0  # after an image RoPE positions run behind KV slots
    vision = model.encode_images(pixels, grid)
    seq_dyn, seq_static = cache.new_sequence(), cache.new_sequence()
    logits_dyn = model.forward(torch.tensor(ids), positions, cache.step(seq_dyn, len(ids)), vision)
    logits_static = model.forward(torch.tensor(ids), positions, cache.step(seq_static, len(ids)), vision)
    buckets = (40, 64, 256)  # slots 30..69 are decoded: the step moves through all three buckets
    step = StaticDecodeStep(model, cache, torch.device("cpu"), use_graphs=True, buckets=buckets)
    dynamic = DynamicDecodeStep(model, cache)
    assert step.describe()["graphs"] == "off (cpu device)"
    buffers = [step.input_ids, step.positions, step.buffers.slot_mapping, step.buffers.kv_len, step.buffers.block_table]
    addresses = [t.data_ptr() for t in buffers]
    tokens = []
    for _ in range(STEPS):
        token = int(logits_dyn[0].argmax())
        tokens.append(token)
        assert int(logits_static[0].argmax()) == token
        slot = cache.length(seq_static)
        blocks_before = len(cache.block_table(seq_static))
        step.prepare(seq_static, token, delta)
        if kind == "paged":
            # A slot that starts a page got its block in prepare, before any device work ran.
            assert len(cache.block_table(seq_static)) == blocks_before + (1 if slot % page_size == 0 else 0)
        assert step.positions.tolist() == [[slot + delta]] * 3 and int(step.buffers.kv_len) == slot + 1
        assert step.width == min(w for w in buckets if w > slot)
        logits_static = step.run()
        dynamic.prepare(seq_dyn, token, delta)
        logits_dyn = dynamic.run()
        torch.testing.assert_close(logits_static, logits_dyn, rtol=0, atol=2e-5)
    assert [t.data_ptr() for t in buffers] == addresses, "the static buffers must never be reallocated"
    assert len(set(tokens)) >= 4
    assert cache.length(seq_static) == cache.length(seq_dyn) == len(ids) + STEPS


def test_context_buckets_double_up_to_the_limit_and_the_step_is_chosen_by_device(model):
    assert context_buckets(4096) == (256, 512, 1024, 2048, 4096)
    assert context_buckets(3000) == (256, 512, 1024, 2048, 3000)
    assert context_buckets(100) == (100,)
    cfg = model.config.text
    kv = KVCacheConfig(
        cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, num_blocks=8, max_context_tokens=64
    )
    cache = PagedKVCache(kv)
    one, several = build_decode_steps(model, cache, torch.device("cpu"), use_graphs=True)
    assert isinstance(one, DynamicDecodeStep) and one is several  # on the CPU one step serves every batch
    assert one.describe() == {"step": "dynamic"}
