"""Checkpoints in GPTQ's own format (``quant_method: gptq``): widened to ``(u - z) * s`` of each input's group
(torch math on the values the writer quantized, which stand within half a step of the float weights), with the
original format's zero points one less (symmetric ones the 0x77777777 words real checkpoints hold), kept as the
node's INT4 where ``weight_quant=int4`` asks for it and the groups are consecutive, and refused by name where
malformed or in another format."""

from __future__ import annotations

import logging
import shutil

import pytest
import torch
from kept_int4 import kept_and_widened
from safetensors.torch import load_file

from orin_vlm_node.model import CheckpointError
from orin_vlm_node.weights import load_model
from orin_vlm_node.weights.gptq import GptqWeights
from orin_vlm_node.weights.quant import QuantizedLinear, WeightQuant
from support.checkpoints import cached_tiny_checkpoint
from support.quantized_copies import edit_config, gptq_copy, gptq_groups, gptq_quantize, rewrite_tensors

LAYOUTS = {  # name: gptq_copy arguments
    "sym": dict(group_size=32, sym=True),
    "asym": dict(group_size=32, sym=False),
    "asym_v2": dict(group_size=64, sym=False, v1=False),
    "act_order": dict(group_size=32, sym=True, desc_act=True),
    "per_row": dict(group_size=None, sym=True),
}
DOWN = "model.language_model.layers.0.mlp.down_proj"
PROJECTIONS = {"self_attn": ("q_proj", "k_proj", "v_proj", "o_proj"), "mlp": ("gate_proj", "up_proj", "down_proj")}


@pytest.fixture(scope="module")
def source():
    return cached_tiny_checkpoint(layers=2, tie=False, dtype=torch.float16)


@pytest.fixture(scope="module")
def copies(source, tmp_path_factory):
    root = tmp_path_factory.mktemp("gptq")
    return {name: gptq_copy(source, root / name, **args) for name, args in LAYOUTS.items()}


def expected(source, layout: dict, module: str, index: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(w, s per weight) in fp32 for one projection, from the float weight through the writer's quantizer:
    ``(u - z[g_idx]) * s[g_idx]``, the i-th converted tensor's g_idx as the writer made it."""
    w = load_file(str(source / "model.safetensors"))[f"{module}.weight"]
    g_idx = gptq_groups(w.shape[1], layout["group_size"], layout.get("desc_act", False), seed=index)
    u, z, s = gptq_quantize(w, g_idx, layout["sym"])
    g = g_idx.long()
    return ((u - z[:, g]) * s.float()[:, g]).float(), s.float()[:, g]


def converted_index(source, module: str) -> int:
    """The writer's seed for ``module``: its position among the checkpoint's tensors."""
    return list(load_file(str(source / "model.safetensors"))).index(f"{module}.weight")


def test_symmetric_zero_points_are_stored_as_real_gptq_checkpoints_store_them(copies):
    """The original format's symmetric zero point 8 is stored as 7 in every field: 0x77777777 words."""
    stored = load_file(str(copies["sym"] / "model.safetensors"))
    assert torch.all(stored[f"{DOWN}.qzeros"] == 0x77777777)
    v2 = load_file(str(copies["asym_v2"] / "model.safetensors"))[f"{DOWN}.qzeros"]
    assert v2.dtype == torch.int32 and not torch.all(v2 == 0x77777777)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_gptq_checkpoint_widens_to_the_values_it_stores(source, copies, layout):
    """Every decoder projection widens to ``(u - z) * s`` of its groups (activation order included), within half
    a step of the float weight it was quantized from; everything else is the float checkpoint's."""
    model = load_model(copies[layout], torch.float32)
    floats = load_file(str(source / "model.safetensors"))
    for i, layer in enumerate(model.language_model.layers):
        for sub, parts in PROJECTIONS.items():
            for part in parts:
                module = f"model.language_model.layers.{i}.{sub}.{part}"
                want, step = expected(source, LAYOUTS[layout], module, converted_index(source, module))
                got = _projection(layer, sub, part)
                assert torch.equal(got, want), module
                assert torch.all((got - floats[f"{module}.weight"].float()).abs() <= step / 2 + 1e-3), module
    assert torch.equal(model.lm_head.weight, floats["lm_head.weight"].float())


def _projection(layer, sub: str, part: str) -> torch.Tensor:
    """The float weight of one checkpoint projection in the loaded layer (a part of a fused module)."""
    if sub == "self_attn" and part != "o_proj":
        module = layer.self_attn.qkv_proj
    elif sub == "mlp" and part != "down_proj":
        module = layer.mlp.gate_up_proj
    else:
        return getattr(getattr(layer, sub), part).weight
    return module.weight[module.part_rows()[part]]


def test_a_v1_zero_point_of_0_borrows_from_the_next_field_and_is_read_back(source, tmp_path):
    """In the original format a zero point of 0 (a group of non-negative weights) is stored as -1, borrowing from
    the field above it in the word; reading adds the whole word's ones back, so both are exact."""
    positive = tmp_path / "positive"
    shutil.copytree(source, positive)
    rewrite_tensors(positive, lambda t: t[f"{DOWN}.weight"][:4].abs_())  # outputs 0..3: zero points of 0
    ckpt = gptq_copy(positive, tmp_path / "gptq", **LAYOUTS["asym"])
    want, _ = expected(positive, LAYOUTS["asym"], DOWN, converted_index(positive, DOWN))
    got = load_model(ckpt, torch.float32).language_model.layers[0].mlp.down_proj.weight
    assert torch.equal(got, want)
    g_idx = gptq_groups(want.shape[1], 32, False)
    _, z, _ = gptq_quantize(load_file(str(positive / "model.safetensors"))[f"{DOWN}.weight"], g_idx, sym=False)
    assert torch.all(z[:4] == 0) and torch.all(z[4:8] > 0)  # the borrow crosses into outputs 4..7's fields


@pytest.mark.parametrize("layout, group", [("sym", 32), ("asym", 32), ("asym_v2", 64), ("per_row", 16)])
def test_weight_quant_int4_keeps_the_stored_values(source, copies, layout, group):
    """No requantization: the node's INT4 stands for ``(u - z) * s`` exactly where the offset -z * s is exact in
    fp16 (symmetric: -8 s), else within its fp16 rounding; one group a row takes the setting's groups (16)."""
    module = load_model(copies[layout], torch.float32, quant=WeightQuant("int4", 16)).language_model.layers[0]
    down = module.mlp.down_proj
    assert isinstance(down, QuantizedLinear) and down.mode == "int4" and down.group_size == group
    want, step = expected(source, LAYOUTS[layout], DOWN, converted_index(source, DOWN))
    error = (down.dequantize(torch.float32) - want).abs()
    if LAYOUTS[layout]["sym"]:
        assert torch.equal(down.dequantize(torch.float32), want)
    else:
        assert torch.all(error <= 15 * step * 2.0**-11 + want.abs() * 2.0**-23)
        assert error.max() > 0  # the bound is what is tested, not a coincidence of exact values


def test_activation_ordered_groups_are_widened_then_quantized_with_a_warning(copies, caplog):
    """The node's INT4 groups consecutive inputs; GPTQ's activation order does not: quantized again from the
    widened weights, as from a float checkpoint, and the warning says the layout cannot be held as stored."""
    quant = WeightQuant("int4", 32)
    with caplog.at_level(logging.WARNING, logger="orin_vlm_node.model"):
        quantized = load_model(copies["act_order"], torch.float32, quant=quant).language_model.layers[1].mlp.down_proj
    assert "stored as int4 (GPTQ, symmetric, activation order), a scale per group of 32" in caplog.text
    assert "the node's int4 cannot hold this layout as stored" in caplog.text
    widened = load_model(copies["act_order"], torch.float32).language_model.layers[1].mlp.down_proj.weight
    reference = QuantizedLinear.from_weight(widened, quant)
    for buffer in ("qweight", "scales", "offsets"):
        assert torch.equal(getattr(quantized, buffer), getattr(reference, buffer)), buffer


def test_a_g_idx_that_contradicts_desc_act_false_is_refused_when_kept(copies, tmp_path):
    ckpt = tmp_path / "shuffled"
    shutil.copytree(copies["sym"], ckpt)
    rewrite_tensors(ckpt, lambda t: t[f"{DOWN}.g_idx"].copy_(t[f"{DOWN}.g_idx"].flip(0)))
    with pytest.raises(CheckpointError, match=r"g_idx does not hold consecutive groups .* desc_act false"):
        load_model(ckpt, torch.float32, quant=WeightQuant("int4"))


def test_the_engine_runs_a_kept_gptq_checkpoint_as_the_widened_one_computes(copies):
    runs = kept_and_widened(copies["asym"], group_size=16)
    for _, described in runs.values():
        assert described["checkpoint_weights"] == "int4 (GPTQ, with zero points), a scale per group of 32"
    assert runs["int4"][0] == runs["none"][0]


@pytest.mark.parametrize(
    "stored, quant, kept",
    [
        (GptqWeights(128, False, True, True), WeightQuant("int4", 64), WeightQuant("int4", 128)),
        (GptqWeights(96, False, True, True), WeightQuant("int4", 64), None),  # not a power of two
        (GptqWeights(None, False, False, True), WeightQuant("int4", 64), WeightQuant("int4", 64)),  # one group a row
        (GptqWeights(128, True, True, True), WeightQuant("int4", 64), None),  # activation order
        (GptqWeights(128, False, True, True), WeightQuant("int8"), None),
        (GptqWeights(128, False, True, True), None, None),
    ],
)
def test_which_gptq_layouts_the_node_holds_as_stored(stored, quant, kept):
    assert stored.keeps(quant) == kept


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda t: t.pop(f"{DOWN}.qzeros"), rf"{DOWN}.qweight is stored as GPTQ integers but the checkpoint has no "
         rf"{DOWN}.qzeros"),
        (lambda t: t.update({f"{DOWN}.scales": torch.ones(2, 64, dtype=torch.float16)}),
         r"down_proj.scales has shape \[2, 64\], expected \[4, 64\]"),
        (lambda t: t.update({f"{DOWN}.qweight": t[f"{DOWN}.qweight"].long()}), r"down_proj.qweight is I64; GPTQ "
         r"weights are stored as I32"),
        (lambda t: t.update({f"{DOWN}.qweight": t[f"{DOWN}.qweight"].t().contiguous()}),
         r"down_proj.qweight has shape \[64, 16\], config.json implies \[16, 64\]"),  # output-major: not GPTQ's
    ],
)  # fmt: skip
def test_gptq_weights_without_fitting_companions_are_refused_naming_them(copies, tmp_path, damage, message):
    ckpt = tmp_path / "damaged"
    shutil.copytree(copies["sym"], ckpt)
    rewrite_tensors(ckpt, damage)
    with pytest.raises(CheckpointError, match=message):
        load_model(ckpt)


def test_a_g_idx_naming_groups_the_scales_do_not_have_is_refused(copies, tmp_path):
    ckpt = tmp_path / "out_of_range"
    shutil.copytree(copies["act_order"], ckpt)
    rewrite_tensors(ckpt, lambda t: t[f"{DOWN}.g_idx"].__setitem__(0, 4))  # 4 groups of 32: 0..3
    with pytest.raises(CheckpointError, match=r"a GPTQ g_idx names groups 0\.\.4; its scales have 4 groups"):
        load_model(ckpt, torch.float32)


def test_g_idx_may_be_left_out_without_activation_order_but_not_with_it(copies, tmp_path):
    """Groups of consecutive inputs need no index (some exporters leave it out): read as with it, kept or widened;
    activation-ordered groups cannot be read without it."""
    for layout in ("sym", "act_order"):
        ckpt = tmp_path / layout
        shutil.copytree(copies[layout], ckpt)
        rewrite_tensors(ckpt, lambda t: [t.pop(key) for key in list(t) if key.endswith(".g_idx")])
    quant = WeightQuant("int4")
    kept = [load_model(c, torch.float32, quant=quant).language_model.layers[0].mlp.down_proj
            for c in (copies["sym"], tmp_path / "sym")]  # fmt: skip
    for buffer in ("qweight", "scales", "offsets"):
        assert torch.equal(getattr(kept[0], buffer), getattr(kept[1], buffer)), buffer
    widened = [load_model(c, torch.float32).language_model.layers[0].mlp.down_proj.weight
               for c in (copies["sym"], tmp_path / "sym")]  # fmt: skip
    assert torch.equal(widened[0], widened[1])
    with pytest.raises(CheckpointError, match=rf"{DOWN}.qweight is stored as GPTQ integers but the checkpoint has "
                       rf"no {DOWN}.g_idx"):  # fmt: skip
        load_model(tmp_path / "act_order")


@pytest.mark.parametrize(
    "change, message",
    [
        ({"bits": 8}, r"GPTQ checkpoint with 8-bit weights: 4-bit GPTQ weights are read"),
        ({"checkpoint_format": "marlin"}, r"GPTQ checkpoint in the 'marlin' format: this node reads "
         r"checkpoint_format gptq and gptq_v2"),
        ({"group_size": 0}, r"group_size must be a positive integer or -1, got 0"),
    ],
)  # fmt: skip
def test_a_gptq_config_that_does_not_describe_readable_weights_is_refused(copies, tmp_path, change, message):
    ckpt = tmp_path / "edited"
    shutil.copytree(copies["sym"], ckpt)
    edit_config(ckpt, lambda c: c["quantization_config"].update(change))
    with pytest.raises(CheckpointError, match=message):
        load_model(ckpt)
