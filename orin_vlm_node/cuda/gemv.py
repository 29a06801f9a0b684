"""Projections through ``kernels/gemv.cuh``: the decode-time product of 1..8 rows, for float and quantized weights.

:class:`CudaGemv` is what a :class:`~orin_vlm_node.model.quant.QuantizedLinear` and a
:class:`~orin_vlm_node.model.gemv_linear.GemvLinear` call (their ``kernels``, see ``gemv_linear.attach_gemv``)
when the kernels are loaded: it checks that the call fits a kernel (rows, dtype, layout), allocates the output
and launches on the ``launcher`` (the PyCUDA runtime on torch's stream, so CUDA graphs capture it; or the CPU
harness in the tests). A call that does not fit (a prefill of many rows) goes back to the module's torch path:
with hundreds of rows the product is compute-bound, the weights are read once either way, and torch's tiled
GEMM is the faster one.

A float weight competes with torch's product (cuBLAS), which is close to the bandwidth on some shapes and
GPUs and not on others; :meth:`CudaGemv.faster_rows` times both on this GPU, as a decode graph runs them, and
the engine routes a shape to the kernel only for the rows it won.

The MLP's fused gate/up projection takes the kernels' SwiGLU epilogue (``swiglu=True``): one launch writes
silu(gate) * up, where the unfused path writes the 2I-wide product and launches ``silu_mul`` on it; its
timing is against that pair (``F.linear`` then the ``silu_mul`` kernel), and a quantized one's against its
own plain launch then ``silu_mul`` (:meth:`CudaGemv.swiglu_rows`: the two kernels differ in registers, by
architecture, so the GPU decides).

A layer's o and down projections take the norm epilogue (:meth:`CudaGemv.add_rms_norm`): the launch also adds
the product to the residual stream and applies the RMSNorm after it (the block that finishes last does, see
``kernels/gemv.cuh``), where the decoder would launch ``add_rms_norm`` on the product. At batch 1 on a fast
GPU each kernel of a decode step costs microseconds beyond its bytes (the launch, the blocks' start, the
first memory round trip), two of them a layer here. A layer's fused q/k/v projection takes the heads epilogue
(:meth:`CudaGemv.norm_rope_heads`): the q and k norms and RoPE, and in a static decode step the KV sink's
stores, in the product's launch (the block that finishes a head last normalises it), where the decoder would
launch ``rms_norm_rope`` on the product. ``norm_epilogue`` False keeps the separate launches (the benchmark
measures both).

A decode row's products between two attentions are one launch where they all take the kernels
(:meth:`CudaGemv.tail_add_rms_norm`, ``gemv_tail``): the o product with its norm epilogue, the SwiGLU product,
then the down product with its norm epilogue, each product's blocks waiting inside the launch for the blocks of
the one before (ordered by tickets, see ``kernels/gemv.cuh``); the MLP alone is ``gemv_mlp``
(:meth:`CudaGemv.mlp_add_rms_norm`). ``tail_chain`` False leaves the o product a launch of its own, ``mlp_chain``
False every product (the benchmark's ``tail_chain`` and ``mlp_chain`` parts measure them).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..kvcache import KVSink
from ..model.rope import TextRopeTables
from ..model.text import HeadNorms
from . import launch as L
from .fused import CudaFusedOps, fitted, sink_arguments

TIMING_BYTES = 64 << 20  # weight bytes read per timed graph: enough calls of a small weight to time it
MAX_TIMED = 16  # products in one timed graph at most (and distinct weights walked through)
NORM_EPS = 1e-6  # the RMSNorm epsilon a timed norm epilogue uses (Qwen3's; the time does not depend on it)
# Finish counters a launch may use (kernels/gemv.cuh): one for the norm epilogue, one a head for the heads
# epilogue (Qwen3-VL-8B's q/k/v projection has 48 heads).
COUNTERS = 256


@dataclass(frozen=True)
class _NormEpilogue:
    """What a product's launch adds its rows to and normalises them with: ``sum_out = residual + y`` and
    ``out = norm(sum_out)`` (all (L, N), contiguous; ``weight`` (N,))."""

    residual: torch.Tensor
    weight: torch.Tensor
    sum_out: torch.Tensor
    out: torch.Tensor
    eps: float

    def arguments(self, first: int, counters: torch.Tensor) -> list:
        """The kernel's epilogue pointers for the launch of rows ``first`` on (kernels/gemv.cuh's order)."""
        return [self.residual[first:], self.weight, self.sum_out[first:], self.out[first:], counters] + [None] * 8

    def pointers(self) -> list:
        """residual, weight, sum_out, out: a chained launch's (kernels/gemv.cuh's order)."""
        return [self.residual, self.weight, self.sum_out, self.out]

    def sizes(self) -> list:
        """The heads epilogue's sizes (none) and the epsilon."""
        return [0, 0, 0, self.eps]


@dataclass(frozen=True)
class _HeadsEpilogue:
    """What a fused q/k/v product's launch finishes its heads with: the q heads (below ``split``) and k heads
    normalised with ``q_weight`` / ``k_weight`` and rotated with ``rope``'s rows into ``out`` (L, heads, dim),
    and with a sink ``pools_slots`` (k_pool, v_pool, slots) each rotated key and value stored at its slot."""

    out: torch.Tensor
    q_weight: torch.Tensor
    k_weight: torch.Tensor
    cos: torch.Tensor
    sin_signed: torch.Tensor
    pools_slots: list | None
    heads: int
    split: int
    eps: float

    def arguments(self, first: int, counters: torch.Tensor) -> list:
        """The kernel's epilogue pointers for the launch of rows ``first`` on (kernels/gemv.cuh's order)."""
        stores = [None] * 3
        if self.pools_slots is not None:
            k_pool, v_pool, slots = self.pools_slots
            stores = [k_pool, v_pool, slots[first:]]
        tables = [self.cos[first:], self.sin_signed[first:]]
        return [None] * 4 + [counters, self.out[first:], self.q_weight, self.k_weight, *tables, *stores]

    def sizes(self) -> list:
        """heads, split, head_dim and the epsilon."""
        return [self.heads, self.split, self.out.shape[2], self.eps]


class CudaGemv:
    """Float, INT8 and INT4 weights x activation rows through the GEMV kernels (see module docstring).

    ``time_us(fn, calls)``: device microseconds of one ``fn()`` (``graph.device_us`` bound to the process's
    capture stream: in a CUDA graph), what :meth:`faster_rows` measures with; None for products only.
    ``norm_epilogue``: whether the decoder's norms after a product run in the product's launch (the residual
    add + norm after an o or down product, :meth:`add_rms_norm`; the q/k norms + RoPE after the q/k/v product,
    :meth:`norm_rope_heads`; module docstring). ``mlp_chain``: whether a decode row's MLP (both products, the
    activation, the add + norm after it) is one launch where both of its projections take the kernels
    (:meth:`mlp_add_rms_norm`; needs ``norm_epilogue``); ``tail_chain``: whether the o product and its add + norm
    join that launch (:meth:`tail_add_rms_norm`; needs ``mlp_chain``)."""

    max_rows = L.GEMV_ROW_BUCKETS[-1]  # rows one launch takes
    # Rows a quantized weight takes, in launches of up to max_rows: every decode batch (max_batch is at most
    # 16). Reading the stored weight once a launch costs less than widening all of it for torch's product,
    # which in a CUDA graph would also keep the widened copy in the graph's memory pool (622 MB for the 2B's
    # LM head).
    max_quantized_rows = 2 * max_rows

    def __init__(self, launcher, time_us: Callable[..., float] | None = None) -> None:
        self.launcher = launcher
        self.time_us = time_us
        self.norm_epilogue = True
        self.mlp_chain = True
        self.tail_chain = True
        self._fused = CudaFusedOps(launcher)  # what follows F.linear where the epilogues are not used
        # Rows up to which a quantized gate/up weight of a shape runs its product, then the silu_mul kernel, instead
        # of its SwiGLU kernel (measured faster by swiglu_rows); (mode, stored shape, group) -> rows, absent: 0.
        self._swiglu_apart: dict[tuple, int] = {}
        # The epilogues' finish counters per device (zero between launches, which run in stream order),
        # allocated at the first, eager, launch: before any capture.
        self._counters: dict[str, torch.Tensor] = {}

    def fits(self, module, x: torch.Tensor) -> bool:
        """Whether the kernels take ``module``'s product of ``x`` (L, K): 1..max_rows rows (max_quantized_rows for
        a quantized weight) of a supported dtype, 16-byte aligned, and for a float weight one in x's dtype
        (every quantized format and shape is taken)."""
        return (
            x.dim() == 2
            and 1 <= x.shape[0] <= (self.max_rows if module.mode == "float" else self.max_quantized_rows)
            and str(x.dtype).removeprefix("torch.") in L.DTYPE_TAGS
            and x.data_ptr() % 16 == 0
            and (module.mode != "float" or _takes_weight(module.matrix, x))
        )

    def __call__(self, module, x: torch.Tensor, swiglu: bool = False) -> torch.Tensor:
        """(L, K) -> (L, N) in x's dtype, for a QuantizedLinear or GemvLinear ``module`` (on x's device); with
        ``swiglu`` (a fused gate/up weight, N even) -> (L, N / 2): silu(gate) * up, in the product's launch or,
        for the rows :meth:`swiglu_rows` measured faster so, the product then the ``silu_mul`` kernel (the same
        roundings: the same bits)."""
        mode, stored, group = _stored(module)
        if swiglu:
            apart = x.shape[0] <= self._swiglu_apart.get(_signature(mode, stored, group), 0)
            return self._swiglu(x, mode, stored, group, apart)
        return self._product(x, mode, stored, group, False)

    def widen(self, module, dtype: torch.dtype) -> torch.Tensor:
        """The (N, K) weight an INT4 QuantizedLinear ``module`` stands for, in ``dtype``, in one launch
        (``kernels/widen_int4.cu``): what ``module.dequantize(dtype)`` gives, to the bit, for the products the
        kernels do not take (a prefill's many rows, torch's GEMM)."""
        if module.mode != "int4":
            raise ValueError(f"widen takes an int4 weight, got {module.mode}")
        n, k = module.out_features, module.in_features
        out = torch.empty((n, k), dtype=dtype, device=module.qweight.device)
        args = [out, module.qweight, module.scales, module.offsets, n, k, module.group_size]
        self.launcher.launch(L.widen_int4_launch(n, k, dtype), args)
        return out

    def _swiglu(self, x: torch.Tensor, mode: str, stored: tuple, group: int, apart: bool) -> torch.Tensor:
        """silu(gate) * up of a fused gate/up weight as stored: in the product's launch, or ``apart``: its plain
        product, then the ``silu_mul`` kernel (the same bits)."""
        if apart:
            return self._fused.silu_mul(self._product(x, mode, stored, group, False))
        return self._product(x, mode, stored, group, True)

    def add_rms_norm(
        self, module, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``module``'s product of ``x`` (L, K) added to ``residual`` (L, N) and normalised with ``weight`` (N,)
        in the product's launch (the norm epilogue): (sum, normed), both (L, N), what ``CudaFusedOps.add_rms_norm(
        residual, module(x), weight, eps)`` returns, to the bit."""
        return self._product_add_norm(x, *_stored(module), residual, weight, eps)

    def _product_add_norm(
        self,
        x: torch.Tensor,
        mode: str,
        stored: tuple,
        group: int,
        residual: torch.Tensor,
        weight: torch.Tensor,
        eps: float,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`add_rms_norm` of a weight as stored."""
        norm = _norm_epilogue(x, stored[0].shape[0], residual, weight, eps)
        self._product(x, mode, stored, group, False, norm)
        return norm.sum_out, norm.out

    def chains(self, modules: Sequence, x: torch.Tensor) -> bool:
        """Whether one launch computes the products of ``modules`` (the MLP's gate/up and down projections, or the o
        projection and those; each one whose kernels take rows like ``x``) for rows ``x``: one row (the decode step
        of one sequence, where a launch's fixed cost weighs most), every weight stored alike, while ``norm_epilogue``
        and ``mlp_chain`` are on (and ``tail_chain`` for the o projection and the MLP)."""
        on = self.mlp_chain and self.norm_epilogue and (len(modules) == 2 or self.tail_chain)
        return on and x.shape[0] == 1 and len({_stored(m)[::2] for m in modules}) == 1

    def mlp_add_rms_norm(
        self, gate_up, down, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """An MLP of one row ``x`` (1, D) in one launch (``gemv_mlp``, kernels/gemv.cuh): silu(gate) * up through
        the fused ``gate_up`` projection, then the ``down`` projection added to ``residual`` (1, D) and normalised
        with ``weight`` (D,): (sum, normed), what :meth:`add_rms_norm` of ``down`` on ``self(gate_up, x,
        swiglu=True)`` returns, to the bit."""
        hidden = x.shape[1]
        mode, (up_w, down_w), group, inter = _chain_weights([gate_up, down], x, hidden)
        norm = _norm_epilogue(x, hidden, residual, weight, eps)
        act, y = x.new_empty((1, inter)), torch.empty_like(norm.residual)
        pointers = [act, x.contiguous(), *up_w, y, *down_w, *norm.pointers()]
        self._chain("mlp", mode, x, inter, hidden, pointers, [inter, hidden, group, eps])
        return norm.sum_out, norm.out

    def tail_add_rms_norm(
        self,
        projections: tuple,
        x: torch.Tensor,
        residual: torch.Tensor,
        post: tuple[torch.Tensor, float],
        weight: torch.Tensor,
        eps: float,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The rest of a decoder layer after attention for one row in one launch (``gemv_tail``, kernels/gemv.cuh):
        the o projection (``projections``: o, gate/up, down) of the attention output ``x`` (1, A) added to
        ``residual`` (1, D) and normalised with the post-attention norm ``post`` (weight (D,), epsilon), then the
        MLP of that added to the sum and normalised with ``weight`` (D,): (sum, normed), what :meth:`add_rms_norm`
        of o on ``x`` followed by :meth:`mlp_add_rms_norm` returns, to the bit."""
        hidden = residual.shape[-1]
        mode, (o_w, up_w, down_w), group, inter = _chain_weights(list(projections), x, hidden)
        first = _norm_epilogue(x, hidden, residual, *post)
        norm = _norm_epilogue(x, hidden, first.sum_out, weight, eps)
        y_o, act, y = torch.empty_like(first.residual), x.new_empty((1, inter)), torch.empty_like(first.residual)
        pointers = [y_o, x.contiguous(), *o_w, *first.pointers(), act, *up_w, y, *down_w, *norm.pointers()[1:]]
        self._chain("tail", mode, x, inter, hidden, pointers, [x.shape[1], inter, hidden, group, post[1], eps])
        return norm.sum_out, norm.out

    def _chain(
        self, kind: str, mode: str, x: torch.Tensor, inter: int, hidden: int, pointers: list, sizes: list
    ) -> None:
        """Launch the chained products ``kind`` (launch.GEMV_CHAINS) of the row ``x``: the kernel's pointers, the
        chain's counters, its sizes."""
        chain = self._counters_on(x.device)[: L.chain_counters(kind)]  # the counters the launch takes, no more
        cfg = L.gemv_chain_launch(kind, mode, inter, hidden, x.shape[1], x.dtype)
        self.launcher.launch(cfg, [*pointers, chain, *sizes])

    def norm_rope_heads(
        self, module, x: torch.Tensor, norms: HeadNorms, rope: TextRopeTables, sink: KVSink | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``module``'s product of ``x`` (L, K), a fused q/k/v projection whose rows are ``norms.split`` q heads,
        then as many k heads as v heads, of the norm weights' length, with the q/k norms and RoPE in the
        product's launch (the heads epilogue), and with ``sink`` the rotated keys and the values stored at their
        slots: (qk (L, heads, D), v (L, kv_heads, D), a view of the product), what
        ``CudaFusedOps.norm_rope_product(module(x), norms, rope, sink)`` returns, to the bit."""
        return self._product_heads(x, *_stored(module), norms, rope, sink)

    def _product_heads(
        self,
        x: torch.Tensor,
        mode: str,
        stored: tuple,
        group: int,
        norms: HeadNorms,
        rope: TextRopeTables,
        sink: KVSink | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`norm_rope_heads` of a weight as stored."""
        q_weight, k_weight, split, eps = norms
        dim, n = q_weight.shape[0], stored[0].shape[0]
        kv_heads = norms.kv_heads(n)
        total = split + 2 * kv_heads
        if dim % 2 or dim > L.MAX_ROPE_DIM or not kv_heads:
            raise ValueError(
                f"a heads epilogue takes {split} q heads and as many k as v heads of an even size up to "
                f"{L.MAX_ROPE_DIM}, got {n} rows in heads of {dim}"
            )
        if total > COUNTERS:
            raise ValueError(f"a heads epilogue counts at most {COUNTERS} heads, the product has {total}")
        tokens, heads = x.shape[0], split + kv_heads
        weights = [fitted(w, (dim,), x, "weight") for w in (q_weight, k_weight)]
        tables = [fitted(t, (tokens, 1, dim), x, "rope table") for t in (rope.cos, rope.sin_signed)]
        stores = None if sink is None else sink_arguments(sink, tokens, kv_heads, dim, x.dtype)
        out = torch.empty((tokens, heads, dim), dtype=x.dtype, device=x.device)
        y = self._product(
            x, mode, stored, group, False, _HeadsEpilogue(out, *weights, *tables, stores, heads, split, eps)
        )
        return out, y.view(tokens, total, dim)[:, heads:]

    def faster_rows(self, weights: Sequence[torch.Tensor], epilogue: str = "") -> tuple[int, str]:
        """The largest rows bucket up to which the kernel multiplied float weights of one shape (N, K) faster
        than ``F.linear`` (0: not even one row, or the weights are not ones the kernel reads), each bucket timed
        on both until the kernel loses one; and those timings, for the log. Each side with what follows the
        product in the decoder (``epilogue``, ``text.product_epilogue``): for ``"swiglu"`` (fused gate/up
        weights) the kernel's SwiGLU epilogue against ``F.linear`` followed by the ``silu_mul`` kernel, for
        ``"norm"`` (o and down) the norm epilogue (while ``norm_epilogue``) against ``F.linear`` followed by the
        ``add_rms_norm`` kernel, for ``"heads <q heads> <head_dim>"`` (a fused q/k/v weight) the heads
        epilogue storing into a KV sink (while ``norm_epilogue``) against ``F.linear`` followed by the
        ``rms_norm_rope`` kernel storing into it.

        Each timed graph walks through ``weights`` (the model's layers of that shape, up to MAX_TIMED), one
        product each, as a decode step does: a weight is not in the GPU's L2 cache when its product starts,
        as in the step (a product timed on one weight again and again would time the L2 cache on a GPU whose
        L2 holds it)."""
        weights = list(weights)[:MAX_TIMED]
        k = weights[0].shape[1]
        x = torch.zeros((self.max_rows, k), dtype=weights[0].dtype, device=weights[0].device)
        if not all(_takes_weight(w, x) for w in weights):
            return 0, f"F.linear ({weights[0].dtype} weights not contiguous and 16-byte aligned)"
        nbytes = weights[0].numel() * weights[0].element_size()
        n = weights[0].shape[0]

        def contest(rows_x: torch.Tensor) -> tuple[Callable, Callable]:
            turn, extra = itertools.cycle(weights), _timed_epilogue(epilogue, rows_x, n)
            return (
                lambda: self._kernel_product(rows_x, next(turn), epilogue, extra),
                lambda: self._torch_product(rows_x, next(turn), epilogue, extra),
            )

        rows, timings = self._won_rows(x, _timed_calls(len(weights), nbytes), contest)
        chosen = f"kernel for 1..{rows} rows" if rows else "F.linear"
        return rows, f"{chosen} (kernel vs F.linear: {timings})"

    def swiglu_rows(self, modules: Sequence, dtype: torch.dtype) -> tuple[int, str]:
        """For quantized fused gate/up weights of one shape (``modules``: QuantizedLinear, the model's layers of
        it), activations of ``dtype``: the largest rows bucket up to which their product in a plain launch followed
        by the ``silu_mul`` kernel took less device time than the product with the SwiGLU in its launch (0: never),
        kept for the products that follow (:meth:`__call__`); and the timings, for the log.

        Why both: the SwiGLU launch saves a launch and the 2I-wide product's round trip to memory, but its warps
        read gate and up rows together, and ptxas gives the two kernels different registers (sm_90: 80 against
        72 for INT4, 92 against 72 for INT8; sm_87 the other way round: 72 against 96 and 88), so which holds
        more blocks an SM depends on the GPU (on an H200 the SwiGLU launch won: INT4 8.6 against 10.2 us for the
        2B's gate/up, INT8 11.2 against 11.5). Which one wins is measured, as for the float weights
        (:meth:`faster_rows`, same method: the graph walks through the layers' weights)."""
        modules = list(modules)[:MAX_TIMED]
        mode, stored, group = _stored(modules[0])
        x = torch.zeros((self.max_rows, modules[0].in_features), dtype=dtype, device=stored[0].device)

        def contest(rows_x: torch.Tensor) -> tuple[Callable, Callable]:
            turn = itertools.cycle([_stored(m) for m in modules])
            return lambda: self._swiglu(rows_x, *next(turn), True), lambda: self._swiglu(rows_x, *next(turn), False)

        rows, timings = self._won_rows(x, _timed_calls(len(modules), modules[0].nbytes), contest)
        self._swiglu_apart[_signature(mode, stored, group)] = rows
        chosen = f"product then silu_mul for 1..{rows} rows" if rows else "SwiGLU in the product's launch"
        return rows, f"{chosen} (then silu_mul vs in the launch: {timings})"

    def _won_rows(
        self, x: torch.Tensor, calls: int, contest: Callable[[torch.Tensor], tuple[Callable, Callable]]
    ) -> tuple[int, str]:
        """The largest rows bucket up to which the first of ``contest(rows of x)``'s two ways took less device time
        than the second, each bucket timed on both (``calls`` calls a graph) until the first loses one (0: it lost
        the first); and the timings, for the log."""
        if self.time_us is None:
            raise ValueError("this CudaGemv was built without a timer (time_us): it cannot time weights")
        rows, timings = 0, []
        for bucket in L.GEMV_ROW_BUCKETS:
            first, second = contest(x[:bucket])
            try:
                ours, theirs = self.time_us(first, calls=calls), self.time_us(second, calls=calls)
            except Exception as exc:  # noqa: BLE001 - a product that cannot be timed keeps what was measured
                timings.append(f"{bucket} rows not timed: {type(exc).__name__}: {exc}")
                break
            timings.append(f"{bucket} row{'s' * (bucket > 1)} {ours:.1f} vs {theirs:.1f} us")
            if ours >= theirs:
                break
            rows = bucket
        return rows, ", ".join(timings)

    def _product(
        self,
        x: torch.Tensor,
        mode: str,
        stored: tuple,
        group: int,
        swiglu: bool,
        epilogue: _NormEpilogue | _HeadsEpilogue | None = None,
    ) -> torch.Tensor:
        """Launch ``gemv_<mode>[_swiglu]`` on x (L, K) and the stored weight (weight or qweight, scales, offsets),
        once for every max_rows rows; each launch with ``epilogue`` over its rows when given."""
        x = x.contiguous()
        rows, k = x.shape
        n = stored[0].shape[0]
        expected = k if mode != "int4" else -(-k // 2)
        if stored[0].shape[1] != expected:
            raise ValueError(f"x has {k} columns, the weight is {tuple(stored[0].shape)} ({mode})")
        if swiglu and n % 2:
            raise ValueError(f"a SwiGLU product needs gate and up rows alike, the weight has {n} rows")
        n //= 1 + swiglu
        y = torch.empty((rows, n), dtype=x.dtype, device=x.device)
        for first in range(0, rows, self.max_rows):
            piece = min(self.max_rows, rows - first)
            cfg = L.gemv_launch(mode, piece, n, k, x.dtype, swiglu)
            pointers, sizes = [None] * 13, [0, 0, 0, 0.0]
            if epilogue is not None:
                pointers, sizes = epilogue.arguments(first, self._counters_on(x.device)), epilogue.sizes()
            self.launcher.launch(cfg, [y[first:], x[first:], *stored, *pointers, piece, n, k, group, *sizes])
        return y

    def _counters_on(self, device: torch.device) -> torch.Tensor:
        """The epilogues' finish counters on ``device`` (COUNTERS uint32; kernels/gemv.cuh)."""
        counters = self._counters.get(str(device))
        if counters is None:
            counters = self._counters[str(device)] = torch.zeros(COUNTERS, dtype=torch.int32, device=device)
        return counters

    def _kernel_product(self, x: torch.Tensor, weight: torch.Tensor, epilogue: str, extra: tuple) -> torch.Tensor:
        """A float product through the kernel with what follows it in the decoder (``faster_rows``; ``extra``:
        ``_timed_epilogue``'s): its epilogue, or with ``norm_epilogue`` off the product then the ``add_rms_norm``
        or ``rms_norm_rope`` kernel."""
        stored = ("float", (weight, None, None), 0)
        kind = epilogue.partition(" ")[0]
        if kind not in ("norm", "heads"):
            return self._product(x, *stored, kind == "swiglu")
        if not self.norm_epilogue:
            return self._after(kind, self._product(x, *stored, False), extra)
        if kind == "norm":
            return self._product_add_norm(x, *stored, *extra)[1]
        return self._product_heads(x, *stored, *extra)[0]

    def _torch_product(self, x: torch.Tensor, weight: torch.Tensor, epilogue: str, extra: tuple) -> torch.Tensor:
        """What a product takes without the kernel: ``F.linear``, then what the epilogue would run."""
        return self._after(epilogue.partition(" ")[0], F.linear(x, weight), extra)

    def _after(self, kind: str, y: torch.Tensor, extra: tuple) -> torch.Tensor:
        """What the decoder launches after a product ``y`` where the epilogue ``kind`` does not run."""
        if kind == "swiglu":
            return self._fused.silu_mul(y)
        if kind == "norm":
            return self._fused.add_rms_norm(extra[0], y, *extra[1:])[1]
        return self._fused.norm_rope_product(y, *extra)[0] if kind == "heads" else y


def _chain_weights(modules: list, x: torch.Tensor, hidden: int) -> tuple[str, list, int, int]:
    """The weights of a chained launch of the row ``x``: ``modules`` the MLP's gate/up and down projections, or the o
    projection (A = x's columns to D = ``hidden``) and those (D to 2I, I to D), stored alike; (mode, each weight's
    tensors as the kernels take them, group, I). ValueError for another row count, storage or shape."""
    stored = [_stored(m) for m in modules]
    mode, _, group = stored[0]
    inter = stored[-2][1][0].shape[0] // 2
    columns = (lambda k: -(-k // 2)) if mode == "int4" else (lambda k: k)
    shapes = [(2 * inter, columns(hidden)), (hidden, columns(inter))]
    if len(modules) == 3:
        shapes.insert(0, (hidden, columns(x.shape[1])))
    got = [tuple(s[1][0].shape) for s in stored]
    if x.shape[0] != 1 or {s[::2] for s in stored} != {(mode, group)} or got != shapes:
        raise ValueError(
            f"a chained launch takes one row and weights stored alike, {' then '.join(map(str, shapes))}; got "
            f"{x.shape[0]} rows and {', '.join(f'{s[0]} {g}' for s, g in zip(stored, got, strict=True))}"
        )
    return mode, [s[1] for s in stored], group, inter


def _norm_epilogue(x: torch.Tensor, n: int, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> _NormEpilogue:
    """The norm epilogue of a product of rows ``x`` with ``n`` outputs into ``residual`` (L, n) with the norm
    ``weight`` (n,), its outputs allocated; ValueError for a residual or weight of another shape or dtype."""
    if residual.shape != (x.shape[0], n) or weight.shape != (n,) or {residual.dtype, weight.dtype} != {x.dtype}:
        raise ValueError(
            f"a norm epilogue adds ({x.shape[0]}, {n}) rows with a ({n},) weight in {x.dtype}, got "
            f"{tuple(residual.shape)} {residual.dtype} and {tuple(weight.shape)} {weight.dtype}"
        )
    residual = residual.contiguous()
    return _NormEpilogue(residual, weight.contiguous(), torch.empty_like(residual), torch.empty_like(residual), eps)


def _timed_epilogue(epilogue: str, x: torch.Tensor, n: int) -> tuple:
    """What a timed product's epilogue (``faster_rows``) works with, after the product's rows ``x`` (L, K) of
    ``n`` outputs: for ``"norm"`` the residual stream it adds to, the norm weight and epsilon; for ``"heads
    <q heads> <head_dim>"`` the q and k norms, RoPE tables and a KV sink for the rows (the time depends on none
    of their values); else nothing."""
    kind, *sizes = epilogue.split() or [""]
    rows = x.shape[0]
    if kind == "norm":
        return x.new_zeros((rows, n)), x.new_ones((n,)), NORM_EPS
    if kind != "heads":
        return ()
    split, dim = (int(s) for s in sizes)
    norms = HeadNorms(x.new_ones((dim,)), x.new_ones((dim,)), split, NORM_EPS)
    tables = TextRopeTables.build(x.new_ones((rows, dim)), x.new_zeros((rows, dim)))
    pools = x.new_zeros((2, 1, rows, norms.kv_heads(n), dim))
    slots = torch.arange(rows, device=x.device)
    return norms, tables, KVSink(pools[0], pools[1], slots)


def _timed_calls(weights: int, nbytes: int) -> int:
    """Products in one timed graph of ``weights`` distinct weights of ``nbytes`` each: every weight, and enough
    calls of a small one to time it."""
    return max(weights, min(MAX_TIMED, TIMING_BYTES // nbytes))


def _signature(mode: str, stored: tuple, group: int) -> tuple:
    """What a weight's timed decisions are kept by: its format, stored shape and group size."""
    return mode, tuple(stored[0].shape), group


def _stored(module) -> tuple[str, tuple, int]:
    """How a QuantizedLinear or GemvLinear ``module`` stores its weight, as the kernels take it: (mode, (weight or
    qweight, scales, offsets), group size)."""
    if module.mode == "float":
        return "float", (module.matrix, None, None), 0
    offsets = module.offsets if module.mode == "int4" else None
    return module.mode, (module.qweight, module.scales, offsets), module.group_size


def _takes_weight(weight: torch.Tensor, x: torch.Tensor) -> bool:
    """A float weight the kernel reads in place: x's dtype and device, contiguous rows, 16-byte aligned."""
    return (
        weight.dtype == x.dtype and weight.device == x.device and weight.is_contiguous() and weight.data_ptr() % 16 == 0
    )
