"""Checkpoints whose linear weights are stored in FP8 (Qwen's ``-FP8`` layout, llm-compressor's float-quantized
one) are widened on load exactly as transformers widens them, also with partial blocks, power-of-two scales and
quantization on top; malformed ones are refused by name before any weight is read."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from orin_vlm_node.engine import Engine, EngineConfig
from orin_vlm_node.model import CheckpointError
from orin_vlm_node.weights import load_model
from orin_vlm_node.weights.fp8 import Fp8Weights, Fp8Widener
from orin_vlm_node.weights.keys import checkpoint_views, name_to_checkpoint_key
from orin_vlm_node.weights.pieces import WORK_ELEMENTS
from orin_vlm_node.weights.quant import QuantizedLinear, WeightQuant
from support.checkpoints import cached_tiny_checkpoint
from support.quantized_copies import edit_config, fp8_copy, fp8_covered, rewrite_tensors

DEQ_KEY = "model.language_model.layers.0.mlp.down_proj.weight"


@pytest.fixture(scope="module")
def source():
    return cached_tiny_checkpoint(layers=2, tie=False, dtype=torch.bfloat16)


def widened(stored: dict[str, torch.Tensor], key: str, strategy: str, block) -> torch.Tensor:
    """``w[n, k] = q[n, k] * s[n // bn, k // bk]`` in fp32, each weight's scale picked by index."""
    q = stored[key].float()
    s = (stored.get(key + "_scale_inv", stored.get(key + "_scale"))).float()
    bn, bk = fp8_covered(strategy, block, tuple(q.shape))
    grid = s.reshape(-(-q.shape[0] // bn), -(-q.shape[1] // bk))
    return q * grid[torch.arange(q.shape[0]) // bn][:, torch.arange(q.shape[1]) // bk]


def fp8_keys(stored: dict[str, torch.Tensor]) -> list[str]:
    return [k for k, v in stored.items() if v.dtype == torch.float8_e4m3fn]


def by_key(model) -> dict[str, torch.Tensor]:
    return {name_to_checkpoint_key(name): view for name, view in checkpoint_views(model).items()}


@pytest.mark.parametrize(
    "layout, block, scale_dtype, dtype",
    [
        (None, (16, 32), torch.float32, torch.float32),  # Qwen's -FP8: fp32 scales per block
        ("channel", None, torch.bfloat16, torch.bfloat16),  # llm-compressor FP8_DYNAMIC
        ("block", (16, 32), torch.bfloat16, torch.bfloat16),
        ("group", (1, 32), torch.bfloat16, torch.bfloat16),
        ("tensor", None, torch.bfloat16, torch.bfloat16),
    ],
)
@pytest.mark.filterwarnings("ignore:You passed `quantization_config`:UserWarning")  # dequantize=True on purpose
def test_an_fp8_checkpoint_loads_to_the_weights_transformers_widens_it_to(
    source, tmp_path, layout, block, scale_dtype, dtype
):
    """transformers widens a compressed-tensors checkpoint in the scales' dtype (bf16 here) and a fine-grained
    FP8 one in fp32: in that dtype the values are the same to the bit."""
    from transformers import CompressedTensorsConfig, Qwen3VLForConditionalGeneration

    ckpt = fp8_copy(source, tmp_path / "fp8", block=block, scale_dtype=scale_dtype, compressed_tensors=layout)
    extra = {"quantization_config": CompressedTensorsConfig(dequantize=True)} if layout else {}
    reference = Qwen3VLForConditionalGeneration.from_pretrained(ckpt, dtype=dtype, **extra).state_dict()
    views = by_key(load_model(ckpt, dtype=dtype))
    assert set(views) <= set(reference)
    for key, view in views.items():
        assert torch.equal(view, reference[key]), key
    stored = load_file(str(ckpt / "model.safetensors"))
    assert len(fp8_keys(stored)) == 2 * 7 + 3 * 4 + 2 * 3  # decoder, vision blocks, merger + DeepStack mergers
    assert not torch.equal(reference[DEQ_KEY], load_file(str(source / "model.safetensors"))[DEQ_KEY].to(dtype))


@pytest.mark.parametrize(
    "layout, block, scale_dtype, dtype",
    [
        (None, (24, 40), torch.float32, torch.bfloat16),  # partial last blocks along both dimensions
        (None, (24, 40), torch.float8_e8m0fnu, torch.float32),  # ue8m0: power-of-two scales
        (None, None, torch.float32, torch.float16),  # one scale per tensor
        (None, (1, 256), torch.bfloat16, torch.float32),  # a block wider than some matrices
        ("block", (24, 40), torch.float32, torch.float32),
        ("group", (1, 48), torch.float16, torch.float32),  # a group that does not divide K
        ("channel", None, torch.float32, torch.float32),
    ],
)
def test_every_fp8_weight_is_its_values_times_the_scale_of_its_block(
    source, tmp_path, monkeypatch, layout, block, scale_dtype, dtype
):
    monkeypatch.setitem(WORK_ELEMENTS, "cpu", 1000)  # many pieces per matrix
    ckpt = fp8_copy(source, tmp_path / "fp8", block=block, scale_dtype=scale_dtype, compressed_tensors=layout)
    stored = load_file(str(ckpt / "model.safetensors"))
    views = by_key(load_model(ckpt, dtype))
    strategy = layout or ("block" if block else "tensor")
    for key in fp8_keys(stored):
        assert torch.equal(views[key], widened(stored, key, strategy, block).to(dtype)), key
    for key, value in stored.items():
        if key in views and key not in fp8_keys(stored):
            assert torch.equal(views[key], value.to(dtype)), key


@pytest.mark.parametrize("block", [(3, 5), None])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_finite_e4m3_code_widens_to_torchs_value_of_it(block, dtype):
    codes = torch.arange(256, dtype=torch.uint8)
    finite = codes[~codes.view(torch.float8_e4m3fn).float().isnan()]  # 254: both zeros, subnormals, up to +-448
    weight = torch.cat([finite, finite.flip(0)]).view(torch.float8_e4m3fn).view(4, 127)  # each code in 2 blocks
    scale = torch.rand(2, 26) * 2.0**-6 if block else torch.tensor(3.0e-3)
    out = torch.empty(4, 127, dtype=dtype)
    strategy = "block" if block else "tensor"
    Fp8Widener(Fp8Weights(strategy, block, "_scale_inv"), torch.device("cpu")).widen_into(out, weight, scale)
    stored = {"w.weight": weight, "w.weight_scale_inv": scale}
    assert torch.equal(out, widened(stored, "w.weight", strategy, block).to(dtype))


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_weight_quant_stores_the_widened_weights(source, tmp_path, mode):
    ckpt = fp8_copy(source, tmp_path / "fp8", block=(16, 32))
    quant = WeightQuant(mode, group_size=32)
    quantized = load_model(ckpt, torch.float32, quant=quant).language_model.layers[1].mlp.down_proj
    widened_model = load_model(ckpt, torch.float32).language_model.layers[1].mlp.down_proj
    expected = QuantizedLinear.from_weight(widened_model.weight, quant)
    for buffer in ("qweight", "scales") + (("offsets",) if mode == "int4" else ()):
        assert torch.equal(getattr(quantized, buffer), getattr(expected, buffer)), buffer


def test_scales_in_another_shard_than_their_weights_are_found(source, tmp_path):
    ckpt = fp8_copy(source, tmp_path / "fp8", block=(16, 32))
    stored = load_file(str(ckpt / "model.safetensors"))
    (ckpt / "model.safetensors").unlink()
    shards = {
        "model-00001-of-00002.safetensors": [k for k in stored if not k.endswith("_scale_inv")],
        "model-00002-of-00002.safetensors": [k for k in stored if k.endswith("_scale_inv")],
    }
    for file, keys in shards.items():
        save_file({k: stored[k] for k in keys}, str(ckpt / file), metadata={"format": "pt"})
    weight_map = {k: file for file, keys in shards.items() for k in keys}
    (ckpt / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    views = by_key(load_model(ckpt))
    for key in fp8_keys(stored):
        assert torch.equal(views[key], widened(stored, key, "block", (16, 32))), key


def test_static_activation_scales_are_not_needed(source, tmp_path):
    ckpt = fp8_copy(source, tmp_path / "fp8", block=(16, 32), activation_scales=True)
    stored = load_file(str(ckpt / "model.safetensors"))
    assert any(k.endswith(".input_scale") for k in stored)
    key = fp8_keys(stored)[0]
    assert torch.equal(by_key(load_model(ckpt))[key], widened(stored, key, "block", (16, 32)))


def test_the_engine_reports_the_stored_format(source, tmp_path):
    ckpt = fp8_copy(source, tmp_path / "fp8", block=(16, 32))
    assert Engine(EngineConfig(model_path=str(ckpt), device="cpu")).describe()["checkpoint_weights"] == (
        "fp8 e4m3, a scale per 16x32 block"
    )
    assert Engine(EngineConfig(model_path=str(source), device="cpu")).describe()["checkpoint_weights"] == "float"
    channels = fp8_copy(source, tmp_path / "channels", block=None, compressed_tensors="channel")
    assert Engine(EngineConfig(model_path=str(channels), device="cpu")).describe()["checkpoint_weights"] == (
        "fp8 e4m3, a scale per output channel"
    )


@pytest.mark.parametrize(
    "damage, message",
    [
        (
            lambda t: t.pop(DEQ_KEY.replace("weight", "weight_scale_inv")),
            rf"{DEQ_KEY} is FP8 but the checkpoint has no {DEQ_KEY}_scale_inv",
        ),
        (
            lambda t: t.update({DEQ_KEY.replace("weight", "weight_scale_inv"): torch.ones(1, 1)}),
            r"down_proj.weight_scale_inv has shape \[1, 1\], expected \[4, 4\]",
        ),
        (
            lambda t: t.update({DEQ_KEY.replace("weight", "weight_scale_inv"): torch.ones(4, 4, dtype=torch.int32)}),
            r"weight_scale_inv is I32",
        ),
        (lambda t: t.update({DEQ_KEY: t[DEQ_KEY].to(torch.float8_e5m2)}), r"down_proj.weight is F8_E5M2"),
        (
            lambda t: t.update({"model.language_model.norm.weight_scale_inv": torch.ones(())}),
            r"unexpected keys: .*language_model.norm.weight_scale_inv",
        ),
    ],
)
def test_an_fp8_weight_without_a_fitting_scale_is_refused_naming_it(source, tmp_path, damage, message):
    ckpt = fp8_copy(source, tmp_path / "fp8", block=(16, 32))
    rewrite_tensors(ckpt, damage)
    with pytest.raises(CheckpointError, match=message):
        load_model(ckpt)


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda c: c.pop("quantization_config"), r"FP8 weights but config.json has no quantization_config"),
        (lambda c: c["quantization_config"].update(fmt="e5m2"), r"fmt 'e5m2': only e4m3"),
        (lambda c: c["quantization_config"].update(weight_block_size=[128]), r"weight_block_size must be two"),
        (lambda c: c["quantization_config"].update(quant_method="bitsandbytes"), r"already quantized \(bitsandbytes\)"),
    ],
)
def test_a_config_that_does_not_describe_the_fp8_weights_is_refused(source, tmp_path, change, message):
    ckpt = fp8_copy(source, tmp_path / "fp8", block=(16, 32))
    edit_config(ckpt, change)
    with pytest.raises(CheckpointError, match=message):
        load_model(ckpt)


def weights_of(config: dict) -> dict:
    return config["quantization_config"]["config_groups"]["group_0"]["weights"]


@pytest.mark.parametrize(
    "change, message",
    [
        (
            lambda c: c["quantization_config"].update(format="pack-quantized"),
            r"already quantized \(compressed-tensors, format 'pack-quantized', 8-bit float weights\)",
        ),
        (lambda c: weights_of(c).update(type="int", num_bits=4), r"'float-quantized', 4-bit int weights\); .* reads"),
        (lambda c: weights_of(c).update(symmetric=False), r"FP8 weights with zero points"),
        (lambda c: weights_of(c).update(strategy="tensor_group"), r"strategy 'tensor_group'"),
        (lambda c: c["quantization_config"].update(kv_cache_scheme={"num_bits": 8}), r"quantized KV cache"),
        (lambda c: c["quantization_config"].update(quantization_status="frozen"), r"status 'frozen'"),
    ],
)
def test_a_compressed_tensors_checkpoint_that_is_not_fp8_weights_is_refused_naming_why(
    source, tmp_path, change, message
):
    ckpt = fp8_copy(source, tmp_path / "ct", block=None, compressed_tensors="channel")
    edit_config(ckpt, change)
    with pytest.raises(CheckpointError, match=message):
        load_model(ckpt)
