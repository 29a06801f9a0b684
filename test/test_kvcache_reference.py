"""The torch reference attention against transformers' eager attention (the numerics we must match)."""

from __future__ import annotations

import pytest
import torch
from transformers.models.qwen3_vl.modeling_qwen3_vl import eager_attention_forward

from orin_vlm_node.kvcache.reference import causal_attention, masked_decode_attention


class _Module(torch.nn.Module):
    def __init__(self, groups: int) -> None:
        super().__init__()
        self.num_key_value_groups = groups


def _hf_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_start: int) -> torch.Tensor:
    """transformers eager attention with the additive finfo.min causal mask it builds for eager."""
    L, nq, hd = q.shape
    T, nkv, _ = k.shape
    allowed = torch.arange(T).unsqueeze(0) <= torch.arange(q_start, q_start + L).unsqueeze(1)
    mask = torch.zeros((1, 1, L, T), dtype=q.dtype).masked_fill(~allowed, torch.finfo(q.dtype).min)
    out, _ = eager_attention_forward(
        _Module(nq // nkv),
        q.transpose(0, 1).unsqueeze(0),
        k.transpose(0, 1).unsqueeze(0),
        v.transpose(0, 1).unsqueeze(0),
        mask,
        scaling=hd**-0.5,
    )
    return out[0]  # (L, nq, hd)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("nkv,group,hd,L,q_start", [(1, 1, 8, 5, 0), (2, 4, 16, 7, 9), (4, 2, 32, 1, 30)])
def test_causal_attention_matches_transformers_eager(dtype, nkv, group, hd, L, q_start):
    T = q_start + L
    q = torch.randn(L, nkv * group, hd).to(dtype)
    k = torch.randn(T, nkv, hd).to(dtype)
    v = torch.randn(T, nkv, hd).to(dtype)
    ours = causal_attention(q, k, v, q_start)
    assert ours.dtype == dtype and ours.shape == (L, nkv * group, hd)
    # Same formula and dtypes; the grouped product (a KV head's query heads as rows of one matrix) may sum
    # a dot product in another order than transformers' per-head product: float rounding, nothing more.
    tol = {torch.float32: 1e-6, torch.bfloat16: 1e-2}[dtype]
    torch.testing.assert_close(ours, _hf_causal(q, k, v, q_start), rtol=tol, atol=tol)


def test_causal_attention_ignores_slots_past_the_last_query():
    q = torch.randn(3, 4, 8)
    k, v = torch.randn(10, 2, 8), torch.randn(10, 2, 8)
    k2, v2 = k.clone(), v.clone()
    k2[6:], v2[6:] = float("nan"), float("nan")  # slots 6.. are beyond query slots 3..5
    torch.testing.assert_close(causal_attention(q, k, v, 3), causal_attention(q, k2[:6], v2[:6], 3))


def test_masked_decode_attention_equals_causal_for_the_last_slot_of_each_row():
    q = torch.randn(3, 6, 16)
    k, v = torch.randn(3, 40, 3, 16), torch.randn(3, 40, 3, 16)
    kv_len = torch.tensor([23, 40, 1], dtype=torch.int32)
    out = masked_decode_attention(q, k, v, kv_len)
    for b, n in enumerate(kv_len.tolist()):
        expected = causal_attention(q[b : b + 1], k[b, :n], v[b, :n], n - 1)
        torch.testing.assert_close(out[b : b + 1], expected, rtol=1e-6, atol=1e-6)


def test_masked_decode_attention_padding_row_is_finite_and_leaves_the_others_alone():
    q = torch.randn(2, 4, 8)
    k, v = torch.randn(2, 12, 2, 8), torch.randn(2, 12, 2, 8)
    out = masked_decode_attention(q, k, v, torch.tensor([5, 0], dtype=torch.int32))
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out[:1], causal_attention(q[:1], k[0, :5], v[0, :5], 4), rtol=1e-6, atol=1e-6)


def test_reference_rejects_bad_shapes():
    with pytest.raises(ValueError, match="multiple"):
        causal_attention(torch.randn(2, 3, 8), torch.randn(2, 2, 8), torch.randn(2, 2, 8), 0)
    with pytest.raises(ValueError, match="kv slots"):
        causal_attention(torch.randn(2, 4, 8), torch.randn(2, 2, 8), torch.randn(2, 2, 8), 1)
    kv_len = torch.tensor([3])
    with pytest.raises(ValueError, match="B, T, nkv, hd"):
        masked_decode_attention(torch.randn(2, 4, 8), torch.randn(12, 2, 8), torch.randn(12, 2, 8), kv_len)
    with pytest.raises(ValueError, match="multiple"):
        masked_decode_attention(torch.randn(1, 3, 8), torch.randn(1, 5, 2, 8), torch.randn(1, 5, 2, 8), kv_len)
