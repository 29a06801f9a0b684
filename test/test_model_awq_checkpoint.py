"""Checkpoints in AutoAWQ's GEMM layout (``quant_method: awq``): read as the reference converter reads them
(compressed-tensors' ``AutoAWQConverter``, contributed by vLLM), widened exactly as transformers widens the
converted copy, kept as the node's INT4 with the stored values where ``weight_quant=int4`` asks for it, and
refused by name where malformed or in another layout."""

from __future__ import annotations

import json
import logging
import shutil

import pytest
import torch
from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32
from compressed_tensors.entrypoints.convert.converters.autoawq import AutoAWQConverter
from kept_int4 import kept_and_widened
from safetensors.torch import load_file, save_file

from orin_vlm_node.model import CheckpointError
from orin_vlm_node.weights import load_model
from orin_vlm_node.weights.awq import AwqWeights, awq_pairs, unpack_awq
from orin_vlm_node.weights.keys import checkpoint_views, name_to_checkpoint_key
from orin_vlm_node.weights.pieces import WORK_ELEMENTS
from orin_vlm_node.weights.quant import QuantizedLinear, WeightQuant
from support.checkpoints import cached_tiny_checkpoint
from support.quantized_copies import awq_copy, awq_pack, awq_quantize, edit_config, rewrite_tensors

GROUP = 32
DOWN = "model.language_model.layers.0.mlp.down_proj"
PROJECTIONS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
               "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")  # fmt: skip


@pytest.fixture(scope="module")
def source():
    return cached_tiny_checkpoint(layers=2, tie=False, dtype=torch.float16)


@pytest.fixture(scope="module")
def awq(source, tmp_path_factory):
    return awq_copy(source, tmp_path_factory.mktemp("awq") / "ckpt", group_size=GROUP)


@pytest.fixture(scope="module")
def converted(awq, tmp_path_factory):
    """The AWQ checkpoint converted to compressed-tensors pack-quantized by the reference converter."""
    dst = tmp_path_factory.mktemp("awq_ct") / "ckpt"
    shutil.copytree(awq, dst, ignore=shutil.ignore_patterns("*.safetensors"))  # the weights are rewritten below
    spec = json.loads((awq / "config.json").read_text())["quantization_config"]
    converter = AutoAWQConverter.from_autoawq_config(spec)
    save_file(converter.process(load_file(str(awq / "model.safetensors"))), str(dst / "model.safetensors"))
    edit_config(
        dst, lambda c: c.update(quantization_config=json.loads(converter.update_config(None).model_dump_json()))
    )
    return dst


def by_key(model) -> dict[str, torch.Tensor]:
    return {name_to_checkpoint_key(name): view for name, view in checkpoint_views(model).items()}


def test_the_files_written_here_are_read_by_the_reference_converter_as_intended(source, awq, converted):
    """The test's AWQ writer checked against the reference: the converter's signed values and zero points are the
    ones quantized (minus 8), its scales the same, for every decoder projection."""
    floats, stored = load_file(str(source / "model.safetensors")), load_file(str(converted / "model.safetensors"))
    for layer in range(2):
        for part in PROJECTIONS:
            module = f"model.language_model.layers.{layer}.{part}"
            u, z, s = awq_quantize(floats[f"{module}.weight"], GROUP)
            n, k = u.shape
            q = unpack_from_int32(stored[f"{module}.weight_packed"], 4, torch.Size([n, k]))
            zero = unpack_from_int32(
                stored[f"{module}.weight_zero_point"], 4, torch.Size([n, k // GROUP]), packed_dim=0
            )
            assert torch.equal(q.long(), u - 8) and torch.equal(zero.long(), z - 8), module
            assert torch.equal(stored[f"{module}.weight_scale"], s), module


def test_unpacking_undoes_the_interleaved_order():
    values = torch.arange(16 * 24).remainder(16).view(16, 24)
    assert torch.equal(unpack_awq(awq_pack(values)).long(), values)


def test_the_words_become_the_nodes_nibble_pairs():
    """(K, N) values packed as AWQ words -> (N, K / 2) bytes, input 2i of output n low, 2i + 1 high."""
    u = torch.randint(0, 16, (40, 6, 64), generator=torch.Generator().manual_seed(0)).view(240, 64)  # (N, K)
    assert torch.equal(awq_pairs(awq_pack(u.t().contiguous())), (u[:, 0::2] | (u[:, 1::2] << 4)).to(torch.uint8))


@pytest.mark.filterwarnings("ignore:You passed `quantization_config`:UserWarning")  # dequantize=True on purpose
def test_an_awq_checkpoint_widens_to_the_weights_transformers_loads_from_the_converted_copy(awq, converted):
    """transformers (with compressed-tensors) widens the converted copy in its fp16 scales' dtype: in fp16 the
    node's AWQ widening gives the same values to the bit, and the vision tower and LM head the float ones."""
    from transformers import CompressedTensorsConfig, Qwen3VLForConditionalGeneration

    config = CompressedTensorsConfig(dequantize=True)
    reference = Qwen3VLForConditionalGeneration.from_pretrained(
        converted, dtype=torch.float16, quantization_config=config
    )
    expected = reference.state_dict()
    views = by_key(load_model(awq, dtype=torch.float16))
    assert set(views) <= set(expected)
    for key, view in views.items():
        assert torch.equal(view, expected[key]), key


def test_weight_quant_int4_keeps_the_stored_values_as_the_converted_copy_does(awq, converted):
    """No requantization: the node's INT4 holds the AWQ nibbles, scales and fp16-rounded offsets, buffer for
    buffer as it holds the same values read from compressed-tensors' files, and within the offset's rounding of
    the exact ``(u - z) * s``."""
    quant = WeightQuant("int4", group_size=16)
    from_awq = load_model(awq, torch.float32, quant=quant).language_model.layers
    from_ct = load_model(converted, torch.float32, quant=quant).language_model.layers
    stored = load_file(str(awq / "model.safetensors"))
    for i in range(2):
        for module, other in ((from_awq[i].mlp.down_proj, from_ct[i].mlp.down_proj),
                              (from_awq[i].self_attn.qkv_proj, from_ct[i].self_attn.qkv_proj)):  # fmt: skip
            assert isinstance(module, QuantizedLinear) and module.mode == "int4" and module.group_size == GROUP
            for buffer in ("qweight", "scales", "offsets"):
                assert torch.equal(getattr(module, buffer), getattr(other, buffer)), buffer
    name = f"{DOWN}"
    u = unpack_awq(stored[f"{name}.qweight"]).t().float()
    z = unpack_awq(stored[f"{name}.qzeros"]).t().float().repeat_interleave(GROUP, dim=1)
    s = stored[f"{name}.scales"].t().float().repeat_interleave(GROUP, dim=1)
    exact = (u - z) * s
    error = (from_awq[0].mlp.down_proj.dequantize(torch.float32) - exact).abs()
    assert torch.all(error <= (z * s).abs() * 2.0**-11 + exact.abs() * 2.0**-23)
    assert error.max() > 0  # the bound is what is tested, not a coincidence of exact values


def test_the_engine_runs_a_kept_awq_checkpoint_as_the_widened_one_computes(awq):
    """The same weights two ways: kept as INT4 (the CPU kernels' product) and widened to fp32 (torch's): the
    greedy tokens are the same, and the weights take what INT4 takes."""
    runs = kept_and_widened(awq, group_size=16)
    for _, described in runs.values():
        assert described["checkpoint_weights"] == "int4 (AWQ gemm, with zero points), a scale per group of 32"
    stored = load_file(str(awq / "model.safetensors"))
    weights = sum(t.numel() * 8 for key, t in stored.items() if key.endswith(".qweight"))
    saved = weights * 4 - (weights / 2 + weights / GROUP * 4)  # fp32 against int4 with an fp16 scale and offset
    assert runs["none"][1]["weight_mb"] - runs["int4"][1]["weight_mb"] == pytest.approx(saved / 1e6, abs=2e-3)
    assert runs["int4"][0] == runs["none"][0]


def test_widening_an_awq_checkpoint_says_how_to_keep_it(awq, caplog):
    with caplog.at_level(logging.WARNING, logger="orin_vlm_node.model"):
        load_model(awq, torch.float16)
    assert "14 decoder weights are stored as int4 (AWQ gemm, with zero points), a scale per group of 32" in caplog.text
    assert "weight_quant=none widens them to float16; weight_quant=int4 keeps them as stored" in caplog.text


def test_int8_takes_the_widened_awq_weights_quantized_again(awq, caplog):
    quant = WeightQuant("int8")
    with caplog.at_level(logging.WARNING, logger="orin_vlm_node.model"):
        quantized = load_model(awq, torch.float32, quant=quant).language_model.layers[1].mlp.down_proj
    assert "weight_quant=int8 widens them to float32 and quantizes them again" in caplog.text
    expected = QuantizedLinear.from_weight(
        load_model(awq, torch.float32).language_model.layers[1].mlp.down_proj.weight, quant
    )
    assert torch.equal(quantized.qweight, expected.qweight) and torch.equal(quantized.scales, expected.scales)


@pytest.mark.parametrize(
    "group, quant, kept",
    [
        (128, WeightQuant("int4", 64), WeightQuant("int4", 128)),  # the checkpoint's groups
        (96, WeightQuant("int4", 64), None),  # not a power of two: the CUDA kernels shift by it
        (128, WeightQuant("int8"), None),
        (128, None, None),  # weight_quant=none
    ],
)
def test_which_awq_layouts_the_node_holds_as_stored(group, quant, kept):
    assert AwqWeights(group).keeps(quant) == kept


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda t: t.pop(f"{DOWN}.qzeros"), rf"{DOWN}.qweight is stored as AWQ integers but the checkpoint has no "
         rf"{DOWN}.qzeros"),
        (lambda t: t.pop(f"{DOWN}.scales"), rf"has no {DOWN}.scales"),
        (lambda t: t.update({f"{DOWN}.scales": torch.ones(2, 64, dtype=torch.float16)}),
         r"down_proj.scales has shape \[2, 64\], expected \[4, 64\]"),
        (lambda t: t.update({f"{DOWN}.qzeros": t[f"{DOWN}.qzeros"].to(torch.int16)}), r"down_proj.qzeros is I16; "
         r"expected I32"),
        (lambda t: t.update({f"{DOWN}.qweight": t[f"{DOWN}.qweight"].long()}), r"down_proj.qweight is I64; AWQ "
         r"weights are stored as I32"),
        (lambda t: t.update({f"{DOWN}.qweight": t[f"{DOWN}.qweight"].t().contiguous()}),
         r"down_proj.qweight has shape \[8, 128\], config.json implies \[128, 8\]"),  # output-major: not AWQ's
    ],
)  # fmt: skip
def test_awq_weights_without_fitting_scales_and_zeros_are_refused_naming_them(awq, tmp_path, damage, message):
    ckpt = tmp_path / "damaged"
    shutil.copytree(awq, ckpt)
    rewrite_tensors(ckpt, damage)
    with pytest.raises(CheckpointError, match=message):
        load_model(ckpt)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"version": "gemv"}, r"AutoAWQ's 'gemv' layout: this node reads the gemm layout"),
        ({"version": None, "format": "marlin"}, r"'marlin' layout"),  # GPTQModel's name for the layout
        ({"bits": 8}, r"AWQ checkpoint with 8-bit weights: 4-bit AWQ weights are read"),
        ({"zero_point": False}, r"without zero points \(zero_point false\)"),
        ({"group_size": -1}, r"group_size must be a positive integer, got -1"),
        (
            {"quant_method": "hqq"},
            r"already quantized \(hqq\); .*4-bit AWQ \(quant_method awq, AutoAWQ's gemm "
            r"layout\) and GPTQ \(quant_method gptq\)",
        ),
    ],
)
def test_an_awq_config_that_does_not_describe_readable_weights_is_refused(awq, tmp_path, change, message):
    ckpt = tmp_path / "edited"
    shutil.copytree(awq, ckpt)
    edit_config(ckpt, lambda c: c["quantization_config"].update(change))
    with pytest.raises(CheckpointError, match=message):
        load_model(ckpt)


def test_a_weight_read_a_few_outputs_at_a_time_is_the_weight_read_at_once(awq, monkeypatch):
    """Pieces of one word of outputs (8 rows) widen and keep the same values as the whole matrix at once."""
    whole = by_key(load_model(awq, torch.float16)), load_model(awq, torch.float32, quant=WeightQuant("int4"))
    monkeypatch.setitem(WORK_ELEMENTS, "cpu", 1)
    pieces = by_key(load_model(awq, torch.float16)), load_model(awq, torch.float32, quant=WeightQuant("int4"))
    for key, view in whole[0].items():
        assert torch.equal(view, pieces[0][key]), key
    for (name, buffer), other in zip(whole[1].named_buffers(), pieces[1].buffers(), strict=True):
        assert torch.equal(buffer, other), name
