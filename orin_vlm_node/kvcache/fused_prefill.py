"""Attention of a multi-token step (a prefill piece) on the CPU, through torch's fused attention kernel.

Why: the reference formula (:mod:`.reference`) builds the (heads, L, T) score matrix and passes it through
half a dozen separate ops; a prompt's attention spends its time there, and in bf16 on a CPU without bf16
instructions its batched products are slow. ``torch.nn.functional.scaled_dot_product_attention`` runs a
fused flash-attention kernel on the CPU: it tiles the products, keeps the softmax online (fp32) and maps
each query head to its KV head itself (``enable_gqa``: K/V are never repeated). One layer, one thread, on
the benchmark machine: the default model's 53-token text prompt 215 -> 74 us; a 700-token prompt of the
2B's attention shape 163 -> 61 ms in fp32 and 2.4 s -> 58 ms in bf16.

More in docs/modules.md, ``orin_vlm_node/kvcache/fused_prefill.py``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from .reference import causal_attention_parts


def cpu_sdpa_maps_kv_heads(torch_version: str) -> bool:
    """Whether this torch's CPU flash kernel serves ``enable_gqa`` itself (torch 2.9 on).

    ``enable_gqa`` arrived in torch 2.5, but up to 2.8 the CPU dispatch sends a GQA call to the math
    kernel, which repeats K/V per query head and builds the whole score matrix (seen in the profiler with
    2.5.1, 2.6.0, 2.7.1 and 2.8.0; 2.9.1 runs the flash kernel). Older torch, as Jetson wheels often are,
    keeps the reference.
    """
    major, minor = (int(p) for p in torch_version.split(".")[:2])
    return (major, minor) >= (2, 9)


_SDPA_GQA = cpu_sdpa_maps_kv_heads(torch.__version__)


def uses_fused_prefill(q: torch.Tensor) -> bool:
    """Whether :func:`step_attention` takes the fused kernel for ``q`` (L, nq, hd)."""
    return _SDPA_GQA and q.shape[0] > 1 and q.device.type == "cpu"


def step_attention(
    q: torch.Tensor, k_parts: Sequence[torch.Tensor], v_parts: Sequence[torch.Tensor], q_start: int
) -> torch.Tensor:
    """The torch path's causal attention of one step (the contract of
    :func:`.reference.causal_attention_parts`): a multi-token step on the CPU through the fused kernel,
    anything else through the reference. Returns (L, nq, hd) in q's dtype."""
    if not uses_fused_prefill(q):
        return causal_attention_parts(q, k_parts, v_parts, q_start)
    return fused_causal_attention(q, k_parts, v_parts, q_start)


def fused_causal_attention(
    q: torch.Tensor, k_parts: Sequence[torch.Tensor], v_parts: Sequence[torch.Tensor], q_start: int
) -> torch.Tensor:
    """Causal GQA attention of ``q`` (L, nq, hd) at slots ``q_start..q_start+L-1`` over the slots the
    parts (each (T_i, nkv, hd), in order) hold up to the last query's; through the fused kernel."""
    L, nq, hd = q.shape
    end = q_start + L
    k = k_parts[0] if len(k_parts) == 1 else torch.cat(list(k_parts))  # (T, nkv, hd)
    v = v_parts[0] if len(v_parts) == 1 else torch.cat(list(v_parts))
    if k.dim() != 3 or k.shape != v.shape or k.shape[2] != hd or nq % k.shape[1]:
        raise ValueError(f"k {tuple(k.shape)} / v {tuple(v.shape)} do not fit q {tuple(q.shape)}")
    if q_start < 0 or end > k.shape[0]:
        raise ValueError(f"queries at slots {q_start}..{end - 1} need {end} kv slots, got {k.shape[0]}")
    # (1, heads, tokens, hd) views; slots past the last query are never attended, so they are cut off.
    q4 = q.transpose(0, 1).unsqueeze(0)
    k4 = k[:end].to(q.dtype).transpose(0, 1).unsqueeze(0)
    v4 = v[:end].to(q.dtype).transpose(0, 1).unsqueeze(0)
    mask = None
    if q_start:  # earlier slots are all visible: the causal triangle sits in the last L columns
        mask = torch.arange(end, device=q.device) <= torch.arange(q_start, end, device=q.device).unsqueeze(1)
    out = F.scaled_dot_product_attention(
        q4, k4, v4, attn_mask=mask, is_causal=mask is None, scale=hd**-0.5, enable_gqa=True
    )  # (1, nq, L, hd)
    return out[0].transpose(0, 1)
