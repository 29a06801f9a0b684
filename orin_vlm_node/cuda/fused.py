"""The text decoder's elementwise work through fused kernels: ``kernels/rms_norm.cu`` (each RMSNorm with the
residual add before it, and the q/k norms with RoPE, one launch, which in a static decode step also stores
the step's keys and values in the paged pools; the step's RoPE tables, one launch) and
``kernels/silu_mul.cu`` (the SwiGLU activation, one launch).

At batch 1 on a fast GPU a decode step is bound by its small kernels, not by its weights (measured on an
H200: about 1000 of the 1150 kernels of a 2B token were 1-2 us elementwise ops, about 40 a layer, where
these kernels leave 5). :class:`CudaFusedOps` is what the decoder's modules call (their ``fused``, see
``model.text.attach_fused_ops``) when the kernels are loaded; it launches on the ``launcher`` (the PyCUDA
runtime on torch's stream, so CUDA graphs capture it; the CPU harness in the tests). Each kernel rounds
where torch's separate ops round, so the results are torch's but for the order of one sum.
"""

from __future__ import annotations

import torch

from ..kvcache import KVSink
from ..model.rope import TextRopeTables
from ..model.text import HeadNorms
from . import launch as L


class CudaFusedOps:
    """RMSNorm of rows of heads (optionally with RoPE, or after the residual add), and silu(gate) * up (see
    module docstring)."""

    def __init__(self, launcher) -> None:
        self.launcher = launcher

    def rms_norm(
        self,
        x: torch.Tensor,
        weight_a: torch.Tensor,
        weight_b: torch.Tensor,
        split: int,
        eps: float,
        rope: TextRopeTables | None = None,
        sink: KVSink | None = None,
        v: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """x (L, H, D), heads adjacent (a slice of a projection's heads is fine) -> (L, H, D) contiguous:
        heads below ``split`` normalised with ``weight_a``, the rest with ``weight_b`` (both (D,), x's dtype),
        then rotated by ``rope``'s rows (its (L, 1, D) tables) when given. A plain norm passes (L, 1, D)
        and the same weight twice.

        With ``sink`` (and ``rope``): the heads from ``split`` on are keys; the same launch stores each
        rotated key and each row of the values ``v`` (L, H - split, D), heads adjacent, at its token's slot
        of the sink's pools (a static decode step: no write launch, no copy of the strided heads). Without a
        sink ``v`` is not read."""
        if x.dim() != 3 or x.shape[0] < 1:
            raise ValueError(f"rms_norm takes (L, H, D) rows, got {tuple(x.shape)}")
        tokens, heads, dim = x.shape
        if x.stride(2) != 1 or x.stride(1) != dim:
            x = x.contiguous()
        weight_a = fitted(weight_a, (dim,), x, "weight")
        weights = (weight_a, weight_a if weight_b is weight_a else fitted(weight_b, (dim,), x, "weight"))
        if rope is None:
            if sink is not None:
                raise ValueError("rms_norm stores keys in a KV sink only with RoPE (the q/k norms of a layer)")
            out = torch.empty((tokens, heads, dim), dtype=x.dtype, device=x.device)
            self.launcher.launch(
                L.rms_norm_launch(tokens * heads, x.dtype), [out, x, *weights, heads, split, dim, x.stride(0), eps]
            )
            return out
        tables = tuple(fitted(t, (tokens, 1, dim), x, "rope table") for t in (rope.cos, rope.sin_signed))
        if dim > L.MAX_ROPE_DIM or dim % 2:
            raise ValueError(f"rms_norm with RoPE takes even rows of at most {L.MAX_ROPE_DIM}, got {dim}")
        kv_heads = heads - split
        stores: list = [None, None, None, None]
        v_stride = 0
        if sink is not None:
            stores, v_stride = self._sink_args(sink, v, x, kv_heads)
        out = torch.empty((tokens, heads, dim), dtype=x.dtype, device=x.device)
        rows = tokens * (heads + (kv_heads if sink is not None else 0))
        cfg = L.rms_norm_launch(rows, x.dtype, "rms_norm_rope")
        self.launcher.launch(cfg, [out, x, *weights, *tables, *stores, heads, split, dim, x.stride(0), v_stride, eps])
        return out

    def norm_rope_product(
        self, y: torch.Tensor, norms: HeadNorms, rope: TextRopeTables, sink: KVSink | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A fused q/k/v projection's product ``y`` (L, N): ``norms.split`` q heads, then as many k as v heads,
        of the norm weights' length. Its q and k heads normalised and rotated, (L, heads, D) (:meth:`rms_norm`,
        with ``sink`` the keys and values stored there too), and its v heads (L, kv_heads, D), a view of ``y``."""
        q_weight, k_weight, split, eps = norms
        heads = y.view(y.shape[0], -1, q_weight.shape[0])
        qk_heads = split + norms.kv_heads(y.shape[1])
        v = heads[:, qk_heads:]
        return self.rms_norm(heads[:, :qk_heads], q_weight, k_weight, split, eps, rope, sink, v), v

    @staticmethod
    def _sink_args(sink: KVSink, v: torch.Tensor | None, x: torch.Tensor, kv_heads: int) -> tuple[list, int]:
        """(k_pool, v_pool, v, slots) as the kernel takes them and v's token stride; ValueError when the sink
        or the values do not belong to the keys of ``x``."""
        tokens, _, dim = x.shape
        k_pool, v_pool, slots = sink_arguments(sink, tokens, kv_heads, dim, x.dtype)
        if v is None or tuple(v.shape) != (tokens, kv_heads, dim) or v.dtype != x.dtype:
            raise ValueError(f"a KV sink needs the values as ({tokens}, {kv_heads}, {dim}) {x.dtype} rows")
        if v.stride(2) != 1 or v.stride(1) != dim:
            v = v.contiguous()
        return [k_pool, v_pool, v, slots], v.stride(0)

    def add_rms_norm(
        self, x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual add and the norm after it: (x + delta, weight * cast(sum / rms(sum))), both (L, D)."""
        if x.dim() != 2 or delta.shape != x.shape or delta.dtype != x.dtype or x.shape[0] < 1:
            raise ValueError(f"add_rms_norm takes two (L, D) rows alike, got {tuple(x.shape)} and {tuple(delta.shape)}")
        x, delta = x.contiguous(), delta.contiguous()
        weight = fitted(weight, (x.shape[1],), x, "weight")
        total, out = torch.empty_like(x), torch.empty_like(x)
        cfg = L.rms_norm_launch(x.shape[0], x.dtype, "add_rms_norm")
        self.launcher.launch(cfg, [total, out, x, delta, weight, x.shape[1], eps])
        return total, out

    def rope_tables(
        self, positions: torch.Tensor, inv_freq: torch.Tensor, streams: torch.Tensor, dtype: torch.dtype
    ) -> TextRopeTables:
        """The rotation of a step's tokens, 3-D positions (3, L) int64, in ``dtype``: what ``mrope_cos_sin(
        positions, inv_freq, streams, dtype)`` and ``TextRopeTables.build`` give (fp32 ``inv_freq`` and int64
        ``streams``, (D / 2,) each), in one launch."""
        if positions.dim() != 2 or positions.shape[0] != 3 or positions.shape[1] < 1 or positions.dtype != torch.int64:
            raise ValueError(
                f"rope_tables takes (3, L) int64 positions, got {tuple(positions.shape)} {positions.dtype}"
            )
        half = inv_freq.shape[0]
        if inv_freq.dtype != torch.float32 or streams.shape != (half,) or streams.dtype != torch.int64:
            got = f"{inv_freq.dtype} {tuple(inv_freq.shape)} and {streams.dtype} {tuple(streams.shape)}"
            raise ValueError(f"rope_tables takes fp32 inverse frequencies and int64 streams alike, got {got}")
        if positions.stride(1) != 1:
            positions = positions.contiguous()
        tokens, dim = positions.shape[1], 2 * half
        cos = torch.empty((tokens, 1, dim), dtype=dtype, device=positions.device)
        sin_signed = torch.empty_like(cos)
        args = [cos, sin_signed, positions, inv_freq.contiguous(), streams.contiguous(), positions.stride(0), dim]
        self.launcher.launch(L.rms_norm_launch(tokens, dtype, "rope_tables"), args)
        return TextRopeTables(cos, sin_signed)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """(L, 2I) gate columns then up columns -> (L, I) silu(gate) * up."""
        if gate_up.dim() != 2 or gate_up.shape[1] % 2:
            raise ValueError(f"silu_mul takes (L, 2I) rows, got {tuple(gate_up.shape)}")
        gate_up = gate_up.contiguous()
        rows, inter = gate_up.shape[0], gate_up.shape[1] // 2
        out = torch.empty((rows, inter), dtype=gate_up.dtype, device=gate_up.device)
        if rows:
            self.launcher.launch(L.silu_mul_launch(rows, inter, gate_up.dtype), [out, gate_up, rows, inter])
        return out


def fitted(t: torch.Tensor, shape: tuple[int, ...], x: torch.Tensor, what: str) -> torch.Tensor:
    """``t`` as a kernel reads it (contiguous), or ValueError when it does not belong to rows ``x``."""
    if t.shape != shape or t.dtype != x.dtype or t.device != x.device:
        raise ValueError(f"rms_norm {what} {tuple(t.shape)} {t.dtype} does not fit rows {tuple(x.shape)} {x.dtype}")
    return t.contiguous()


def sink_arguments(sink: KVSink, tokens: int, kv_heads: int, dim: int, dtype: torch.dtype) -> list[torch.Tensor]:
    """(k_pool, v_pool, slots) as a kernel storing ``tokens`` tokens' keys and values (``kv_heads`` heads of
    ``dim``, ``dtype``) takes them; ValueError when the sink does not take them."""
    pool_shape = tuple(sink.k_pool.shape)
    if (
        len(pool_shape) != 4
        or pool_shape[2:] != (kv_heads, dim)
        or sink.v_pool.shape != sink.k_pool.shape
        or {sink.k_pool.dtype, sink.v_pool.dtype} != {dtype}
        or not (sink.k_pool.is_contiguous() and sink.v_pool.is_contiguous())
    ):
        raise ValueError(
            f"KV sink pools {pool_shape} {sink.k_pool.dtype} do not take {kv_heads} heads of {dim} {dtype}"
        )
    slots = sink.slot_mapping
    if slots.shape != (tokens,) or slots.dtype != torch.int64:
        raise ValueError(f"KV sink slots must be ({tokens},) int64, got {tuple(slots.shape)} {slots.dtype}")
    return [sink.k_pool, sink.v_pool, slots.contiguous()]
