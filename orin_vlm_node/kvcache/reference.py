"""Torch attention: the ground truth every KV backend and kernel is compared against, and the torch path of
single-query (decode) steps; multi-token steps on the CPU take torch's fused kernel (:mod:`.fused_prefill`).

It follows the transformers "eager" attention of Qwen3 (scores in the input dtype, the additive causal
mask, softmax in fp32, cast back to the input dtype before the product with V) so that a model running
through our caches can be compared with a transformers checkpoint token for token.

More in docs/modules.md, ``orin_vlm_node/kvcache/reference.py``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_start: int) -> torch.Tensor:
    """Causal GQA attention of ``L`` queries over ``T`` cached slots.

    ``q``: (L, nq, hd); ``k``, ``v``: (T, nkv, hd) with ``T >= q_start + L``; query ``i`` sits at slot
    ``q_start + i`` and attends to slots ``0 .. q_start + i`` (slots beyond are masked, so ``k``/``v`` may
    hold stale rows past ``q_start + L``). kv head ``j`` serves q heads ``j*g .. j*g+g-1``.
    Returns (L, nq, hd) in q's dtype.
    """
    if k.dim() != 3 or v.dim() != 3:
        raise ValueError(f"expected 3-D k/v, got {tuple(k.shape)}, {tuple(v.shape)}")
    return causal_attention_parts(q, [k], [v], q_start)


def causal_attention_parts(
    q: torch.Tensor, k_parts: Sequence[torch.Tensor], v_parts: Sequence[torch.Tensor], q_start: int
) -> torch.Tensor:
    """:func:`causal_attention` over keys/values given as consecutive parts, each (T_i, nkv, hd), read in place."""
    total = _check(q, k_parts, v_parts)
    L = q.shape[0]
    if q_start < 0 or q_start + L > total:
        raise ValueError(f"queries at slots {q_start}..{q_start + L - 1} need {q_start + L} kv slots, got {total}")
    mask = None
    if L > 1 or q_start + L < total:  # a single query at the last slot sees every slot: nothing to mask
        q_slots = torch.arange(q_start, q_start + L, device=q.device).unsqueeze(1)  # (L, 1)
        k_slots = torch.arange(total, device=q.device).unsqueeze(0)  # (1, T)
        mask = torch.zeros((L, total), dtype=q.dtype, device=q.device)
        mask.masked_fill_(k_slots > q_slots, torch.finfo(q.dtype).min)
    return _grouped_attention(q, k_parts, v_parts, mask)


def masked_decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_len: torch.Tensor) -> torch.Tensor:
    """One decode query per sequence over a fixed-size KV window whose valid length lives in a tensor.

    ``q``: (B, nq, hd); ``k``, ``v``: (B, T, nkv, hd) where only slots ``0 .. kv_len[b]-1`` of row ``b``
    are valid; ``kv_len``: (B,) integer tensor on q's device. The shapes never depend on the lengths and
    nothing is read back to the host, so a CUDA graph can capture this (the static decode path).
    Numerically the same formula as :func:`causal_attention` for the query at slot ``kv_len[b] - 1``; a
    row with ``kv_len`` 0 averages its window (finite, meaningless: a padding row).
    """
    if q.dim() != 3 or k.dim() != 4 or k.shape != v.shape or k.shape[0] != q.shape[0] or k.shape[3] != q.shape[2]:
        raise ValueError(f"decode attention takes q (B, nq, hd) and k/v (B, T, nkv, hd), got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")  # fmt: skip
    batch, nq, hd = q.shape
    total, nkv = k.shape[1], k.shape[2]
    if nq % nkv:
        raise ValueError(f"num q heads {nq} is not a multiple of num kv heads {nkv}")
    qg = q.reshape(batch, nkv, nq // nkv, hd)  # query heads of kv head j: rows of its (group, hd) matrix
    s = torch.matmul(qg, _as(k, q.dtype).permute(0, 2, 3, 1)) * (hd**-0.5)  # (B, nkv, group, T)
    invalid = torch.arange(total, device=q.device) >= kv_len.reshape(batch, 1).to(q.device)  # (B, T)
    mask = torch.zeros((batch, 1, 1, total), dtype=q.dtype, device=q.device)
    mask.masked_fill_(invalid.view(batch, 1, 1, total), torch.finfo(q.dtype).min)
    weights = _as(torch.softmax(s + mask, dim=-1, dtype=torch.float32), q.dtype)
    out = torch.matmul(weights, _as(v, q.dtype).transpose(1, 2))  # (B, nkv, group, hd)
    return out.reshape(batch, nq, hd)


def _check(q: torch.Tensor, k_parts: Sequence[torch.Tensor], v_parts: Sequence[torch.Tensor]) -> int:
    """Validate shapes; the total number of key slots."""
    if q.dim() != 3:
        raise ValueError(f"expected 3-D q (L, nq, hd), got {tuple(q.shape)}")
    if not k_parts or len(k_parts) != len(v_parts):
        raise ValueError(f"need matching, non-empty K/V parts, got {len(k_parts)} and {len(v_parts)}")
    nq, hd = q.shape[1], q.shape[2]
    nkv = k_parts[0].shape[1] if k_parts[0].dim() == 3 else -1
    for k, v in zip(k_parts, v_parts, strict=True):
        if k.dim() != 3 or k.shape != v.shape or k.shape[1:] != (nkv, hd):
            raise ValueError(f"k {tuple(k.shape)} / v {tuple(v.shape)} do not match q head_dim {hd}")
    if nq % nkv != 0:
        raise ValueError(f"num q heads {nq} is not a multiple of num kv heads {nkv}")
    return sum(k.shape[0] for k in k_parts)


def _grouped_attention(
    q: torch.Tensor, k_parts: Sequence[torch.Tensor], v_parts: Sequence[torch.Tensor], mask: torch.Tensor | None
) -> torch.Tensor:
    """softmax(q k^T / sqrt(hd) + mask) v with the query heads of a KV head as rows of one matrix.

    ``mask``: (L, T) additive in q's dtype, or None. Returns (L, nq, hd).
    """
    L, nq, hd = q.shape
    nkv = k_parts[0].shape[1]
    group = nq // nkv
    qg = q.reshape(L, nkv, group, hd).permute(1, 2, 0, 3).reshape(nkv, group * L, hd)  # row r*L+i: head j*g+r, query i
    scores = [torch.matmul(qg, _as(k, q.dtype).permute(1, 2, 0)) for k in k_parts]  # (nkv, g*L, T_i), K in place
    s = (scores[0] if len(scores) == 1 else torch.cat(scores, dim=-1)) * (hd**-0.5)  # (nkv, g*L, T)
    if mask is not None:
        s = (s.view(nkv, group, L, -1) + mask).view(nkv, group * L, -1)
    weights = _as(torch.softmax(s, dim=-1, dtype=torch.float32), q.dtype)
    out = None  # (nkv, g*L, hd)
    start = 0
    for v in v_parts:  # several parts: one rounding per part in bf16/fp16, within an ulp or two of one product
        w = weights[..., start : start + v.shape[0]]
        vh = _as(v, q.dtype).transpose(0, 1)  # (nkv, T_i, hd), a view
        out = torch.matmul(w, vh) if out is None else out.baddbmm_(w, vh)
        start += v.shape[0]
    return out.view(nkv, group, L, hd).permute(2, 0, 1, 3).reshape(L, nq, hd)


def _as(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x.to(dtype)`` without a call when it already is (each call on a decode step costs dispatch)."""
    return x if x.dtype == dtype else x.to(dtype)
