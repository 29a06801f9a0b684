"""Multi-token steps on the CPU through torch's fused attention kernel (``kvcache/fused_prefill.py``).

Reference: the eager formula of ``kvcache/reference.py`` (transformers' eager attention), and torch's own
fused call as transformers' sdpa attention makes it, on K/V repeated per query head.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

from orin_vlm_node.kvcache.fused_prefill import (
    cpu_sdpa_maps_kv_heads,
    fused_causal_attention,
    step_attention,
    uses_fused_prefill,
)
from orin_vlm_node.kvcache.reference import causal_attention


def _qkv(L: int, total: int, nq: int, nkv: int, hd: int, dtype=torch.float32, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(L, nq, hd, generator=gen).to(dtype)
    k = torch.randn(total, nkv, hd, generator=gen).to(dtype)
    v = torch.randn(total, nkv, hd, generator=gen).to(dtype)
    return q, k, v


@pytest.mark.parametrize(("nq", "nkv"), [(4, 4), (4, 2), (8, 2), (6, 1)])
@pytest.mark.parametrize(("L", "q_start"), [(2, 0), (9, 0), (9, 5), (33, 40)])
def test_matches_the_reference_formula(nq, nkv, L, q_start):
    q, k, v = _qkv(L, q_start + L, nq, nkv, 16, seed=L + q_start + nq)
    out = fused_causal_attention(q, [k], [v], q_start)
    assert out.shape == (L, nq, 16) and out.dtype == q.dtype
    torch.testing.assert_close(out, causal_attention(q, k, v, q_start), rtol=2e-6, atol=2e-6)


def test_is_transformers_sdpa_call_on_repeated_heads():
    """The same numbers as SDPA over K/V repeated per query head (what a plain causal SDPA computes)."""
    q, k, v = _qkv(12, 12, 8, 2, 32, seed=3)
    out = fused_causal_attention(q, [k], [v], 0)

    def heads_first(t: torch.Tensor) -> torch.Tensor:  # (T, heads, hd) -> (1, heads, T, hd)
        return t.transpose(0, 1).unsqueeze(0)

    k_rep, v_rep = (heads_first(t.repeat_interleave(4, dim=1)) for t in (k, v))  # kv head j -> q heads 4j..4j+3
    ref = F.scaled_dot_product_attention(heads_first(q), k_rep, v_rep, is_causal=True, scale=32**-0.5)
    torch.testing.assert_close(out, ref[0].transpose(0, 1), rtol=1e-6, atol=1e-6)


def test_parts_are_the_concatenated_sequence_exactly():
    q, k, v = _qkv(7, 20, 4, 2, 8, seed=4)
    cuts = [0, 3, 4, 11, 20]
    k_parts = [k[a:b] for a, b in zip(cuts, cuts[1:], strict=False)]
    v_parts = [v[a:b] for a, b in zip(cuts, cuts[1:], strict=False)]
    assert torch.equal(fused_causal_attention(q, k_parts, v_parts, 13), fused_causal_attention(q, [k], [v], 13))


def test_slots_past_the_last_query_are_never_read():
    q, k, v = _qkv(5, 9, 4, 2, 8, seed=5)
    k_more = torch.cat([k, torch.full((4, 2, 8), float("nan"))])
    v_more = torch.cat([v, torch.full((4, 2, 8), float("nan"))])
    assert torch.equal(fused_causal_attention(q, [k_more], [v_more], 4), fused_causal_attention(q, [k], [v], 4))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_within_rounding_of_the_reference(dtype):
    q, k, v = _qkv(24, 30, 8, 2, 64, dtype=dtype, seed=6)
    out = fused_causal_attention(q, [k], [v], 6)
    assert out.dtype == dtype
    ref = causal_attention(q.float(), k.float(), v.float(), 6)
    torch.testing.assert_close(out.float(), ref, rtol=0, atol=3e-2)


@pytest.mark.skipif(
    not cpu_sdpa_maps_kv_heads(torch.__version__),
    reason="this torch repeats K/V on the CPU: the product keeps the reference",
)
def test_kv_heads_are_not_repeated():
    """The kernel maps each query head to its KV head itself: no op copies K/V per query head."""
    q, k, v = _qkv(16, 16, 8, 2, 32, seed=7)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fused_causal_attention(q, [k], [v], 0)
    names = {e.key for e in prof.key_averages()}
    assert "aten::_scaled_dot_product_flash_attention_for_cpu" in names, sorted(names)
    assert not names & {"aten::repeat_interleave", "aten::index_select", "aten::repeat", "aten::clone"}, names


@pytest.mark.parametrize(
    ("version", "fused"),
    [("2.5.1+cu124", False), ("2.8.0+cu128", False), ("2.9.1", True), ("2.13.0+cpu", True), ("3.0.0", True)],
)
def test_the_kernel_is_taken_only_from_the_torch_that_maps_kv_heads_on_the_cpu(version, fused):
    """Before 2.9 the CPU dispatch of a GQA call is the math kernel, which repeats K/V per query head."""
    assert cpu_sdpa_maps_kv_heads(version) is fused


def test_step_attention_takes_the_kernel_for_multi_token_steps_only():
    q, k, v = _qkv(6, 10, 4, 2, 8, seed=8)
    fused_here = cpu_sdpa_maps_kv_heads(torch.__version__)
    assert uses_fused_prefill(q) is fused_here and not uses_fused_prefill(q[:1])
    multi = fused_causal_attention(q, [k], [v], 4) if fused_here else causal_attention(q, k, v, 4)
    assert torch.equal(step_attention(q, [k], [v], 4), multi)
    assert torch.equal(step_attention(q[-1:], [k], [v], 9), causal_attention(q[-1:], k, v, 9))


def test_bad_shapes_are_refused():
    q, k, v = _qkv(4, 6, 4, 2, 8)
    with pytest.raises(ValueError, match="need 7 kv slots"):
        fused_causal_attention(q, [k], [v], 3)
    with pytest.raises(ValueError, match="do not fit"):
        fused_causal_attention(q, [k[:, :, :4]], [v[:, :, :4]], 0)
    with pytest.raises(ValueError, match="do not fit"):
        fused_causal_attention(torch.randn(4, 3, 8), [k], [v], 0)
