"""Qwen3 decoder layers of Qwen3-VL (``model.language_model.*``).

Per layer: RMSNorm -> q/k/v projections -> per-head RMSNorm on q and k *before* RoPE ->
interleaved M-RoPE in the activation dtype -> attention through the step's :class:`StepAttention`
(the KV backend owns slots, masks and GQA) -> o_proj -> residual -> RMSNorm -> SwiGLU -> residual.
No biases anywhere. RMSNorm multiplies by its weight *after* casting back to the input dtype
(docs/architecture.md, pitfall 8); that order is what makes bf16 results match transformers.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..kvcache import StepAttention
from .config import TextConfig
from .rope import apply_text_rope, mrope_cos_sin, mrope_streams, text_inv_freq


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        in_dtype = x.dtype
        xf = x.to(torch.float32)
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(in_dtype)


class SelfAttention(nn.Module):
    def __init__(self, cfg: TextConfig):
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.num_attention_heads * cfg.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.num_key_value_heads * cfg.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.num_key_value_heads * cfg.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.num_attention_heads * cfg.head_dim, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: StepAttention, layer: int
    ) -> torch.Tensor:
        n = x.shape[0]
        q = self.q_norm(self.q_proj(x).view(n, self.num_heads, self.head_dim))  # (L, nq, hd)
        k = self.k_norm(self.k_proj(x).view(n, self.num_kv_heads, self.head_dim))  # (L, nkv, hd)
        v = self.v_proj(x).view(n, self.num_kv_heads, self.head_dim)
        out = attn(layer, apply_text_rope(q, cos, sin), apply_text_rope(k, cos, sin), v)  # (L, nq, hd)
        return self.o_proj(out.reshape(n, self.num_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, cfg: TextConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: TextConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = SelfAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: StepAttention, layer: int
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, attn, layer)
        return x + self.mlp(self.post_attention_layernorm(x))


class TextDecoder(nn.Module):
    """Embedding, decoder layers and final norm; the rotary tables live here as fp32 buffers."""

    def __init__(self, cfg: TextConfig):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.register_buffer("inv_freq", torch.empty(cfg.head_dim // 2), persistent=False)
        self.register_buffer("rope_streams", torch.empty(cfg.head_dim // 2, dtype=torch.long), persistent=False)
        self.init_buffers()

    def init_buffers(self) -> None:
        """(Re)compute the rotary tables on the buffers' device (after a meta-device build)."""
        device = self.inv_freq.device
        if device.type == "meta":
            return
        self.inv_freq = text_inv_freq(self.cfg.head_dim, self.cfg.rope_theta, device)
        self.rope_streams = mrope_streams(self.cfg.head_dim, self.cfg.mrope_section, device)

    def _apply(self, fn, recurse=True):
        # .to(dtype) would cast the fp32 rotary tables; recompute them in fp32 on the new device instead.
        result = super()._apply(fn, recurse)
        self.init_buffers()
        return result

    def rope_tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin (L, hd) in ``dtype`` for positions (3, L)."""
        return mrope_cos_sin(positions.to(self.inv_freq.device), self.inv_freq, self.rope_streams, dtype)
