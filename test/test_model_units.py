"""Pieces of the model against independent references: position-table resampling (F.interpolate),
patch embedding (F.conv3d), the interleaved M-RoPE layout, chunked prefill, and the no-host-sync decode step.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from orin_vlm_node.kvcache import ContiguousKVCache, KVCacheConfig
from orin_vlm_node.kvcache.reference import causal_attention
from orin_vlm_node.model import decode_positions, mrope_positions
from orin_vlm_node.model.rope import mrope_cos_sin, mrope_streams, text_inv_freq
from orin_vlm_node.model.vision import _patch_rows_cols
from orin_vlm_node.weights import load_model
from support.checkpoints import cached_tiny_checkpoint, image_prompt, random_pixel_values

CKPT = dict(layers=3, deepstack=(0, 1, 2), tie=False)


@pytest.fixture(scope="module")
def model():
    return load_model(cached_tiny_checkpoint(**CKPT))


@pytest.mark.parametrize("grid", [[1, 2, 2], [1, 4, 14], [1, 12, 6], [2, 8, 8], [1, 20, 2]])
def test_position_table_resampling_equals_f_interpolate(model, grid):
    """Bilinear align_corners=True resampling of the learned table, in merge-block order, repeated over t."""
    tower = model.visual
    t, h, w = grid
    side = tower.grid_side
    table = tower.pos_embed.weight.T.reshape(1, -1, side, side)  # (1, D, S, S)
    ref = F.interpolate(table, size=(h, w), mode="bilinear", align_corners=True)[0]  # (D, h, w)
    ref = ref.reshape(-1, h // 2, 2, w // 2, 2).permute(1, 3, 2, 4, 0).reshape(h * w, -1).repeat(t, 1)
    ours = tower._position_embedding([(t, h, w)], _patch_rows_cols([(t, h, w)], 2))
    torch.testing.assert_close(ours, ref, atol=1e-6, rtol=1e-6)


def test_patch_embed_linear_equals_conv3d(model):
    """Linear over 1536 == Conv3d(kernel=stride) in fp32; in bf16 they differ by rounding only."""
    pixel_values, _ = random_pixel_values([[1, 6, 8]])
    proj = model.visual.patch_embed.proj
    conv = F.conv3d(pixel_values.view(-1, 3, 2, 16, 16), proj.weight, proj.bias, stride=(2, 16, 16))
    torch.testing.assert_close(model.visual.patch_embed(pixel_values), conv.flatten(1), atol=1e-5, rtol=1e-5)
    w16, b16 = proj.weight.to(torch.bfloat16), proj.bias.to(torch.bfloat16)
    conv16 = F.conv3d(pixel_values.view(-1, 3, 2, 16, 16).to(torch.bfloat16), w16, b16, stride=(2, 16, 16))
    lin16 = F.linear(pixel_values.to(torch.bfloat16), w16.flatten(1), b16)
    # Measured on CPU: max |diff| 3e-5 .. 4e-3 with |values| ~2 (<= 1 bf16 ulp at that magnitude).
    assert (lin16.float() - conv16.flatten(1).float()).abs().max() <= 2**-6


def test_interleaved_mrope_layout_for_real_sections():
    streams = mrope_streams(128, (24, 20, 20))
    assert streams[1:60:3].unique().tolist() == [1] and len(streams[1:60:3]) == 20  # H: 1, 4, ..., 58
    assert streams[2:60:3].unique().tolist() == [2] and len(streams[2:60:3]) == 20  # W: 2, 5, ..., 59
    t_freqs = (streams == 0).nonzero().reshape(-1).tolist()
    assert t_freqs == list(range(0, 60, 3)) + [60, 61, 62, 63]  # T: every 3rd plus the tail


def test_text_only_mrope_is_plain_1d_rope():
    inv = text_inv_freq(64, 5e6)
    pos = torch.arange(5, 25)
    cos, sin = mrope_cos_sin(pos.expand(3, -1), inv, mrope_streams(64, (12, 10, 10)), torch.float32)
    angles = pos[:, None].float() * inv
    torch.testing.assert_close(cos, torch.cat([angles.cos()] * 2, -1), atol=0, rtol=0)
    torch.testing.assert_close(sin, torch.cat([angles.sin()] * 2, -1), atol=0, rtol=0)


def test_chunked_prefill_with_split_image_equals_one_shot(model):
    """Two prefill chunks, the image's rows split between them (VisionFeatures.rows), == one prefill."""
    grids = [[1, 6, 8], [1, 4, 4]]
    ids = image_prompt([[30, 31], [32], [33]], grids)
    pixel_values, grid_thw = random_pixel_values(grids)
    positions, _ = mrope_positions(ids, grid_thw, model.config.image_token_id, 2)
    vision = model.encode_images(pixel_values, grid_thw)
    assert vision.tokens_per_image == (12, 4)
    cfg = model.config.text
    cache = ContiguousKVCache(
        KVCacheConfig(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, max_context_tokens=64)
    )
    seq = cache.new_sequence()
    ids_t = torch.tensor(ids)
    split = 12  # inside the first image's pad run
    pads_before = int((ids_t[:split] == model.config.image_token_id).sum())
    first = model.forward(ids_t[:split], positions[:, :split], cache.step(seq, split), vision.rows(0, pads_before))
    second = model.forward(
        ids_t[split:], positions[:, split:], cache.step(seq, len(ids) - split), vision.rows(pads_before, len(vision)),
        logits_index=torch.tensor([len(ids) - split - 1]),
    )  # fmt: skip
    whole = model.forward(ids_t, positions, lambda i, q, k, v: causal_attention(q, k, v, 0), vision)
    torch.testing.assert_close(second, whole, atol=1e-5, rtol=1e-5)
    assert first.shape == (1, cfg.vocab_size)


class _SyncDetector(TorchDispatchMode):
    """Records aten ops that force a device->host sync or produce data-dependent shapes."""

    SYNC_OPS = ("_local_scalar_dense", "nonzero", "masked_select", "unique", "item", "equal", "is_nonzero")

    def __init__(self):
        super().__init__()
        self.bad: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__
        if any(name.split(".")[0] == op for op in self.SYNC_OPS):
            self.bad.append(name)
        return func(*args, **(kwargs or {}))


def test_decode_step_has_no_host_sync(model):
    """vision=None, L=1, static-buffer attention: no .item()/nonzero/etc. (capturable in a CUDA graph)."""
    cfg = model.config.text
    cache = ContiguousKVCache(
        KVCacheConfig(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, max_context_tokens=64)
    )
    seq = cache.new_sequence()
    prompt = torch.arange(10, 20)
    positions, next_position = mrope_positions(prompt, None, model.config.image_token_id, 2)
    logits = model.forward(prompt, positions, cache.step(seq, len(prompt)))
    buffers = cache.new_static_decode_buffers()
    cache.prepare_static_decode(seq, buffers)
    attn = cache.static_decode_attention(buffers)
    token = logits.argmax(-1)  # (1,) stays a tensor
    slot = torch.tensor([len(prompt)])
    delta = torch.tensor(next_position - len(prompt))
    with _SyncDetector() as detector:
        step_logits = model.forward(token, decode_positions(slot, delta), attn)
    assert detector.bad == []
    # Same logits as recomputing the whole sequence at once.
    ref = model.forward(
        torch.cat([prompt, token]), torch.arange(11).expand(3, -1), lambda i, q, k, v: causal_attention(q, k, v, 0)
    )
    torch.testing.assert_close(step_logits, ref, atol=1e-5, rtol=1e-5)
