"""The CPU's float projections through the few-rows GEMM: which modules take it, a model that computes what
the float model computes (torch math), and the engine saying which path it took and why."""

from __future__ import annotations

import pytest
import torch

from orin_vlm_node.cpu import few_rows_gemm_for, load_few_rows_gemm
from orin_vlm_node.engine import Engine, EngineConfig, Request, SamplingParams, Turn
from orin_vlm_node.model import load_model
from orin_vlm_node.model.cpu_linear import (
    BLOCK_ROWS,
    KERNEL_ROWS,
    ONE_CALL_ELEMENTS,
    FewRowsLinear,
    blocked_linear,
    use_few_rows_gemm,
)
from orin_vlm_node.model.quant import weight_bytes
from orin_vlm_node.settings import BY_NAME
from support.checkpoints import cached_tiny_checkpoint

torch.set_num_threads(1)
CPU = torch.device("cpu")


@pytest.mark.parametrize("tie", [True, False])
def test_every_decoder_projection_and_the_head_take_the_kernel_without_a_copy(tie, tmp_path):
    model = load_model(cached_tiny_checkpoint(tie=tie))
    before = weight_bytes(model)
    layers = model.language_model.layers
    weights = [getattr(getattr(layer, s), a).weight for layer in layers for s, a in layer.PROJECTIONS]
    what = use_few_rows_gemm(model, load_few_rows_gemm(cache_dir=str(tmp_path)))
    assert what.startswith(f"few-rows GEMM for 1..16 rows ({4 * len(layers)} projections + LM head")
    assert what.endswith("torch's GEMM on 256-row weight blocks for more")
    assert weight_bytes(model) == before
    routed = [getattr(getattr(layer, s), a) for layer in layers for s, a in layer.PROJECTIONS]
    assert all(isinstance(m, FewRowsLinear) for m in routed)
    assert all(m.matrix is w for m, w in zip(routed, weights, strict=True))  # the same tensors
    assert isinstance(model.lm_head, FewRowsLinear)
    assert (model.lm_head.matrix is model.language_model.embed_tokens.weight) == tie


def test_only_fp32_and_bf16_on_the_cpu_take_the_kernel():
    assert few_rows_gemm_for(CPU, torch.float16) == (None, "float16 weights; the few-rows kernel takes fp32 and bf16")
    assert few_rows_gemm_for(torch.device("cuda"), torch.float32) == (None, "not a CPU: cuda")


@pytest.mark.parametrize("rows", [1, 3, 8, 9, 16, 17, 40])  # decode batches (kernel), then prefills (blocked)
@pytest.mark.parametrize("name,dtype", [("fp32", torch.float32), ("bf16", torch.bfloat16)])
def test_a_model_with_the_kernel_computes_what_the_float_model_computes(rows, name, dtype, tmp_path):
    path = cached_tiny_checkpoint()
    engine = Engine(EngineConfig(model_path=str(path), device="cpu", dtype=name))
    routed, reference = load_model(path, dtype=dtype), load_model(path, dtype=dtype)
    use_few_rows_gemm(routed, load_few_rows_gemm(cache_dir=str(tmp_path)))
    ids = (engine.tokenizer.encode("Where is the charging station? Count the boxes on the shelf.") * 4)[:rows]
    positions = torch.arange(len(ids)).expand(3, -1)
    logits = []
    for model in (routed, reference):
        seq = engine.cache.new_sequence()
        logits.append(model.forward(torch.tensor(ids), positions, engine.cache.step(seq, len(ids))))
        engine.cache.release(seq)
    tolerance = dict(rtol=1e-4, atol=1e-5) if dtype == torch.float32 else dict(rtol=0.05, atol=0.05)
    torch.testing.assert_close(logits[0], logits[1], **tolerance)


def test_the_engine_says_which_path_and_falls_back_without_a_compiler(tmp_path, monkeypatch):
    cfg = EngineConfig(model_path=str(cached_tiny_checkpoint()), device="cpu", kernel_cache_dir=str(tmp_path))
    request = Request(Turn("Hello."), SamplingParams(temperature=0.0, max_new_tokens=8))
    engine = Engine(cfg)
    assert engine.describe()["weight_path"].startswith("float weights: few-rows GEMM for 1..16 rows")
    tokens = list(engine.generate(request))[-1]
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    fallback = Engine(cfg)
    assert fallback.describe()["weight_path"] == (
        f"float weights: F.linear (few-rows GEMM unavailable: CXX={str(tmp_path / 'no-such-compiler')!r} "
        "is not an executable)"
    )
    again = list(fallback.generate(request))[-1]
    assert again.error is None and again.token_ids == tokens.token_ids


def test_every_decode_batch_the_engine_can_form_takes_the_kernel():
    assert BY_NAME["max_batch"].max <= KERNEL_ROWS


@pytest.mark.parametrize("name,dtype", [("fp32", torch.float32), ("bf16", torch.bfloat16)])
def test_rows_of_a_kernel_call_in_pieces_are_bit_identical_to_each_row_alone(name, dtype, tmp_path):
    gemm = load_few_rows_gemm(cache_dir=str(tmp_path))
    generator = torch.Generator().manual_seed(3)
    linear = FewRowsLinear(torch.nn.Parameter(torch.randn(300, 96, generator=generator).to(dtype)), gemm)
    x = torch.randn(KERNEL_ROWS, 96, generator=generator).to(dtype)
    together = linear(x)
    alone = torch.cat([linear(x[i : i + 1]) for i in range(KERNEL_ROWS)])
    assert torch.equal(together, alone)


@pytest.mark.parametrize("rows", [17, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_blocked_product_of_a_large_weight_is_the_fp32_product_rounded_once(rows, dtype):
    generator = torch.Generator().manual_seed(5)
    n = 2 * BLOCK_ROWS + 37  # a partial last block
    k = ONE_CALL_ELEMENTS // (2 * BLOCK_ROWS) + 8  # more than ONE_CALL_ELEMENTS in all: blocked
    w = torch.randn(n, k, generator=generator).to(dtype)
    x = torch.randn(rows, k, generator=generator).to(dtype)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        got = blocked_linear(x, w)
    assert [e.name for e in prof.events()].count("aten::mm") == 3  # one GEMM per block of weight rows
    reference = (x.double() @ w.double().t()).to(dtype)  # torch math in float64, rounded to the dtype once
    assert got.dtype == dtype and got.shape == (rows, n)
    tolerance = dict(rtol=1e-5, atol=1e-4) if dtype == torch.float32 else dict(rtol=8e-3, atol=8e-3)
    torch.testing.assert_close(got, reference, **tolerance)


def test_a_small_weight_is_one_f_linear_call():
    generator = torch.Generator().manual_seed(7)
    w, x = torch.randn(768, 128, generator=generator), torch.randn(53, 128, generator=generator)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        got = blocked_linear(x, w)
    names = [e.name for e in prof.events()]
    assert names.count("aten::linear") == 1 and names.count("aten::mm") == 1
    assert torch.equal(got, torch.nn.functional.linear(x, w))
