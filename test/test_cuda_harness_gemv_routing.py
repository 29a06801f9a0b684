"""Which projections of a model take the GEMV kernels (``kernels/gemv.cuh``, under the CPU CUDA emulator), and
what the model then computes: quantized weights always, float ones for the row buckets the device timing gave
them (a stand-in timer here), a SwiGLU weight timed with its activation on both sides, a quantized LM head, decode
rows to the kernels and a prefill's to torch; a model routed to the kernels computes what it computed before,
and detaching restores it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from cuda_harness.harness import RecordingLauncher

from orin_vlm_node.cuda import launch as L
from orin_vlm_node.cuda.gemv import CudaGemv
from orin_vlm_node.model.text import takes_swiglu
from orin_vlm_node.weights import load_model
from orin_vlm_node.weights.gemv_linear import GemvLinear
from orin_vlm_node.weights.projections import ProjectionBuilder, ProjectionKernels, rebuild_projections
from orin_vlm_node.weights.quant import QuantizedLinear, WeightQuant
from orin_vlm_node.weights.sites import projection_sites
from support.checkpoints import cached_tiny_checkpoint
from support.random_weights import random_quantized


def gemv_builder(model, kernels: CudaGemv, use_cuda_graph: bool = True) -> ProjectionBuilder:
    """The builder of ``model``'s projections for the GEMV kernels ``kernels``."""
    return ProjectionBuilder(ProjectionKernels(gemv=kernels, use_cuda_graph=use_cuda_graph), model.dtype)


def _module(mode: str, n: int, k: int, group: int, dtype: torch.dtype, kernels: CudaGemv):
    """A projection of n x k of ``mode`` whose products the kernels compute."""
    if mode == "float":
        linear = torch.nn.Linear(k, n, bias=False).to(dtype)
        with torch.no_grad():
            linear.weight.copy_(torch.randn(n, k, generator=torch.Generator().manual_seed(n + k)) * 0.05)
        return GemvLinear(linear, kernels, rows=8)
    module = random_quantized(n, k, mode, group, seed=n + k)
    module.kernels = kernels
    return module


# (head_dim, q heads, kv heads): Qwen3-VL's GQA of 2 at a small head size; one kv head; heads of 24, which
# the 16 columns of an int4 block (8 of int8) do not divide, so a block computes parts of two heads.
HEAD_SHAPES = [(32, 4, 2, 64), (64, 2, 1, 64), (24, 6, 3, 64), (32, 4, 2, 3072)]  # dim, q heads, kv heads, K


def _timer(launcher: RecordingLauncher, kernel_wins_up_to: int):
    """A stand-in for the device timing: runs the product once and says the GEMV kernel took 1 us for up to
    ``kernel_wins_up_to`` rows and 3 us above, torch 2 us."""

    def time_us(fn, calls):
        before = len(launcher.kernels)
        rows = fn().shape[0]
        if not _gemv_launched(launcher, before):
            return 2.0
        return 1.0 if rows <= kernel_wins_up_to else 3.0

    return time_us


def _gemv_launched(launcher: RecordingLauncher, since: int) -> bool:
    return any(k.startswith("gemv_") for k in launcher.kernels[since:])


def test_a_float_weight_takes_the_kernel_for_the_row_buckets_it_won_and_says_so(harness):
    launcher = RecordingLauncher(harness)
    weight = torch.randn(40, 64)
    rows, why = CudaGemv(launcher, _timer(launcher, 2)).faster_rows([weight])
    assert rows == 2  # 1 and 2 rows won, 4 lost: 8 not timed
    assert (
        why
        == "kernel for 1..2 rows (kernel vs F.linear: 1 row 1.0 vs 2.0 us, 2 rows 1.0 vs 2.0 us, 4 rows 3.0 vs 2.0 us)"
    )
    assert launcher.kernels == ["gemv_float_f32_r1", "gemv_float_f32_r2", "gemv_float_f32_r4"]
    assert CudaGemv(launcher, _timer(launcher, 0)).faster_rows([weight])[0] == 0
    assert CudaGemv(launcher, _timer(launcher, 8)).faster_rows([weight])[0] == 8
    not_contiguous = CudaGemv(launcher, _timer(launcher, 8)).faster_rows([weight.t()])
    assert not_contiguous[0] == 0 and not_contiguous[1].startswith("F.linear (")

    def failing(fn, calls):
        raise RuntimeError("capture failed")

    assert CudaGemv(launcher, failing).faster_rows([weight]) == (
        0,
        "F.linear (kernel vs F.linear: 1 rows not timed: RuntimeError: capture failed)",
    )


def test_a_swiglu_weight_is_timed_with_its_activation_on_both_sides(harness):
    """The SwiGLU launch against what the MLP runs without it: F.linear, then the silu_mul kernel."""
    launcher = RecordingLauncher(harness)
    rows, why = CudaGemv(launcher, _timer(launcher, 1)).faster_rows([torch.randn(40, 64)], swiglu=True)
    assert rows == 1 and why.startswith("kernel for 1..1 rows (kernel vs F.linear: 1 row 1.0 vs 2.0 us")
    assert launcher.kernels == ["gemv_float_swiglu_f32_r1", "silu_mul_f32", "gemv_float_swiglu_f32_r2", "silu_mul_f32"]


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_a_quantized_swiglu_runs_apart_for_the_rows_where_that_measured_faster_to_the_bit(harness, mode):
    """A quantized gate/up shape is timed with the SwiGLU in the product's launch against the plain product then
    the silu_mul kernel, walking through its layers' weights; for the row buckets the second won its products
    take it, with the first's results to the bit (the kernel rounds each sum to the dtype first, as silu_mul
    reads them), and the other rows and shapes keep the one launch."""
    launcher = RecordingLauncher(harness)
    weights = [torch.randn(2 * 24, 96) for _ in range(3)]
    modules = [QuantizedLinear.from_weight(w, WeightQuant(mode, 32)) for w in weights]
    timed: list[tuple[int, bool]] = []

    def time_us(fn, calls):  # the product then silu_mul 1 us up to 2 rows, the SwiGLU launch always 2 us
        before = len(launcher.kernels)
        rows = fn().shape[0]
        apart = "silu_mul" in " ".join(launcher.kernels[before:])
        timed.append((rows, apart))
        return (1.0 if rows <= 2 else 3.0) if apart else 2.0

    gemv = CudaGemv(launcher, time_us)
    x = torch.randn(8, 96)
    want = {rows: gemv(modules[0], x[:rows], swiglu=True) for rows in (1, 2, 4)}  # before timing: one launch
    rows, why = gemv.swiglu_rows(modules, torch.float32)
    assert rows == 2 and timed == [(1, True), (1, False), (2, True), (2, False), (4, True), (4, False)]
    assert why == ("product then silu_mul for 1..2 rows (then silu_mul vs in the launch: 1 row 1.0 vs 2.0 us, "
                   "2 rows 1.0 vs 2.0 us, 4 rows 3.0 vs 2.0 us)")  # fmt: skip
    for n, expected in want.items():
        launcher.kernels.clear()
        assert torch.equal(gemv(modules[0], x[:n], swiglu=True), expected)
        if n <= 2:
            assert launcher.kernels == [f"gemv_{mode}_f32_r{n}", "silu_mul_f32"]
        else:
            assert launcher.kernels == [f"gemv_{mode}_swiglu_f32_r{n}"]
    other = QuantizedLinear.from_weight(torch.randn(2 * 16, 96), WeightQuant(mode, 32))  # a shape not timed
    launcher.kernels.clear()
    gemv(other, x[:1], swiglu=True)
    assert launcher.kernels == [f"gemv_{mode}_swiglu_f32_r1"]


def test_a_timed_graph_walks_through_the_weights_of_the_shape_as_a_decode_step_does(harness):
    """One product per weight in turn (layers' weights are not in L2 when their product starts), as many
    products as the timing's byte budget asks for, at most 16."""
    weights = [torch.randn(8, 32) for _ in range(3)]
    read: list[int] = []

    class WeightsRead(RecordingLauncher):
        def launch(self, cfg, args):
            read.append(args[2].data_ptr())
            super().launch(cfg, args)

    calls_asked: list[int] = []

    def time_us(fn, calls):
        calls_asked.append(calls)
        for _ in range(calls):
            fn()
        return 1.0  # a tie: the kernel is not faster, so only one row is timed

    assert CudaGemv(WeightsRead(harness), time_us).faster_rows(weights)[0] == 0
    assert calls_asked == [16, 16]
    assert read == [w.data_ptr() for w in weights] * 5 + [weights[0].data_ptr()]


def _assert_timed_and_described(mode: str, timed: list, keys: set, what: str, floats: int, n_sites: int) -> None:
    """Each (shape, epilogue) key timed once per row bucket, and the startup line says what was routed."""
    swiglus = 2 if mode == "int4" else 0  # the quantized gate/up shape: its two ways tie at one row, so it stops
    assert len(timed) == 2 * len(L.GEMV_ROW_BUCKETS) * len(keys) + swiglus  # every bucket won: each key timed once
    assert ("+ SwiGLU: kernel for 1..8 rows" in what) == (mode == "none")
    tie = "+ SwiGLU: SwiGLU in the product's launch (then silu_mul vs in the launch: 1 row 1.0 vs 1.0 us)"
    assert (tie in what) == (mode == "int4")
    assert what.startswith("GEMV kernels for decode rows: ")
    assert f"{floats} of {floats} float ones" in what
    assert (f"{n_sites - 1} quantized projections" in what) == (mode == "int4")


@pytest.mark.parametrize("mode", ["none", "int4"])
def test_a_model_routed_to_the_kernels_computes_what_it_computed_and_detaching_restores_it(harness, mode):
    """A tiny model in fp32: each float shape timed once; a forward of one token (a decode step's rows) runs
    every projection and the head through the kernels, one of 20 tokens (a prefill) only the last layer's o
    product and MLP and the head (the last token's rows; INT4 weights of the other products widened by a kernel
    for torch's), and both give the logits the model gave before; None
    puts back the modules as loaded;
    without CUDA graphs the float weights are not timed and stay as loaded."""
    from orin_vlm_node.engine import Engine, EngineConfig

    path = cached_tiny_checkpoint()
    cache = Engine(EngineConfig(model_path=str(path), device="cpu", max_sessions=0)).parts.cache
    # The LM head stays float: a model with both quantized and float weights to route.
    model = load_model(path, quant=WeightQuant(mode, 32, lm_head=False) if mode != "none" else None)
    sites = [(site.parent, site.attr) for site in projection_sites(model).values()]
    loaded = [getattr(parent, attr) for parent, attr in sites]

    def logits(tokens: int) -> torch.Tensor:
        seq = cache.new_sequence()
        ids = torch.arange(5, 5 + tokens)
        out = model.forward(ids, torch.arange(tokens).expand(3, -1), cache.step(seq, tokens))
        cache.release(seq)
        return out

    want = {tokens: logits(tokens) for tokens in (1, 20)}
    launcher = RecordingLauncher(harness)
    timed: list[tuple] = []

    def time_us(fn, calls):
        before = len(launcher.kernels)
        timed.append(tuple(fn().shape))
        return 1.0 if _gemv_launched(launcher, before) else 2.0

    what = rebuild_projections(model, gemv_builder(model, CudaGemv(launcher, time_us)))
    floats = 1 if mode == "int4" else len(sites)
    epilogue = [takes_swiglu(parent, attr) for parent, attr in sites]
    keys = {
        (tuple(m.weight.shape), e)
        for m, e in zip(loaded, epilogue, strict=True)
        if isinstance(getattr(m, "weight", None), torch.Tensor)
    }
    _assert_timed_and_described(mode, timed, keys, what, floats, len(sites))
    routed = [getattr(parent, attr) for parent, attr in sites]
    kinds = [QuantizedLinear] * (len(sites) - 1) if mode == "int4" else [GemvLinear] * (len(sites) - 1)
    assert [type(m) for m in routed] == [*kinds, GemvLinear]
    assert all(m.kernels is not None for m in routed)
    assert routed[-1].matrix is model.language_model.embed_tokens.weight  # the tied head: no copy
    launcher.kernels.clear()
    torch.testing.assert_close(logits(1), want[1], rtol=1e-4, atol=1e-5)
    stored = "int4" if mode == "int4" else "float"  # the gate/up products with the activation in the kernel
    epilogues = ["_swiglu" if e else "" for e in epilogue[:-1]]
    assert launcher.kernels == [f"gemv_{stored}{e}_f32_r1" for e in epilogues] + ["gemv_float_f32_r1"]
    assert epilogues.count("_swiglu") == model.config.text.num_hidden_layers
    launcher.kernels.clear()
    torch.testing.assert_close(logits(20), want[20], rtol=1e-4, atol=1e-5)  # a prefill: torch's products (on
    # INT4 weights widened by a launch each), but for the last layer's o product and MLP and the head: the last
    # token's rows only, the rows of a decode step
    layers = model.config.text.num_hidden_layers
    widened = ["widen_int4_f32"] * (4 * (layers - 1) + 1) if mode == "int4" else []
    tail = [f"gemv_{stored}_f32_r1", f"gemv_{stored}_swiglu_f32_r1", f"gemv_{stored}_f32_r1"]
    assert launcher.kernels == [*widened, *tail, "gemv_float_f32_r1"]
    assert rebuild_projections(model, ProjectionBuilder(ProjectionKernels(), model.dtype)) == ""
    assert all(getattr(parent, attr) is m for (parent, attr), m in zip(sites, loaded, strict=True))
    assert all(m.kernels is None for m in model.modules() if isinstance(m, QuantizedLinear))
    timed.clear()  # a decode without CUDA graphs: float weights stay on torch, untimed
    what = rebuild_projections(model, gemv_builder(model, CudaGemv(launcher, time_us), use_cuda_graph=False))
    assert what.endswith(f"float ones: F.linear ({floats}; decode not in CUDA graphs)") and not timed
    assert all(getattr(parent, attr) is m for (parent, attr), m in zip(sites, loaded, strict=True))


def test_a_quantized_lm_head_takes_the_kernels_and_the_model_computes_what_it_computed(harness):
    path = cached_tiny_checkpoint()
    model = load_model(path, quant=WeightQuant("int8"))  # the LM head quantized too (tied: a copy)
    from orin_vlm_node.engine import Engine, EngineConfig

    cache = Engine(EngineConfig(model_path=str(path), device="cpu", max_sessions=0)).parts.cache
    ids = torch.arange(5, 25)  # 20 tokens: more rows than the kernels take

    def logits() -> torch.Tensor:
        seq = cache.new_sequence()
        out = model.forward(ids, torch.arange(len(ids)).expand(3, -1), cache.step(seq, len(ids)))
        cache.release(seq)
        return out

    want = logits()
    launcher = RecordingLauncher(harness)
    what = rebuild_projections(
        model, gemv_builder(model, CudaGemv(launcher, _timer(launcher, 8)))
    )  # the SwiGLU's two ways tie: in the launch
    projections = 4 * model.config.text.num_hidden_layers
    assert what.startswith(f"GEMV kernels for decode rows: {projections} quantized projections + int8 LM head; ")
    assert what.endswith("SwiGLU: SwiGLU in the product's launch (then silu_mul vs in the launch: 1 row 1.0 vs 1.0 us)")
    launcher.kernels.clear()
    torch.testing.assert_close(logits(), want, rtol=1e-4, atol=1e-5)
    # a prefill: torch's products, but the last layer's o product and MLP and the head for the last row
    assert launcher.kernels == ["gemv_int8_f32_r1", "gemv_int8_swiglu_f32_r1", "gemv_int8_f32_r1", "gemv_int8_f32_r1"]


def test_a_quantized_projection_routes_decode_rows_to_the_kernels_and_prefill_to_torch(harness):
    module = random_quantized(48, 128, "int4", 32, seed=1)
    launcher = RecordingLauncher(harness)
    module.kernels = CudaGemv(launcher)
    x = torch.randn(20, 128)
    torch.testing.assert_close(module(x[:4]), F.linear(x[:4], module.dequantize(torch.float32)))
    assert launcher.kernels == ["gemv_int4_f32_r4"]
    module(x)  # 20 rows: a prefill, torch's GEMM on the weight widened by a kernel
    assert launcher.kernels == ["gemv_int4_f32_r4", "widen_int4_f32"]
