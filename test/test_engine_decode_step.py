"""The static-buffer decode step against the ordinary one, after an image, across page boundaries, and for
batches that grow and shrink through the batch buckets.

Sequences get prompts (one with an image); some decode with ``DynamicDecodeStep`` (fresh tensors, the
cache's normal step), their twins with ``StaticDecodeStep`` (fixed buffers only, what a CUDA graph
captures; eager on the CPU), each through ``prepare`` + ``run``. Logits must agree at every step, the
fixed buffers must never move, ``prepare`` must be what allocates a new block when the next slot starts a
page, the static step must move to the next context bucket exactly when a sequence outgrows one, and a
padding row (a step of 3 sequences replays the graph of 4) must store nothing.
"""

from __future__ import annotations

import pytest
import torch

from orin_vlm_node.engine.decode_step import (
    DynamicDecodeStep,
    StaticDecodeStep,
    batch_buckets,
    build_decode_step,
    context_buckets,
)
from orin_vlm_node.kvcache import ContiguousKVCache, KVCacheConfig
from orin_vlm_node.kvcache.paged import PagedKVCache
from orin_vlm_node.model import mrope_positions
from orin_vlm_node.weights import load_model
from support.checkpoints import cached_tiny_checkpoint, image_prompt, random_pixel_values

torch.set_num_threads(1)

STEPS = 40


@pytest.fixture(scope="module")
def model():
    return load_model(cached_tiny_checkpoint(layers=2, tie=False, seed=9), torch.float32, "cpu")


def _cache(model, kind: str, page_size: int, sequences: int, max_context: int = 256):
    cfg = model.config.text
    units = -(-max_context // page_size) if kind == "paged" else max_context // page_size  # per sequence
    kv = KVCacheConfig(
        cfg.num_hidden_layers,
        cfg.num_key_value_heads,
        cfg.head_dim,
        page_size=page_size,
        kv_pool_blocks=sequences * units,
        max_context_tokens=max_context,
        prefix_caching=False,
    )
    return PagedKVCache(kv) if kind == "paged" else ContiguousKVCache(kv)


@pytest.mark.parametrize("kind,page_size", [("paged", 1), ("paged", 4), ("paged", 16), ("contiguous", 16)])
def test_static_step_matches_dynamic_step(model, kind, page_size):
    cfg = model.config
    cache = _cache(model, kind, page_size, sequences=2)
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
    step = StaticDecodeStep(model, cache, torch.device("cpu"), use_cuda_graph=True, buckets=buckets)
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
        assert step.positions.tolist() == [slot + delta] and step.buffers.kv_len.tolist() == [slot + 1]
        assert step.width == min(w for w in buckets if w > slot)
        logits_static = step.run()
        dynamic.prepare(seq_dyn, token, delta)
        logits_dyn = dynamic.run()
        torch.testing.assert_close(logits_static, logits_dyn, rtol=0, atol=2e-5)
    assert [t.data_ptr() for t in buffers] == addresses, "the static buffers must never be reallocated"
    assert len(set(tokens)) >= 4
    assert cache.length(seq_static) == cache.length(seq_dyn) == len(ids) + STEPS


# Which of four sequences decode at each step: batches of 1..4 through the buckets 1, 2, 4 (3 pads one row),
# members joining and leaving between steps, in changing order.
SCHEDULE = [[0], [0, 1], [0, 1, 2], [2, 0, 1, 3], [3, 1, 2], [1], [3, 0], [0, 1, 2, 3], [2, 3, 0]] * 3


@pytest.mark.parametrize("kind,page_size", [("paged", 4), ("paged", 16), ("contiguous", 16)])
def test_batched_static_step_matches_each_sequence_alone(model, kind, page_size):
    """Four sequences with prompts of different lengths (one with an image) decode in batches of 1..4 with
    the static step; twins of each decode alone with the dynamic step: same logits row for row."""
    cfg = model.config
    cache = _cache(model, kind, page_size, sequences=8)
    grids = [[1, 4, 6]]
    pixels, grid = random_pixel_values(grids, seed=2)
    vision = model.encode_images(pixels, grid)
    prompts = [list(range(40, 45)), image_prompt([[30, 31], [32]], grids), list(range(50, 83)), [60, 61]]
    static_seqs, dyn_seqs, deltas, pending = [], [], [], []
    for ids in prompts:
        images = (grid, vision) if cfg.image_token_id in ids else (None, None)
        positions, next_position = mrope_positions(ids, images[0], cfg.image_token_id, cfg.vision.spatial_merge_size)
        deltas.append(next_position - len(ids))
        pair = []
        for _ in range(2):
            seq = cache.new_sequence()
            logits = model.forward(torch.tensor(ids), positions, cache.step(seq, len(ids)), images[1])
            pair.append(seq)
        static_seqs.append(pair[0])
        dyn_seqs.append(pair[1])
        pending.append(int(logits[0].argmax()))
    step = StaticDecodeStep(model, cache, torch.device("cpu"), use_cuda_graph=True, max_batch=4, buckets=(40, 256))
    assert step.batch_buckets == (1, 2, 4)
    dynamic = DynamicDecodeStep(model, cache)
    storage = cache.kv_storage
    for members in SCHEDULE:
        for i in members:
            step.prepare(static_seqs[i], pending[i], deltas[i])
        assert step.width == min(w for w in step.buckets if w >= max(cache.length(static_seqs[i]) for i in members))
        before = storage.clone()
        batch_logits = step.run()
        assert batch_logits.shape == (len(members), cfg.text.vocab_size)
        written = (storage != before).any(dim=-1).any(dim=-1)  # (2, layers, units, rows-per-unit)
        # Exactly the staged tokens' slots changed (K and V of every layer): a padding row stored nothing.
        assert int(written.sum()) == 2 * cfg.text.num_hidden_layers * len(members)
        for row, i in enumerate(members):
            dynamic.prepare(dyn_seqs[i], pending[i], deltas[i])
            alone = dynamic.run()
            torch.testing.assert_close(batch_logits[row : row + 1], alone, rtol=0, atol=3e-5)
            pending[i] = int(alone[0].argmax())
    for s, d in zip(static_seqs, dyn_seqs, strict=True):
        assert cache.length(s) == cache.length(d)
    assert step.describe()["batch_buckets"] == [1, 2, 4]


def test_a_full_static_step_refuses_another_sequence_and_run_needs_one(model):
    cache = _cache(model, "paged", 16, sequences=3)
    seqs = [cache.new_sequence() for _ in range(3)]
    for seq in seqs:
        cache.step(seq, 3)
    step = StaticDecodeStep(model, cache, torch.device("cpu"), use_cuda_graph=False, max_batch=2)
    with pytest.raises(RuntimeError, match="without prepare"):
        step.run()
    step.prepare(seqs[0], 5, 0)
    step.prepare(seqs[1], 5, 0)
    with pytest.raises(RuntimeError, match="at most 2"):
        step.prepare(seqs[2], 5, 0)
    assert cache.length(seqs[2]) == 3  # refused before any change
    assert step.run().shape[0] == 2


def test_buckets_double_up_to_the_limit_and_the_step_is_chosen_by_device(model):
    assert context_buckets(4096) == (256, 512, 1024, 2048, 4096)
    assert context_buckets(3000) == (256, 512, 1024, 2048, 3000)
    assert context_buckets(100) == (100,)
    assert batch_buckets(16) == (1, 2, 4, 8, 16) and batch_buckets(6) == (1, 2, 4, 6) and batch_buckets(1) == (1,)
    cache = _cache(model, "paged", 16, sequences=1, max_context=64)
    step = build_decode_step(model, cache, torch.device("cpu"), use_cuda_graph=True, max_batch=4)
    assert isinstance(step, DynamicDecodeStep)  # on the CPU one dynamic step serves every batch
    assert step.describe() == {"step": "dynamic", "overlap": False}
