"""The CPU's float projections through the CPU GEMM kernels: which modules take them, which kernel a row count
takes, a model that computes what the float model computes (torch math), and the engine saying which path it
took and why."""

from __future__ import annotations

from unittest import mock

import pytest
import torch

from orin_vlm_node.cpu import cpu_gemm_for, load_cpu_gemm
from orin_vlm_node.cpu.gemm import native_bf16
from orin_vlm_node.engine import Engine, EngineConfig, Request, SamplingParams, Turn
from orin_vlm_node.settings import BY_NAME
from orin_vlm_node.weights import load_model
from orin_vlm_node.weights.cpu_linear import KERNEL_ROWS, ONE_CALL_ELEMENTS, CpuLinear
from orin_vlm_node.weights.projections import ProjectionBuilder, ProjectionKernels, rebuild_projections
from orin_vlm_node.weights.quant import weight_bytes
from support.checkpoints import cached_tiny_checkpoint

torch.set_num_threads(1)
CPU = torch.device("cpu")


@pytest.mark.parametrize("tie", [True, False])
def test_every_decoder_projection_and_the_head_take_the_kernel_without_a_copy(tie, cpu_kernel_cache):
    model = load_model(cached_tiny_checkpoint(tie=tie))
    before = weight_bytes(model)
    layers = model.language_model.layers
    weights = [getattr(getattr(layer, s), a).weight for layer in layers for s, a in layer.PROJECTIONS]
    what = rebuild_projections(
        model, ProjectionBuilder(ProjectionKernels(cpu_gemm=load_cpu_gemm(cache_dir=cpu_kernel_cache)), model.dtype)
    )
    assert what.startswith(f"CPU GEMM kernels, few rows for 1..16, many rows above ({4 * len(layers)} projections")
    assert weight_bytes(model) == before
    routed = [getattr(getattr(layer, s), a) for layer in layers for s, a in layer.PROJECTIONS]
    assert all(isinstance(m, CpuLinear) for m in routed)
    assert all(m.matrix is w for m, w in zip(routed, weights, strict=True))  # the same tensors
    assert isinstance(model.lm_head, CpuLinear)
    assert (model.lm_head.matrix is model.language_model.embed_tokens.weight) == tie


def test_only_fp32_and_bf16_on_the_cpu_take_the_kernel():
    assert cpu_gemm_for(CPU, torch.float16) == (None, "float16 weights; the CPU GEMM kernels take fp32 and bf16")
    assert cpu_gemm_for(torch.device("cuda"), torch.float32) == (None, "not a CPU: cuda")


@pytest.mark.parametrize("rows", [1, 3, 8, 9, 16, 17, 40])  # decode batches (few rows), then prefills (many)
@pytest.mark.parametrize("name,dtype", [("fp32", torch.float32), ("bf16", torch.bfloat16)])
def test_a_model_with_the_kernel_computes_what_the_float_model_computes(rows, name, dtype, cpu_kernel_cache):
    path = cached_tiny_checkpoint()
    engine = Engine(EngineConfig(model_path=str(path), device="cpu", dtype=name))
    routed, reference = load_model(path, dtype=dtype), load_model(path, dtype=dtype)
    rebuild_projections(
        routed, ProjectionBuilder(ProjectionKernels(cpu_gemm=load_cpu_gemm(cache_dir=cpu_kernel_cache)), routed.dtype)
    )
    ids = (engine.parts.tokenizer.encode("Where is the charging station? Count the boxes on the shelf.") * 4)[:rows]
    positions = torch.arange(len(ids)).expand(3, -1)
    logits = []
    for model in (routed, reference):
        seq = engine.parts.cache.new_sequence()
        logits.append(model.forward(torch.tensor(ids), positions, engine.parts.cache.step(seq, len(ids))))
        engine.parts.cache.release(seq)
    tolerance = dict(rtol=1e-4, atol=1e-5) if dtype == torch.float32 else dict(rtol=0.05, atol=0.05)
    torch.testing.assert_close(logits[0], logits[1], **tolerance)


def test_the_engine_says_which_path_and_falls_back_without_a_compiler(tmp_path, monkeypatch):
    cfg = EngineConfig(model_path=str(cached_tiny_checkpoint()), device="cpu", kernel_cache_dir=str(tmp_path))
    request = Request(Turn("Hello."), SamplingParams(temperature=0.0, max_new_tokens=8))
    engine = Engine(cfg)
    assert engine.describe()["weight_path"].startswith("float weights: CPU GEMM kernels, few rows for 1..16")
    tokens = list(engine.generate(request))[-1]
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    fallback = Engine(cfg)
    assert fallback.describe()["weight_path"] == (
        f"float weights: F.linear (CPU GEMM kernels unavailable: CXX={str(tmp_path / 'no-such-compiler')!r} "
        "is not an executable)"
    )
    again = list(fallback.generate(request))[-1]
    assert again.error is None and again.token_ids == tokens.token_ids


def test_every_decode_batch_the_engine_can_form_takes_the_kernel():
    assert BY_NAME["max_batch"].max <= KERNEL_ROWS


@pytest.mark.parametrize("name,dtype", [("fp32", torch.float32), ("bf16", torch.bfloat16)])
def test_rows_of_a_kernel_call_in_pieces_are_bit_identical_to_each_row_alone(name, dtype, cpu_kernel_cache):
    gemm = load_cpu_gemm(cache_dir=cpu_kernel_cache)
    generator = torch.Generator().manual_seed(3)
    linear = CpuLinear(_linear(torch.randn(300, 96, generator=generator).to(dtype)), gemm)
    x = torch.randn(KERNEL_ROWS, 96, generator=generator).to(dtype)
    together = linear(x)
    alone = torch.cat([linear(x[i : i + 1]) for i in range(KERNEL_ROWS)])
    assert torch.equal(together, alone)


def _kernel_calls(linear: CpuLinear, x: torch.Tensor) -> tuple[torch.Tensor, list[str]]:
    """``linear(x)`` and what it called: the kernels (ctypes calls, counted through wrapping mocks), then
    torch's GEMM ops (from the profiler)."""
    product = linear.product
    with (
        mock.patch.object(product, "few_rows", wraps=product.few_rows) as few,
        mock.patch.object(product, "many_rows", wraps=product.many_rows) as many,
        torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof,
    ):
        out = linear(x)
    torch_ops = [e.name for e in prof.events() if e.name in ("aten::linear", "aten::mm")]
    return out, ["few_rows"] * few.call_count + ["many_rows"] * many.call_count + torch_ops


@pytest.mark.parametrize("rows", [17, 64, 200])  # one group tail, whole groups, past a block of 192 rows
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_prefill_through_a_large_weight_is_the_many_rows_kernel_computing_the_fp32_product(
    rows, dtype, cpu_kernel_cache
):
    generator = torch.Generator().manual_seed(5)
    n, k = 300, ONE_CALL_ELEMENTS // 300 + 8  # more than ONE_CALL_ELEMENTS: the kernel for fp32 too
    gemm = load_cpu_gemm(cache_dir=cpu_kernel_cache)
    gemm.torch_bf16_prefill = False  # a CPU without bf16 arithmetic
    linear = CpuLinear(_linear(torch.randn(n, k, generator=generator).to(dtype)), gemm)
    x = torch.randn(rows, k, generator=generator).to(dtype)
    got, calls = _kernel_calls(linear, x)
    assert calls == ["many_rows"]
    reference = (x.double() @ linear.matrix.double().t()).to(dtype)  # torch math in float64, rounded once
    assert got.dtype == dtype and got.shape == (rows, n)
    tolerance = dict(rtol=1e-5, atol=1e-4) if dtype == torch.float32 else dict(rtol=8e-3, atol=8e-3)
    torch.testing.assert_close(got, reference, **tolerance)


@pytest.mark.parametrize(
    "dtype,native_bf16,rows,calls",
    [
        (torch.float32, False, 53, ["aten::linear", "aten::mm"]),  # fits the cache: torch's GEMM, one call
        (torch.bfloat16, False, 53, ["many_rows"]),  # no bf16 arithmetic: torch's bf16 GEMM is 8x slower
        (torch.bfloat16, True, 53, ["aten::linear", "aten::mm"]),  # bf16 arithmetic: torch's GEMM is faster
        (torch.bfloat16, True, 16, ["few_rows", "few_rows"]),  # a decode batch: the kernel either way
        (torch.float32, False, 16, ["few_rows", "few_rows"]),  # a decode batch: pieces of the few-rows kernel
    ],
)
def test_which_path_a_small_weight_takes(dtype, native_bf16, rows, calls, cpu_kernel_cache):
    generator = torch.Generator().manual_seed(7)
    w = torch.randn(768, 128, generator=generator).to(dtype)
    gemm = load_cpu_gemm(cache_dir=cpu_kernel_cache)
    gemm.torch_bf16_prefill = native_bf16
    linear = CpuLinear(_linear(w), gemm)
    x = torch.randn(rows, 128, generator=generator).to(dtype)
    got, called = _kernel_calls(linear, x)
    assert called == calls
    torch.testing.assert_close(got.float(), torch.nn.functional.linear(x.float(), w.float()), rtol=2e-2, atol=2e-2)


CPUINFO = {
    "x86 with avx512_bf16": ("processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f avx512_bf16 avx512_vnni\n", True),
    "x86 with amx_bf16": ("flags\t\t: avx2 amx_tile amx_bf16\n", True),
    "x86 without": ("flags\t\t: fpu sse2 avx2 fma avx512f\n", False),
    "arm with bf16": ("Features\t: fp asimd sve bf16 i8mm\n", True),
    "Jetson Orin (A78AE)": ("Features\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp\n", False),
    "nothing": ("", False),
}


@pytest.mark.parametrize("name", CPUINFO)
def test_native_bf16_is_read_from_the_cpus_flags(name):
    text, expected = CPUINFO[name]
    assert native_bf16(text) is expected


def test_a_bf16_model_on_a_cpu_with_bf16_arithmetic_prefills_through_torch_and_says_so(cpu_kernel_cache):
    gemm = load_cpu_gemm(cache_dir=cpu_kernel_cache)
    gemm.torch_bf16_prefill = True
    model = load_model(cached_tiny_checkpoint(), dtype=torch.bfloat16)
    assert "torch's GEMM above (this CPU has bf16 arithmetic)" in rebuild_projections(
        model, ProjectionBuilder(ProjectionKernels(cpu_gemm=gemm), model.dtype)
    )
    assert all(m.torch_prefill for m in model.modules() if isinstance(m, CpuLinear))


def _linear(weight: torch.Tensor) -> torch.nn.Linear:
    """A bias-free projection of ``weight`` (N, K), as the loader builds one."""
    linear = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
    linear.weight = torch.nn.Parameter(weight, requires_grad=False)
    return linear
