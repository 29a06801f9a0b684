"""Torch reference attention: the ground truth every KV backend and kernel is compared against.

It follows the transformers "eager" attention of Qwen3 exactly (scores in the input dtype, the additive
causal mask, softmax in fp32, cast back to the input dtype before the product with V) so that a model
running through our caches can be compared with a transformers checkpoint token for token.
"""

from __future__ import annotations

import torch


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_start: int) -> torch.Tensor:
    """Causal GQA attention of ``L`` queries over ``T`` cached slots.

    ``q``: (L, nq, hd); ``k``, ``v``: (T, nkv, hd) with ``T >= q_start + L``; query ``i`` sits at slot
    ``q_start + i`` and attends to slots ``0 .. q_start + i`` (slots beyond are masked, so ``k``/``v`` may
    hold stale rows past ``q_start + L``). kv head ``j`` serves q heads ``j*g .. j*g+g-1``.
    Returns (L, nq, hd) in q's dtype.
    """
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise ValueError(f"expected 3-D q/k/v, got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    L, nq, hd = q.shape
    T, nkv, _ = k.shape
    if k.shape != v.shape or k.shape[2] != hd:
        raise ValueError(f"k {tuple(k.shape)} / v {tuple(v.shape)} do not match q head_dim {hd}")
    if nq % nkv != 0:
        raise ValueError(f"num q heads {nq} is not a multiple of num kv heads {nkv}")
    if q_start < 0 or q_start + L > T:
        raise ValueError(f"queries at slots {q_start}..{q_start + L - 1} need {q_start + L} kv slots, got {T}")
    group = nq // nkv
    # (nkv, T, hd) -> (nq, T, hd): repeat_interleave matches HF repeat_kv (head j*g+r reads kv head j).
    kh = k.transpose(0, 1).repeat_interleave(group, dim=0)
    vh = v.transpose(0, 1).repeat_interleave(group, dim=0)
    qh = q.transpose(0, 1)  # (nq, L, hd)
    scores = torch.matmul(qh, kh.transpose(1, 2)) * (hd**-0.5)  # (nq, L, T)
    q_slots = torch.arange(q_start, q_start + L, device=q.device).unsqueeze(1)  # (L, 1)
    k_slots = torch.arange(T, device=q.device).unsqueeze(0)  # (1, T)
    mask = torch.zeros((L, T), dtype=scores.dtype, device=q.device)
    mask.masked_fill_(k_slots > q_slots, torch.finfo(scores.dtype).min)
    weights = torch.softmax(scores + mask, dim=-1, dtype=torch.float32).to(q.dtype)
    out = torch.matmul(weights, vh)  # (nq, L, hd)
    return out.transpose(0, 1).contiguous()


def masked_decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_len: torch.Tensor) -> torch.Tensor:
    """One decode query over a fixed-size KV window whose valid length lives in a tensor.

    ``q``: (1, nq, hd); ``k``, ``v``: (T, nkv, hd) where only slots ``0 .. kv_len-1`` are valid;
    ``kv_len``: (1,) integer tensor on q's device. The shapes never depend on the length and nothing
    is read back to the host, so a CUDA graph can capture this (the static decode path). Numerically
    the same formula as :func:`causal_attention` for the query at slot ``kv_len - 1``.
    """
    if q.dim() != 3 or q.shape[0] != 1:
        raise ValueError(f"decode attention takes one query (1, nq, hd), got {tuple(q.shape)}")
    _, nq, hd = q.shape
    T, nkv, _ = k.shape
    if nq % nkv != 0:
        raise ValueError(f"num q heads {nq} is not a multiple of num kv heads {nkv}")
    group = nq // nkv
    kh = k.transpose(0, 1).repeat_interleave(group, dim=0)  # (nq, T, hd)
    vh = v.transpose(0, 1).repeat_interleave(group, dim=0)
    scores = torch.matmul(q.transpose(0, 1), kh.transpose(1, 2)) * (hd**-0.5)  # (nq, 1, T)
    invalid = torch.arange(T, device=q.device) >= kv_len.reshape(1).to(q.device)  # (T,)
    mask = torch.zeros((1, T), dtype=scores.dtype, device=q.device)
    mask.masked_fill_(invalid.unsqueeze(0), torch.finfo(scores.dtype).min)
    weights = torch.softmax(scores + mask, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(weights, vh).transpose(0, 1).contiguous()  # (1, nq, hd)
