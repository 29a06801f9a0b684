"""Qwen3 decoder layers of Qwen3-VL (``model.language_model.*``).

Per layer: RMSNorm -> q/k/v projections (one fused GEMM) -> per-head RMSNorm on q and k *before* RoPE ->
interleaved M-RoPE in the activation dtype -> attention through the step's :class:`StepAttention`
(the KV backend owns slots, masks and GQA) -> o_proj -> residual -> RMSNorm -> SwiGLU (gate and up fused)
-> residual. Each residual add is left to the norm after it (the o_proj's to the post-attention norm, the
MLP's to the next layer's input norm or the final one): the delta is passed on as a :class:`Product` not yet
computed (a layer's whole tail after attention as a :class:`LayerTail`), so on CUDA one kernel adds and
normalises, and a prefill's last layer computes its tail for the rows whose logits are asked for only.
No biases anywhere. RMSNorm multiplies by its weight *after* casting back to the input dtype
(docs/architecture.md, pitfall 8); that order is what makes bf16 results match transformers. With the GPU's
GEMV kernels a decode step's SwiGLU runs in the gate/up product's launch (:func:`swiglu`).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from ..kvcache import KVSink, StepAttention
from .config import TextConfig
from .embedding import checkpoint_embedding
from .rope import TextRopeTables, apply_text_rope, mrope_cos_sin, mrope_streams, text_inv_freq


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        # The fused kernels (``cuda.fused.CudaFusedOps``) when the CUDA kernels are loaded; None = torch ops.
        self.fused = None

    def normalize(self, x: torch.Tensor) -> torch.Tensor:
        """x / rms(x) over the last dim, computed in fp32, returned in x's dtype (no weight yet)."""
        xf = x if x.dtype == torch.float32 else x.to(torch.float32)
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return xf if x.dtype == torch.float32 else xf.to(x.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(self, x)


def rms_norm(norm: RMSNorm, x: torch.Tensor) -> torch.Tensor:
    """``norm`` applied to rows ``x`` (L, D), as a function (a decode step is mostly dispatch, and a module
    call costs several times a function call): the fused kernel when attached, else torch."""
    if norm.fused is not None:
        return norm.fused.rms_norm(x.unsqueeze(1), norm.weight, norm.weight, 1, norm.eps).view_as(x)
    return norm.weight * norm.normalize(x)


class HeadNorms(NamedTuple):
    """A layer's q and k norms as the kernels take them: ``q_weight`` for the first ``split`` heads (the q
    heads), ``k_weight`` for the rest, (D,) each, and their epsilon."""

    q_weight: torch.Tensor
    k_weight: torch.Tensor
    split: int
    eps: float

    def kv_heads(self, rows: int) -> int:
        """The k heads (as many as the v heads) of a fused q/k/v projection of ``rows`` outputs: ``split`` q
        heads, then the k heads, then the v heads, each of the weights' length; 0 when the rows are not so laid
        out."""
        dim = self.q_weight.shape[0]
        total = rows // dim if dim else 0
        kv_heads = (total - self.split) // 2
        return kv_heads if kv_heads >= 1 and total * dim == rows and self.split + 2 * kv_heads == total else 0


class Product(NamedTuple):
    """A projection's output not computed yet: ``proj`` applied to rows ``x`` (L, K), or with ``mlp`` (the MLP whose
    down projection ``proj`` is) to the activation of the MLP's input rows ``x``, not computed yet either. The
    residual add it feeds computes it (:func:`add_rms_norm`)."""

    x: torch.Tensor
    proj: nn.Module
    mlp: MLP | None = None

    def value(self) -> torch.Tensor:
        """(L, N)."""
        return project(self.operand(), self.proj)

    def operand(self) -> torch.Tensor:
        """The rows ``proj`` multiplies: x, or the MLP's activation of x."""
        return self.x if self.mlp is None else swiglu(self.x, self.mlp.gate_up_proj, self.mlp.fused)

    def rows(self, index: torch.Tensor | None) -> Product:
        """The product of rows ``index`` of x (None: the last row); the MLP works row by row."""
        return Product(self.x[-1:] if index is None else self.x.index_select(0, index), self.proj, self.mlp)

    def added_to(self, x: torch.Tensor) -> torch.Tensor:
        """The residual stream ``x`` with this product added."""
        return x + self.value()


class LayerTail(NamedTuple):
    """The rest of a decoder layer after its attention, not computed yet: the ``attention`` output through o_proj
    (a :class:`Product`), the post-attention ``norm`` and the ``mlp``. On the residual stream x it gives x1 + mlp(
    norm(x1)), x1 = x + o; the residual add after it computes it (:func:`add_rms_norm`)."""

    attention: Product
    norm: RMSNorm
    mlp: MLP

    def rows(self, index: torch.Tensor | None) -> LayerTail:
        """The tail of rows ``index`` (None: the last row); every part of it works row by row."""
        return LayerTail(self.attention.rows(index), self.norm, self.mlp)

    def mlp_after(self, x: torch.Tensor) -> tuple[torch.Tensor, Product]:
        """The o product and the post-attention norm on the residual stream ``x``: (x1, the MLP of norm(x1), not
        computed yet)."""
        x, h = add_rms_norm(self.norm, x, self.attention)
        return x, self.mlp(h)

    def added_to(self, x: torch.Tensor) -> torch.Tensor:
        """The residual stream ``x`` with the layer's tail added."""
        x, mlp = self.mlp_after(x)
        return mlp.added_to(x)


def add_rms_norm(
    norm: RMSNorm, x: torch.Tensor, delta: Product | LayerTail | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual add ``delta.added_to(x)`` (none when ``delta`` is None) and ``norm`` of the sum: (sum,
    normed), both (L, D). With the fused kernels attached one kernel adds and normalises."""
    if delta is None:
        return x, rms_norm(norm, x)
    if norm.fused is None:
        x = delta.added_to(x)
        return x, rms_norm(norm, x)
    if isinstance(delta, LayerTail):
        x, delta = delta.mlp_after(x)
    return norm.fused.add_rms_norm(x, delta.value(), norm.weight, norm.eps)


class FusedLinear(nn.Module):
    """Several bias-free projections of the same input as one weight (their rows stacked): one GEMM and
    one module call instead of several per layer and token. A decode step on the small models is
    mostly dispatch, so fewer, larger products are what makes it faster.

    The checkpoint keeps the separate matrices: ``parts`` names them (``q_proj``, ``k_proj``, ...) with
    their row counts, and the loader copies each into its rows of ``weight`` (``weights.keys.checkpoint_views``).
    """

    def __init__(self, in_features: int, parts: dict[str, int]):
        super().__init__()
        self.parts = dict(parts)  # checkpoint name (sibling of this module) -> rows, in weight order
        self.weight = nn.Parameter(torch.empty(sum(parts.values()), in_features))

    def part_rows(self) -> dict[str, slice]:
        rows, start = {}, 0
        for name, n in self.parts.items():
            rows[name] = slice(start, start + n)
            start += n
        return rows

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(L, in) -> (L, sum of the parts' rows): the parts side by side, in ``parts`` order."""
        return F.linear(x, self.weight)


def gemv_takes(proj: nn.Module, x: torch.Tensor) -> bool:
    """Whether ``proj``'s GEMV kernels multiply rows ``x`` (``weights.gemv_linear.GemvLinear``, or a
    ``weights.quant.QuantizedLinear`` with kernels; ``kernel_takes``), so the SwiGLU can run in that launch.
    Looked up on the class: a plain module (the CPU's, torch's) has no such method, and a missing attribute
    asked of the module itself goes through nn.Module.__getattr__'s exception, on every decode step."""
    kernel_takes = getattr(type(proj), "kernel_takes", None)
    return kernel_takes is not None and kernel_takes(proj, x)


def project(x: torch.Tensor, linear: nn.Module) -> torch.Tensor:
    """``x`` through a bias-free projection: a plain weight as a function of it (a decode step is mostly
    dispatch, and a module call costs several times a plain function call); one whose ``weight`` is None
    (quantized: ``weights.quant.QuantizedLinear``; the CPU's ``weights.cpu_linear.CpuLinear``; the GPU's
    ``weights.gemv_linear.GemvLinear``) through its module."""
    weight = linear.weight
    return F.linear(x, weight) if weight is not None else linear(x)


class SelfAttention(nn.Module):
    def __init__(self, cfg: TextConfig):
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        q_rows, kv_rows = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
        self.qkv_proj = FusedLinear(cfg.hidden_size, {"q_proj": q_rows, "k_proj": kv_rows, "v_proj": kv_rows})
        self.o_proj = nn.Linear(cfg.num_attention_heads * cfg.head_dim, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, rope: TextRopeTables, attn: StepAttention, layer: int) -> Product:
        """The attention output of rows ``x`` (L, hidden) and the o_proj it goes through, not yet applied."""
        n, nq, nkv = x.shape[0], self.num_heads, self.num_kv_heads
        q_norm, k_norm = self.q_norm, self.k_norm
        if q_norm.fused is not None:  # both norms and RoPE in one launch, reading the heads in place
            # A step that lets the producer store its K/V (the GPU's static decode step) gets them from this
            # launch too: no write launch, no copy of the strided heads; it is then called without k and v.
            offer = getattr(attn, "kv_sink", None)
            sink = offer(layer, x.dtype) if offer is not None else None
            qk, v = self.norm_rope_heads(x, rope, sink)
            k, v = (qk[:, nq:], v) if sink is None else (None, None)
        else:
            heads = project(x, self.qkv_proj).view(n, nq + 2 * nkv, self.head_dim)  # q heads, k heads, v heads
            # q_norm and k_norm normalise each head over head_dim: one pass over the q and k heads together,
            # then each head times its norm's weight (what the two RMSNorms compute, bit for bit).
            weight = torch.cat((q_norm.weight.expand(nq, -1), k_norm.weight.expand(nkv, -1)))
            qk = apply_text_rope(weight * q_norm.normalize(heads[:, : nq + nkv]), rope)  # (L, nq + nkv, hd)
            k, v = qk[:, nq:], heads[:, nq + nkv :]
        out = attn(layer, qk[:, :nq], k, v)  # (L, nq, hd)
        return Product(out.reshape(n, nq * self.head_dim), self.o_proj)

    def norm_rope_heads(
        self, x: torch.Tensor, rope: TextRopeTables, sink: KVSink | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """With the fused kernels: the q/k/v product of rows ``x``, its q and k heads normalised and rotated
        (L, nq + nkv, hd) and its v heads (L, nkv, hd); with ``sink`` the rotated keys and the values are
        stored there too: the product, then the fused norm + RoPE launch."""
        norms = HeadNorms(self.q_norm.weight, self.k_norm.weight, self.num_heads, self.q_norm.eps)
        return self.q_norm.fused.norm_rope_product(project(x, self.qkv_proj), norms, rope, sink)


def swiglu(x: torch.Tensor, gate_up_proj: nn.Module, fused) -> torch.Tensor:
    """silu(gate) * up of ``x`` (L, K) through the fused gate/up projection -> (L, I). Where the projection's
    GEMV kernels take ``x`` (a decode step's rows; ``weights.gemv_linear.GemvLinear`` and a quantized
    ``weights.quant.QuantizedLinear`` with kernels), one kernel with the activation in its epilogue;
    else the product, then the activation (the ``fused`` kernel, or torch)."""
    if gemv_takes(gate_up_proj, x):
        return gate_up_proj.kernels(gate_up_proj, x, swiglu=True)
    gate_up = project(x, gate_up_proj)
    if fused is not None:
        return fused.silu_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


class MLP(nn.Module):
    def __init__(self, cfg: TextConfig):
        super().__init__()
        rows = cfg.intermediate_size
        self.gate_up_proj = FusedLinear(cfg.hidden_size, {"gate_proj": rows, "up_proj": rows})
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.fused = None  # as RMSNorm's: the fused kernels when loaded

    def forward(self, x: torch.Tensor) -> Product:
        """The MLP of rows ``x`` (L, hidden), not computed yet: its activation and the down projection it goes
        through are left to the residual add after it (:func:`add_rms_norm`), which may run both in one launch."""
        return Product(x, self.down_proj, self)


def takes_swiglu(parent: nn.Module, attr: str) -> bool:
    """Whether the SwiGLU follows the product of the projection ``getattr(parent, attr)`` (an MLP's gate/up
    projection: :func:`swiglu`), which the GEMV kernels then run in the product's launch and are timed with."""
    return isinstance(parent, MLP) and attr == "gate_up_proj"


def attach_fused_ops(model: nn.Module, ops) -> int:
    """Route every RMSNorm and MLP activation of ``model`` through ``ops`` (``cuda.fused.CudaFusedOps``; None:
    torch ops); how many modules."""
    modules = [m for m in model.modules() if isinstance(m, (RMSNorm, MLP))]
    for m in modules:
        m.fused = ops
    return len(modules)


class DecoderLayer(nn.Module):
    # The projections (submodule, attribute) whose weights weight-only quantization stores quantized.
    PROJECTIONS = (("self_attn", "qkv_proj"), ("self_attn", "o_proj"), ("mlp", "gate_up_proj"), ("mlp", "down_proj"))

    def __init__(self, cfg: TextConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = SelfAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(
        self, x: torch.Tensor, delta: LayerTail | None, rope: TextRopeTables, attn: StepAttention, layer: int
    ) -> tuple[torch.Tensor, LayerTail]:
        """The layer on the residual stream ``x`` plus ``delta`` (the previous layer's tail after its attention,
        not yet computed and added, or None), returned the same way: (stream, this layer's tail). Leaving the
        tail to the next norm lets the kernels run its products with both norms and adds in one launch
        (``add_rms_norm``); the sums are the same."""
        x, h = add_rms_norm(self.input_layernorm, x, delta)
        return x, LayerTail(self.self_attn(h, rope, attn, layer), self.post_attention_layernorm, self.mlp)


class TextDecoder(nn.Module):
    """Embedding, decoder layers and final norm; the rotary tables live here as fp32 buffers."""

    def __init__(self, cfg: TextConfig):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = checkpoint_embedding(cfg.vocab_size, cfg.hidden_size)
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

    def rope_tables(self, positions: torch.Tensor, dtype: torch.dtype) -> TextRopeTables:
        """The rotation of positions (3, L) in ``dtype``, shared by every layer of the step: one launch with the
        fused kernels attached (about ten small torch kernels otherwise, each a fixed cost in a decode step)."""
        positions = positions.to(self.inv_freq.device)
        if self.norm.fused is not None:
            return self.norm.fused.rope_tables(positions, self.inv_freq, self.rope_streams, dtype)
        cos, sin = mrope_cos_sin(positions, self.inv_freq, self.rope_streams, dtype)
        return TextRopeTables.build(cos, sin)
