"""Our Qwen3-VL against transformers' on tiny random checkpoints: prefill logits and greedy decoding.

The reference is ``Qwen3VLForConditionalGeneration`` (eager attention, fp32) loaded from the same
``save_pretrained`` directory our loader reads. Both get IDENTICAL pixel_values/grid_thw (random
patches built with torch) so preprocessing is out of the picture. Configs vary head counts and GQA
ratios (MHA, GQA 2 and 4, MQA), head_dim 32/64/128, DeepStack index sets (incl. none and a late
vision block), tied and untied lm_head, and both config.json RoPE spellings.
"""

from __future__ import annotations

import functools

import pytest
import torch

from orin_vlm_node.kvcache import ContiguousKVCache, KVCacheConfig
from orin_vlm_node.kvcache.reference import causal_attention
from orin_vlm_node.model import decode_positions, mrope_positions
from orin_vlm_node.weights import load_model
from support.checkpoints import cached_tiny_checkpoint, image_prompt, mm_token_type_ids, random_pixel_values

CONFIGS = {
    "gqa2_hd64_tied": dict(num_heads=4, num_kv_heads=2, head_dim=64, hidden=64, layers=3, deepstack=(0, 1), tie=True),
    "mha_hd128_untied_legacy": dict(
        num_heads=2,
        num_kv_heads=2,
        head_dim=128,
        hidden=96,
        layers=2,
        deepstack=(2,),
        tie=False,
        vision_hidden=96,
        vision_heads=4,
        legacy_rope_keys=True,
        seed=1,
    ),
    "gqa4_hd64_ds3": dict(
        num_heads=8, num_kv_heads=2, head_dim=64, hidden=128, layers=4, deepstack=(0, 1, 2), tie=True, seed=2
    ),
    "mqa_hd32_nodeepstack_untied": dict(
        num_heads=4, num_kv_heads=1, head_dim=32, hidden=64, layers=2, deepstack=(), tie=False, seed=3
    ),
}

# Patch grids (t, h, w): images of different sizes and aspect ratios, smaller and larger than the
# 8x8 learned position table (so the bilinear resampling both down- and up-samples).
INPUTS = {
    "text_only": ([[30, 31, 32, 33, 34, 35, 36]], []),
    "one_image": ([[30, 31], [32, 33, 34]], [[1, 6, 10]]),
    "three_images": ([[30], [31, 32], [33], [34, 35, 36]], [[1, 4, 6], [1, 12, 4], [1, 10, 14]]),
}

# Rotate inputs over configs so every config and every input kind is decoded once.
GENERATE_CASES = [
    ("gqa2_hd64_tied", "three_images"),
    ("mha_hd128_untied_legacy", "one_image"),
    ("gqa4_hd64_ds3", "text_only"),
    ("mqa_hd32_nodeepstack_untied", "three_images"),
]

ATOL = 1e-4  # fp32; measured max |diff| is ~5e-6 (vision SDPA vs eager, GEMM shapes)


@functools.cache
def _models(name: str):
    from transformers import Qwen3VLForConditionalGeneration

    path = cached_tiny_checkpoint(**CONFIGS[name])
    hf = Qwen3VLForConditionalGeneration.from_pretrained(path, attn_implementation="eager", dtype=torch.float32)
    hf.eval()
    return hf, load_model(path, torch.float32, "cpu")


def _inputs(name: str):
    texts, grids = INPUTS[name]
    ids = image_prompt(texts, grids)
    if grids:
        pixel_values, grid_thw = random_pixel_values(grids, seed=len(ids))
    else:
        pixel_values, grid_thw = None, None
    return ids, pixel_values, grid_thw


def _hf_kwargs(ids, pixel_values, grid_thw) -> dict:
    kwargs = dict(input_ids=torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long))
    if pixel_values is not None:
        kwargs.update(pixel_values=pixel_values, image_grid_thw=grid_thw, mm_token_type_ids=mm_token_type_ids(ids))
    return kwargs


def _fresh_prefill_attention(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return causal_attention(q, k, v, 0)


@pytest.mark.parametrize("input_name", list(INPUTS))
@pytest.mark.parametrize("config_name", list(CONFIGS))
def test_prefill_logits_match_transformers(config_name: str, input_name: str):
    hf, ours = _models(config_name)
    ids, pixel_values, grid_thw = _inputs(input_name)
    with torch.no_grad():
        ref = hf(**_hf_kwargs(ids, pixel_values, grid_thw)).logits[0]  # (L, vocab)
    positions, _ = mrope_positions(ids, grid_thw, ours.config.image_token_id, ours.config.vision.spatial_merge_size)
    vision = ours.encode_images(pixel_values, grid_thw) if pixel_values is not None else None
    logits = ours.forward(
        torch.tensor(ids), positions, _fresh_prefill_attention, vision, logits_index=torch.arange(len(ids))
    )
    assert logits.shape == ref.shape
    err = (logits - ref).abs().max().item()
    assert err < ATOL, f"max |logit diff| {err:.3g}"
    assert torch.equal(logits.argmax(-1), ref.argmax(-1))


@pytest.mark.parametrize(("config_name", "input_name"), GENERATE_CASES)
def test_greedy_32_tokens_match_transformers_generate(config_name: str, input_name: str):
    hf, ours = _models(config_name)
    ids, pixel_values, grid_thw = _inputs(input_name)
    steps = 32
    hf.generation_config.eos_token_id = None  # never stop early: compare all 32 tokens
    with torch.no_grad():
        out = hf.generate(
            **_hf_kwargs(ids, pixel_values, grid_thw),
            max_new_tokens=steps,
            do_sample=False,
            top_k=None,
            top_p=None,
            temperature=None,
            output_logits=True,
            return_dict_in_generate=True,
        )
    ref_tokens = out.sequences[0, len(ids) :].tolist()
    assert len(ref_tokens) == steps

    cfg = ours.config
    cache = ContiguousKVCache(
        KVCacheConfig(
            cfg.text.num_hidden_layers, cfg.text.num_key_value_heads, cfg.text.head_dim, max_context_tokens=256
        )
    )
    seq = cache.new_sequence()
    positions, next_position = mrope_positions(ids, grid_thw, cfg.image_token_id, cfg.vision.spatial_merge_size)
    delta = next_position - len(ids)  # rope_delta: negative after an image
    vision = ours.encode_images(pixel_values, grid_thw) if pixel_values is not None else None
    logits = ours.forward(torch.tensor(ids), positions, cache.step(seq, len(ids)), vision)
    tokens = []
    for i in range(steps):
        err = (logits[0] - out.logits[i][0]).abs().max().item()
        assert err < ATOL, f"step {i}: max |logit diff| {err:.3g}"
        tokens.append(int(logits[0].argmax()))
        slot = len(ids) + i  # KV slot of the token being fed; its RoPE position is slot + delta
        logits = ours.forward(torch.tensor([tokens[-1]]), decode_positions(slot, delta), cache.step(seq, 1))
    cache.release(seq)
    assert tokens == ref_tokens
    assert len(set(tokens)) >= 3, "a constant generation would make the comparison weak"
