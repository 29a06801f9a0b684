"""Checkpoints whose linear weights are stored as 4- or 8-bit integers (compressed-tensors' pack-quantized and
int-quantized files, written here by compressed-tensors itself): widened exactly as transformers widens them,
kept as the node's INT4 / INT8 with the stored values where weight_quant asks for that format, and refused by
name where malformed or in a format not read."""

from __future__ import annotations

import logging

import pytest
import torch
from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32
from kept_int4 import kept_and_widened
from safetensors.torch import load_file

from orin_vlm_node.model import CheckpointError
from orin_vlm_node.weights import integer as int_module
from orin_vlm_node.weights import load_model
from orin_vlm_node.weights.keys import checkpoint_views, name_to_checkpoint_key
from orin_vlm_node.weights.quant import QuantizedLinear, WeightQuant
from support.checkpoints import cached_tiny_checkpoint
from support.quantized_copies import edit_config, int_copy, rewrite_tensors

LAYOUTS = {  # name: int_copy arguments
    "w4a16": dict(bits=4, strategy="group", group_size=32, symmetric=True),
    "w4a16_asym": dict(bits=4, strategy="group", group_size=64, symmetric=False),
    "w4_channel": dict(bits=4, strategy="channel", group_size=None, symmetric=True),
    "w4_tensor": dict(bits=4, strategy="tensor", group_size=None, symmetric=True),
    "w8a16": dict(bits=8, strategy="channel", group_size=None, symmetric=True),
    "w8a8_int": dict(bits=8, strategy="channel", group_size=None, symmetric=True, fmt="int-quantized"),
    "w8_group_asym": dict(bits=8, strategy="group", group_size=32, symmetric=False),
}
DOWN = "model.language_model.layers.0.mlp.down_proj"


@pytest.fixture(scope="module")
def source():
    return cached_tiny_checkpoint(layers=2, tie=False, dtype=torch.bfloat16)


def by_key(model) -> dict[str, torch.Tensor]:
    return {name_to_checkpoint_key(name): view for name, view in checkpoint_views(model).items()}


def stored_modules(stored: dict[str, torch.Tensor]) -> list[str]:
    return sorted({k.rsplit(".", 1)[0] for k in stored if k.endswith(".weight_scale")})


def exact(stored: dict[str, torch.Tensor], module: str, layout: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """(w, |offset|) in fp32 for one converted ``module``: ``(q - z) * s`` from compressed-tensors' own unpacking,
    each value's scale and zero point picked by index; |offset| = |(z + 2^(b-1)) * s|, what the node's INT4 stores
    in fp16."""
    bits, packed = layout["bits"], layout.get("fmt", "pack-quantized") == "pack-quantized"
    scale = stored[f"{module}.weight_scale"].float()
    if packed:
        n, k = stored[f"{module}.weight_shape"].tolist()
        q = unpack_from_int32(stored[f"{module}.weight_packed"], bits, torch.Size([n, k])).float()
    else:
        q = stored[f"{module}.weight"].float()
        n, k = q.shape
    cols = layout["group_size"] if layout["strategy"] == "group" else k
    index = torch.arange(k) // cols
    s = scale.reshape(n, -1)[:, index] if scale.numel() > 1 else scale.reshape(1, 1).expand(n, k)
    z = torch.zeros(n, k)
    if not layout["symmetric"]:
        zero = stored[f"{module}.weight_zero_point"]
        groups = scale.reshape(n, -1).shape[1]
        z = unpack_from_int32(zero, bits, torch.Size([n, groups]), packed_dim=0).float()[:, index]
    return (q - z) * s, ((z + 2 ** (bits - 1)) * s).abs()


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.filterwarnings("ignore:You passed `quantization_config`:UserWarning")  # dequantize=True on purpose
def test_an_integer_checkpoint_widens_to_the_weights_transformers_loads(source, tmp_path, layout):
    """transformers (with compressed-tensors) widens in the scales' dtype, bf16 here: in bf16 the values are the
    same to the bit, the vision tower's too."""
    from transformers import CompressedTensorsConfig, Qwen3VLForConditionalGeneration

    ckpt = int_copy(source, tmp_path / layout, **LAYOUTS[layout])
    config = CompressedTensorsConfig(dequantize=True)
    reference = Qwen3VLForConditionalGeneration.from_pretrained(ckpt, dtype=torch.bfloat16, quantization_config=config)
    expected = reference.state_dict()
    views = by_key(load_model(ckpt, dtype=torch.bfloat16))
    assert set(views) <= set(expected)
    floats = load_file(str(source / "model.safetensors"))
    misshapen = [key for key in views if expected[key].shape != floats[key].shape]
    if misshapen:  # compressed-tensors 0.19 (the newest for Python 3.10) with int-quantized projections
        key = misshapen[0]
        pytest.skip(
            f"the reference widened {len(misshapen)} stored weights to other shapes than the float checkpoint's, "
            f"e.g. {key} to {list(expected[key].shape)}"
        )
    for key, view in views.items():
        assert torch.equal(view, expected[key]), key
    stored = load_file(str(ckpt / "model.safetensors"))
    assert len(stored_modules(stored)) == 2 * 7 + 3 * 4 + 2 * 3  # decoder, vision blocks, merger + DeepStack
    float_weight = floats[f"{DOWN}.weight"]
    assert not torch.equal(views[f"{DOWN}.weight"], float_weight)


@pytest.mark.parametrize("layout", ["w4a16", "w4_channel", "w4_tensor", "w8a16", "w8a8_int"])
def test_weight_quant_of_the_stored_format_keeps_the_stored_values(source, tmp_path, layout):
    """No requantization: the node's INT4 / INT8 stand for exactly ``(q - z) * s`` (symmetric layouts)."""
    args = LAYOUTS[layout]
    ckpt = int_copy(source, tmp_path / layout, **args)
    stored = load_file(str(ckpt / "model.safetensors"))
    mode = "int4" if args["bits"] == 4 else "int8"
    model = load_model(ckpt, torch.float32, quant=WeightQuant(mode, group_size=16))
    layer = model.language_model.layers[0]
    for module, parts in (
        (layer.mlp.down_proj, ["mlp.down_proj"]),
        (layer.self_attn.qkv_proj, ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"]),
    ):
        assert isinstance(module, QuantizedLinear) and module.mode == mode
        if mode == "int4":  # the checkpoint's groups; a scale per channel or tensor over the setting's groups
            assert module.group_size == (args["group_size"] if args["strategy"] == "group" else 16)
        want = torch.cat([exact(stored, f"model.language_model.layers.0.{p}", args)[0] for p in parts])
        assert torch.equal(module.dequantize(torch.float32), want)


def test_zero_points_are_kept_with_the_offset_rounded_to_fp16(source, tmp_path):
    args = LAYOUTS["w4a16_asym"]
    ckpt = int_copy(source, tmp_path / "asym", **args)
    stored = load_file(str(ckpt / "model.safetensors"))
    module = load_model(ckpt, torch.float32, quant=WeightQuant("int4", 128)).language_model.layers[0].mlp.down_proj
    assert module.group_size == 64
    want, offset = exact(stored, DOWN, args)
    error = (module.dequantize(torch.float32) - want).abs()
    assert torch.all(error <= offset * 2.0**-11 + want.abs() * 2.0**-23)  # fp16's half ulp of the offset
    assert error.max() > 0  # the bound is what is tested, not a coincidence of exact values


@pytest.mark.parametrize("layout, mode", [("w4a16", "int8"), ("w8a16", "int4"), ("w8_group_asym", "int8")])
def test_a_layout_the_node_cannot_hold_as_stored_is_widened_then_quantized(source, tmp_path, caplog, layout, mode):
    """Another mode than the stored one, or 8-bit groups with zero points (the node's INT8 has one scale a row
    and none): quantized from the widened weights, as from a float checkpoint, with a warning saying so."""
    ckpt = int_copy(source, tmp_path / layout, **LAYOUTS[layout])
    quant = WeightQuant(mode, group_size=32)
    with caplog.at_level(logging.WARNING, logger="orin_vlm_node.model"):
        quantized = load_model(ckpt, torch.float32, quant=quant).language_model.layers[1].mlp.down_proj
    assert f"weight_quant={mode} widens them to float32 and quantizes them again" in caplog.text
    widened = load_model(ckpt, torch.float32).language_model.layers[1].mlp.down_proj
    expected = QuantizedLinear.from_weight(widened.weight, quant)
    for buffer in ("qweight", "scales") + (("offsets",) if mode == "int4" else ()):
        assert torch.equal(getattr(quantized, buffer), getattr(expected, buffer)), buffer


def test_widening_a_4_bit_checkpoint_without_weight_quant_says_how_to_keep_it(source, tmp_path, caplog):
    ckpt = int_copy(source, tmp_path / "w4", **LAYOUTS["w4a16"])
    with caplog.at_level(logging.WARNING, logger="orin_vlm_node.model"):
        load_model(ckpt, torch.bfloat16)
    assert "14 decoder weights are stored as int4 (pack-quantized, symmetric), a scale per group of 32" in caplog.text
    assert "weight_quant=none widens them to bfloat16; weight_quant=int4 keeps them as stored" in caplog.text


@pytest.mark.parametrize(
    "stored, quant, kept",
    [
        (int_module.IntWeights(4, "group", 128, True, True), WeightQuant("int4", 64), WeightQuant("int4", 128)),
        (int_module.IntWeights(4, "group", 96, True, True), WeightQuant("int4", 64), None),  # no power of two
        (int_module.IntWeights(4, "channel", None, False, True), WeightQuant("int4", 64), WeightQuant("int4", 64)),
        (int_module.IntWeights(4, "group", 128, True, True), WeightQuant("int8"), None),
        (int_module.IntWeights(8, "tensor", None, True, False), WeightQuant("int8"), WeightQuant("int8")),
        (int_module.IntWeights(8, "channel", None, False, True), WeightQuant("int8"), None),  # zero points
        (int_module.IntWeights(8, "group", 128, True, True), WeightQuant("int8"), None),  # a scale per group
        (int_module.IntWeights(4, "group", 128, True, True), None, None),  # weight_quant=none
    ],
)
def test_which_layouts_the_node_holds_as_stored(stored, quant, kept):
    assert stored.keeps(quant) == kept


def test_the_engine_runs_a_kept_int4_checkpoint_as_the_widened_one_computes(source, tmp_path):
    """The same weights two ways: kept as INT4 (the CPU kernels' product) and widened to fp32 (torch's): the
    greedy tokens are the same, and the weights take what INT4 takes."""
    ckpt = int_copy(source, tmp_path / "w4", **LAYOUTS["w4a16"])
    runs = kept_and_widened(ckpt, group_size=32)
    for _, described in runs.values():
        assert described["checkpoint_weights"] == "int4 (pack-quantized, symmetric), a scale per group of 32"
    stored = load_file(str(ckpt / "model.safetensors"))
    weights = sum(stored[f"{m}.weight_shape"].prod().item() for m in stored_modules(stored) if "language_model" in m)
    saved = weights * 4 - (weights / 2 + weights / 32 * 4)  # fp32 against int4 with an fp16 scale and offset a group
    assert runs["none"][1]["weight_mb"] - runs["int4"][1]["weight_mb"] == pytest.approx(saved / 1e6, abs=2e-3)
    assert runs["int4"][0] == runs["none"][0]


def weights_of(config: dict) -> dict:
    return config["quantization_config"]["config_groups"]["group_0"]["weights"]


@pytest.mark.parametrize(
    "layout, damage, message",
    [
        ("w4a16", lambda t: t.pop(f"{DOWN}.weight_scale"), rf"{DOWN}.weight_packed is stored as integers but the "
         rf"checkpoint has no {DOWN}.weight_scale"),
        ("w4a16", lambda t: t.update({f"{DOWN}.weight_scale": torch.ones(64, 2)}), r"down_proj.weight_scale has "
         r"shape \[64, 2\], expected \[64, 4\]"),
        ("w4a16", lambda t: t.update({f"{DOWN}.weight_packed": t[f"{DOWN}.weight_packed"].long()}), r"down_proj."
         r"weight_packed is I64; int4 .* stored as I32"),
        ("w4a16", lambda t: t.update({f"{DOWN}.weight_packed": torch.zeros(64, 15, dtype=torch.int32)}),
         r"down_proj.weight_packed has shape \[64, 15\], config.json implies \[64, 16\]"),
        ("w4a16_asym", lambda t: t.pop(f"{DOWN}.weight_zero_point"), r"has no .*down_proj.weight_zero_point"),
        ("w4a16", lambda t: t.update({f"{DOWN}.weight_zero_point": torch.zeros(8, 4, dtype=torch.int32)}),
         r"unexpected keys: .*down_proj.weight_zero_point"),  # a symmetric scheme has none
    ],
)  # fmt: skip
def test_integer_weights_without_fitting_scales_are_refused_naming_them(source, tmp_path, layout, damage, message):
    ckpt = int_copy(source, tmp_path / layout, **LAYOUTS[layout])
    rewrite_tensors(ckpt, damage)
    with pytest.raises(CheckpointError, match=message):
        load_model(ckpt)


@pytest.mark.parametrize(
    "strategy, scale_shape, refused",
    [
        ("tensor", (), False),
        ("tensor", (1,), False),
        ("tensor", (1, 1), False),
        ("tensor", (2,), True),
        ("tensor", (1, 1, 1), True),
        ("channel", (64,), False),
        ("channel", (64, 1), False),
        ("channel", (1, 64), False),  # the same 64 values in the same order
        ("channel", (32, 2), True),
        ("group", (64, 4), False),
        ("group", (4, 64), True),
        ("group", (256,), True),
    ],
)
def test_scales_saved_with_or_without_their_unit_dimensions_are_read(strategy, scale_shape, refused):
    """compressed-tensors writes one scale a tensor as [], [1] or [1, 1] and one a channel as [N] or [N, 1]: each
    holds the values the reader needs in order; any other count or order is refused with both shapes named."""
    stored = int_module.IntWeights(4, strategy, 32 if strategy == "group" else None, True, True)
    problem = stored.problem(f"{DOWN}.weight_packed", "I32", (64, 128), {"scale": ("BF16", scale_shape)})
    want = {"tensor": [1, 1], "channel": [64, 1], "group": [64, 4]}[strategy]
    assert problem == (f"{DOWN}.weight_scale has shape {list(scale_shape)}, expected {want}" if refused else None)


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda c: weights_of(c).update(num_bits=2), r"pack-quantized weights of 2 bits"),
        (lambda c: weights_of(c).update(actorder="group"), r"activation-ordered groups \(actorder 'group'"),
        (lambda c: weights_of(c).update(strategy="tensor", symmetric=False), r"asymmetric .* one scale per tensor"),
        (lambda c: weights_of(c).update(strategy="block"), r"strategy 'block'"),
        (lambda c: weights_of(c).update(group_size=0), r"group_size must be a positive integer"),
        (
            lambda c: c["quantization_config"]["config_groups"].update(
                group_1={"targets": ["re:.*down_proj"], "weights": dict(weights_of(c), num_bits=8)}
            ),
            r"mixed weight schemes",
        ),
        (lambda c: c.pop("quantization_config"), r"packed integer weights but config.json has no quantization_config"),
        (lambda c: c.update(quantization_config={"quant_method": "hqq", "nbits": 4}), r"already quantized \(hqq\); "
         r".*compressed-tensors integer ones \(pack-quantized, int-quantized: llm-compressor's W4A16, AWQ and GPTQ"),
    ],
)  # fmt: skip
def test_a_config_that_does_not_describe_readable_integer_weights_is_refused(source, tmp_path, change, message):
    ckpt = int_copy(source, tmp_path / "w4", **LAYOUTS["w4a16"])
    edit_config(ckpt, change)
    with pytest.raises(CheckpointError, match=message):
        load_model(ckpt)


def test_int8_weights_in_a_checkpoint_without_a_quantization_config_are_refused(source, tmp_path):
    ckpt = int_copy(source, tmp_path / "w8", **LAYOUTS["w8a8_int"])
    edit_config(ckpt, lambda c: c.pop("quantization_config"))
    with pytest.raises(CheckpointError, match=r"I8 weights but config.json has no quantization_config"):
        load_model(ckpt)


@pytest.mark.parametrize("layout", ["w4a16", "w8a16"])
def test_an_lm_head_stored_as_integers_becomes_the_int8_head(source, tmp_path, layout):
    """The LM head is stored in int8 whatever the mode: a W8A16 head is kept as stored, a 4-bit one widened and
    quantized to int8; without an int8 head it is widened into the checkpoint dtype's head."""
    args = LAYOUTS[layout]
    ckpt = int_copy(source, tmp_path / layout, head=True, **args)
    stored = load_file(str(ckpt / "model.safetensors"))
    assert "lm_head.weight_scale" in stored
    widened = load_model(ckpt, torch.float32).lm_head.weight
    assert torch.equal(widened, exact(stored, "lm_head", args)[0])
    head = load_model(ckpt, torch.float32, quant=WeightQuant("int4" if args["bits"] == 4 else "int8", 32)).lm_head
    assert isinstance(head, QuantizedLinear) and head.mode == "int8"
    if layout == "w8a16":  # kept: exactly the stored values
        assert torch.equal(head.dequantize(torch.float32), exact(stored, "lm_head", args)[0])
    else:
        expected = QuantizedLinear.from_weight(widened, WeightQuant("int8"))
        assert torch.equal(head.qweight, expected.qweight) and torch.equal(head.scales, expected.scales)


def test_a_saved_copy_of_a_tied_head_stored_as_integers_is_skipped_with_its_scales(source, tmp_path):
    ckpt = int_copy(source, tmp_path / "w4", head=True, **LAYOUTS["w4a16"])
    edit_config(ckpt, lambda c: c.update(tie_word_embeddings=True))
    model = load_model(ckpt, torch.float32)
    assert model.lm_head.weight is model.language_model.embed_tokens.weight
