"""Weight-only quantization: the stored formats against plain torch math, the loader, the engine.

References: the quantization rules written out with torch ops here (round to the nearest step of a per-row
or per-group grid), and the float model whose projection weights are replaced by the dequantized ones.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from unittest import mock

import pytest
import torch
import torch.nn.functional as F

from orin_vlm_node.cpu import load_cpu_gemm
from orin_vlm_node.cpu.gemm import BoundWeight
from orin_vlm_node.engine import Engine, EngineConfig, EngineError, Request, SamplingParams, Turn
from orin_vlm_node.model import CheckpointError
from orin_vlm_node.model.text import DecoderLayer
from orin_vlm_node.weights import load_model
from orin_vlm_node.weights.cpu_linear import KERNEL_ROWS, CpuQuantLinear
from orin_vlm_node.weights.pieces import WORK_ELEMENTS
from orin_vlm_node.weights.projections import ProjectionBuilder, ProjectionKernels, rebuild_projections
from orin_vlm_node.weights.quant import LM_HEAD_QUANT, QuantizedLinear, WeightQuant, weight_bytes
from support.checkpoints import cached_tiny_checkpoint
from support.quantized_copies import gptq_copy, int_copy

torch.set_num_threads(1)


def _weight(n: int, k: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.05


def test_int8_is_the_nearest_step_of_a_per_row_grid():
    w = _weight(37, 75)
    q = QuantizedLinear.from_weight(w, WeightQuant("int8"))
    scale = (w.abs().amax(dim=1) / 127).half().float()  # (N,)
    assert torch.equal(q.scales.float(), scale)
    assert torch.equal(q.qweight, torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8))
    assert (q.dequantize(torch.float32) - w).abs().le(scale[:, None] / 2 + 1e-7).all()
    x = torch.randn(3, 75)
    torch.testing.assert_close(q(x), F.linear(x, q.dequantize(torch.float32)), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("n,k,group", [(37, 75, 32), (16, 64, 64), (8, 130, 128), (5, 33, 2)])
def test_int4_is_the_nearest_step_of_each_groups_grid_for_any_shape(n, k, group):
    w = _weight(n, k, seed=k)
    q = QuantizedLinear.from_weight(w, WeightQuant("int4", group))
    groups = -(-k // group)
    assert q.qweight.shape == (n, -(-k // 2)) and q.scales.shape == q.offsets.shape == (n, groups)
    for g in range(groups):  # each group on its own range, the last one too when group does not divide k
        part = w[:, g * group : (g + 1) * group]
        lo = part.amin(dim=1).half().float()
        step = ((part.amax(dim=1) - lo).clamp_min(0) / 15).half().float()
        assert torch.equal(q.offsets[:, g].float(), lo) and torch.equal(q.scales[:, g].float(), step)
        flat = step[:, None] == 0  # a group of equal weights (a last group of one): all at the offset
        expected = torch.where(flat, 0.0, torch.round((part - lo[:, None]) / step[:, None]).clamp(0, 15))
        got = q.dequantize(torch.float32)[:, g * group : (g + 1) * group]
        torch.testing.assert_close(got, expected * step[:, None] + lo[:, None], rtol=0, atol=1e-6)
        # Within half a step, give or take the fp16 rounding of the offset and the step.
        assert (got - part).abs().le(step[:, None] / 2 + part.abs() * 2**-10 + 1e-7).all()
    x = torch.randn(3, k)
    torch.testing.assert_close(q(x), F.linear(x, q.dequantize(torch.float32)))


@pytest.mark.parametrize("quant", [WeightQuant("int8"), WeightQuant("int4", 32)])
def test_a_weight_quantized_a_few_rows_at_a_time_is_stored_as_all_at_once(quant, monkeypatch):
    """from_weight works through a large weight (an LM head) in pieces of rows, so its fp32 working copies
    stay small; the pieces (here 3 rows of 100 weights, the last one short) store what one pass stores."""
    w = torch.randn(10, 100, generator=torch.Generator().manual_seed(3))
    original = w.clone()
    whole = QuantizedLinear.from_weight(w, quant)
    monkeypatch.setitem(WORK_ELEMENTS, "cpu", 300)
    pieces = QuantizedLinear.from_weight(w, quant)
    for name, buffer in whole.named_buffers():
        assert torch.equal(getattr(pieces, name), buffer), name
    assert torch.equal(w, original)  # worked on in a copy: an fp32 weight (a tied embedding table) stays


def test_int4_packs_two_weights_a_byte_low_nibble_first():
    # Group 0 is 0..15 (step 1, offset 0: q = w), group 1 the single weight 7 (offset 7, q = 0).
    w = torch.tensor([[*range(16), 7]], dtype=torch.float32)
    q = QuantizedLinear.from_weight(w, WeightQuant("int4", 16))
    expected = [(2 * i) | ((2 * i + 1) << 4) for i in range(8)] + [0]  # odd K: the last high nibble is 0
    assert q.qweight.tolist() == [expected]
    assert torch.equal(q.dequantize(torch.float32), w)


def test_bad_modes_and_group_sizes_are_refused_with_the_reason():
    with pytest.raises(ValueError, match="one of none, int8, int4"):
        WeightQuant("int3").check()
    with pytest.raises(ValueError, match="power of two"):
        WeightQuant("int4", 96).check()
    with pytest.raises(ValueError, match="larger than the smallest projection input \\(64\\)"):
        WeightQuant("int4", 128).check((64, 256))
    WeightQuant("int8", 96).check((64,))  # the group size is an int4 matter only


@pytest.fixture(scope="module")
def checkpoint():
    return cached_tiny_checkpoint()


def _assert_quantized_as(got: torch.nn.Module, weight: torch.Tensor, quant: WeightQuant) -> None:
    assert isinstance(got, QuantizedLinear) and got.mode == quant.mode
    for name, buffer in QuantizedLinear.from_weight(weight, quant).named_buffers():
        assert torch.equal(getattr(got, name), buffer), name


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("quant", [WeightQuant("int8"), WeightQuant("int4", 32)])
def test_the_loader_quantizes_every_decoder_projection_as_quantizing_the_float_weights_does(quant, tie, dtype):
    """Each checkpoint matrix is quantized into its (fused) projection's rows as it streams in, from the values
    the float model of that dtype holds (an fp32 checkpoint loaded in bf16: rounded to bf16 first)."""
    checkpoint = cached_tiny_checkpoint(tie=tie)
    plain = load_model(checkpoint, dtype)
    model = load_model(checkpoint, dtype, quant=quant)
    for layer, ref in zip(model.language_model.layers, plain.language_model.layers, strict=True):
        for sub, attr in DecoderLayer.PROJECTIONS:
            _assert_quantized_as(getattr(getattr(layer, sub), attr), getattr(getattr(ref, sub), attr).weight, quant)
    # The LM head in int8 whatever the mode (tied: quantized from the embedding table, which stays).
    _assert_quantized_as(model.lm_head, plain.lm_head.weight, LM_HEAD_QUANT)
    # Everything else is the checkpoint's, untouched.
    assert torch.equal(model.language_model.embed_tokens.weight, plain.language_model.embed_tokens.weight)
    assert torch.equal(model.visual.patch_embed.proj.weight, plain.visual.patch_embed.proj.weight)
    kept = load_model(checkpoint, dtype, quant=dataclasses.replace(quant, lm_head=False))
    assert torch.equal(kept.lm_head.weight, plain.lm_head.weight)
    assert (kept.lm_head.weight is kept.language_model.embed_tokens.weight) == tie


@pytest.mark.parametrize("quant", [WeightQuant("int8"), WeightQuant("int4", 32)])
def test_a_quantized_model_computes_what_the_float_model_with_the_dequantized_weights_computes(checkpoint, quant):
    model = load_model(checkpoint, quant=quant)
    reference = load_model(checkpoint)
    for layer, ref in zip(model.language_model.layers, reference.language_model.layers, strict=True):
        for sub, attr in DecoderLayer.PROJECTIONS:
            getattr(getattr(ref, sub), attr).weight.copy_(getattr(getattr(layer, sub), attr).dequantize(torch.float32))
    head = model.lm_head.dequantize(torch.float32)  # (vocab, hidden); a new module: the embedding stays
    reference.lm_head = torch.nn.Linear(head.shape[1], head.shape[0], bias=False)
    reference.lm_head.weight.data = head
    engine = Engine(EngineConfig(model_path=str(checkpoint), device="cpu"))
    ids = engine.parts.tokenizer.encode("What is on the table? Count the boxes.")
    positions = torch.arange(len(ids)).expand(3, -1)
    logits = []
    for m in (model, reference):
        cache = engine.parts.cache
        seq = cache.new_sequence()
        logits.append(m.forward(torch.tensor(ids), positions, cache.step(seq, len(ids))))
        cache.release(seq)
    torch.testing.assert_close(logits[0], logits[1], rtol=1e-4, atol=1e-5)


def test_weight_bytes_of_the_projections_fall_to_the_quantized_share(checkpoint):
    plain = load_model(checkpoint)
    projections = sum(
        getattr(getattr(layer, sub), attr).weight.numel()
        for layer in plain.language_model.layers
        for sub, attr in DecoderLayer.PROJECTIONS
    )
    fp16_bytes = 2 * projections
    for quant, share in ((WeightQuant("int8", lm_head=False), 0.55), (WeightQuant("int4", 32, lm_head=False), 0.32)):
        model = load_model(checkpoint, quant=quant)
        saved = weight_bytes(plain) - weight_bytes(model)  # fp32 projections -> quantized ones
        quantized = 4 * projections - saved
        assert quantized <= share * fp16_bytes, (quant.mode, quantized / fp16_bytes)


@pytest.fixture(scope="module")
def gemm(cpu_kernel_cache):
    return load_cpu_gemm(cache_dir=cpu_kernel_cache)


@pytest.mark.parametrize("quant", [WeightQuant("int8"), WeightQuant("int4", 32), WeightQuant("int4", 16)])
def test_the_cpu_kernels_compute_what_the_torch_path_computes(checkpoint, gemm, quant):
    with_kernels, torch_path = load_model(checkpoint, quant=quant), load_model(checkpoint, quant=quant)
    layers = with_kernels.language_model.layers
    projections = 4 * len(layers)
    assert f"({projections} quantized projections + int8 LM head;" in rebuild_projections(
        with_kernels, ProjectionBuilder(ProjectionKernels(cpu_gemm=gemm), with_kernels.dtype)
    )
    routed = [getattr(getattr(layer, s), a) for layer in layers for s, a in layer.PROJECTIONS]
    assert all(isinstance(m, CpuQuantLinear) for m in [*routed, with_kernels.lm_head])
    assert weight_bytes(with_kernels) == weight_bytes(torch_path)  # the stored bytes, not a copy
    engine = Engine(EngineConfig(model_path=str(checkpoint), device="cpu"))
    text = "Where is the charging station? Count the boxes on the shelf."
    for rows in (1, 3, 9, 40):  # a decode step, batches (pieces of the few-rows kernel), a prefill
        ids = (engine.parts.tokenizer.encode(text) * 4)[:rows]
        positions = torch.arange(len(ids)).expand(3, -1)
        logits = []
        with (
            mock.patch.object(BoundWeight, "few_rows", autospec=True, side_effect=BoundWeight.few_rows) as few,
            mock.patch.object(BoundWeight, "many_rows", autospec=True, side_effect=BoundWeight.many_rows) as many,
        ):
            for model in (with_kernels, torch_path):
                seq = engine.parts.cache.new_sequence()
                logits.append(model.forward(torch.tensor(ids), positions, engine.parts.cache.step(seq, len(ids))))
                engine.parts.cache.release(seq)
        # A prefill's last o product and MLP, like the head, multiply only the row whose logits are asked for.
        assert (few.call_count if rows <= KERNEL_ROWS else many.call_count + 3) >= projections, rows
        torch.testing.assert_close(logits[0], logits[1], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("mode,group", [("int8", 128), ("int4", 32)])
def test_an_engine_with_quantized_weights_uses_the_cpu_kernels_and_answers_as_the_torch_path(
    checkpoint, mode, group, tmp_path, monkeypatch
):
    plain = Engine(EngineConfig(model_path=str(checkpoint), device="cpu"))
    cfg = EngineConfig(model_path=str(checkpoint), device="cpu", weight_quant=mode, weight_quant_group_size=group,
                       kernel_cache_dir=str(tmp_path))  # fmt: skip
    engine = Engine(cfg)
    described = engine.describe()
    assert described["weight_quant"] == mode and described["weight_mb"] < plain.describe()["weight_mb"]
    assert described["lm_head"] == "int8" and plain.describe()["lm_head"] == "float32"
    assert (
        described["weight_path"]
        == f"{mode}: CPU GEMM kernels on the stored weights, few rows for 1..16, many rows above"
    )
    request = Request(Turn("Tell the robot what to do next."), SamplingParams(temperature=0.0, max_new_tokens=24))
    final = list(engine.generate(request))[-1]
    assert final.finish_reason in ("stop", "length") and final.error is None
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))  # no kernels: the torch path
    reference = Engine(cfg)
    assert reference.describe()["weight_path"] == f"{mode}: torch (weights widened for each product)"
    assert list(reference.generate(request))[-1].token_ids == final.token_ids


def test_int4_groups_smaller_than_the_cpu_kernels_take_stay_on_the_torch_path_and_say_so(checkpoint):
    engine = Engine(
        EngineConfig(model_path=str(checkpoint), device="cpu", weight_quant="int4", weight_quant_group_size=8)
    )
    assert engine.describe()["weight_path"] == (
        "int4: torch (weights widened for each product; the CPU GEMM kernels take groups of 16 or more, not 8)"
    )
    final = list(engine.generate(Request(Turn("Hello."), SamplingParams(temperature=0.0, max_new_tokens=8))))[-1]
    assert final.finish_reason in ("stop", "length") and final.error is None


def test_a_group_size_the_model_cannot_take_is_refused_before_the_model_loads(checkpoint):
    with pytest.raises(EngineError, match="power of two"):
        Engine(EngineConfig(model_path=str(checkpoint), device="cpu", weight_quant="int4", weight_quant_group_size=48))
    with pytest.raises(EngineError, match="larger than the smallest projection input"):
        Engine(
            EngineConfig(model_path=str(checkpoint), device="cpu", weight_quant="int4", weight_quant_group_size=4096)
        )


def test_an_already_quantized_checkpoint_is_refused_naming_its_format(checkpoint, tmp_path):
    copy = tmp_path / "bnb"
    shutil.copytree(checkpoint, copy)
    config = json.loads((copy / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "bitsandbytes", "load_in_4bit": True}
    (copy / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"already quantized \(bitsandbytes\)"):
        load_model(copy)


@pytest.mark.parametrize(
    "write",
    [
        lambda src, dst: int_copy(src, dst, bits=4, group_size=32, symmetric=False),
        lambda src, dst: gptq_copy(src, dst, group_size=32, sym=False),
        lambda src, dst: gptq_copy(src, dst, group_size=32, sym=True, desc_act=True),
    ],
    ids=["w4a16_asym", "gptq_asym", "gptq_act_order"],
)
def test_a_stored_checkpoint_read_a_few_rows_at_a_time_is_the_checkpoint_read_at_once(write, tmp_path, monkeypatch):
    """Widened (weight_quant none), kept as stored (int4) or widened then quantized again (activation order):
    pieces of one row (one packed word of rows where the format packs outputs) give the same weights."""
    ckpt = write(cached_tiny_checkpoint(layers=2, tie=False, dtype=torch.float16), tmp_path / "copy")

    def loads():
        return load_model(ckpt, torch.float16), load_model(ckpt, torch.float32, quant=WeightQuant("int4", 32))

    whole = loads()
    monkeypatch.setitem(WORK_ELEMENTS, "cpu", 1)
    pieces = loads()
    for at_once, in_pieces in zip(whole, pieces, strict=True):
        for (name, tensor), other in zip(at_once.state_dict().items(), in_pieces.state_dict().values(), strict=True):
            assert torch.equal(tensor, other), name
