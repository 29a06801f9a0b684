"""Checkpoint loading: config spellings, sharding, tying, dtypes, legacy key layouts and clear errors."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from orin_vlm_node.model import CheckpointError, ModelConfig
from orin_vlm_node.model.config import DEFAULT_MROPE_SECTION
from orin_vlm_node.weights import load_model, loader
from orin_vlm_node.weights.keys import checkpoint_key_to_name, checkpoint_views
from orin_vlm_node.weights.quant import WeightQuant
from support.checkpoints import cached_tiny_checkpoint

TIED = dict(layers=2, tie=True)
UNTIED = dict(layers=2, tie=False)


def _copy(tmp_path: Path, **kwargs) -> Path:
    dst = tmp_path / "ckpt"
    shutil.copytree(cached_tiny_checkpoint(**kwargs), dst)
    return dst


def _state(path: Path) -> dict[str, torch.Tensor]:
    return load_file(str(path / "model.safetensors"))


def _assert_same_parameters(a, b) -> None:
    pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
    assert pa.keys() == pb.keys()
    for name in pa:
        assert torch.equal(pa[name], pb[name]), name


def test_loaded_parameters_equal_checkpoint_tensors():
    path = cached_tiny_checkpoint(**UNTIED)
    model = load_model(path)
    state = _state(path)
    views = checkpoint_views(model)  # fused q/k/v and gate/up rows, one view per checkpoint matrix
    assert len(views) == len(state)  # untied: lm_head is its own tensor
    for key, tensor in state.items():
        assert torch.equal(views[checkpoint_key_to_name(key)], tensor), key
    assert all(not p.requires_grad for p in model.parameters())


def test_tied_lm_head_shares_embedding_storage():
    model = load_model(cached_tiny_checkpoint(**TIED), torch.bfloat16)
    assert model.lm_head.weight is model.language_model.embed_tokens.weight
    assert model.config.tie_word_embeddings


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, "bf16", "fp16"])
def test_target_dtype_and_fp32_rope_tables(dtype):
    model = load_model(cached_tiny_checkpoint(**TIED), dtype, "cpu")
    expected = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(dtype, dtype)
    assert {p.dtype for p in model.parameters()} == {expected}
    assert model.language_model.inv_freq.dtype == torch.float32
    ref = load_model(cached_tiny_checkpoint(**TIED))
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        assert torch.equal(p, q.to(expected)), name


def test_unsupported_dtype_is_refused():
    with pytest.raises(ValueError, match="unsupported model dtype"):
        load_model(cached_tiny_checkpoint(**TIED), torch.int8)


class _SlowClock:
    """A perf_counter whose every reading is ``step_s`` after the previous one: a load that takes time."""

    def __init__(self, step_s: float) -> None:
        self.now, self.step_s = 0.0, step_s

    def perf_counter(self) -> float:
        self.now += self.step_s
        return self.now


@pytest.mark.parametrize("step_s", [0.0, 0.5, 2.0])
def test_progress_is_logged_at_most_every_interval(caplog, monkeypatch, step_s):
    """A load reports its progress at most every PROGRESS_INTERVAL_S (2 s) of it: never when it is fast,
    after every tensor when each takes the interval, in between when slower than that."""
    monkeypatch.setattr(loader, "time", _SlowClock(step_s))
    with caplog.at_level(logging.INFO, logger="orin_vlm_node.model"):
        load_model(cached_tiny_checkpoint(**TIED))
    messages = [r.getMessage() for r in caplog.records if r.name == "orin_vlm_node.model"]
    assert any("loading" in m and "tensors" in m for m in messages)
    assert any(m.startswith("loaded") for m in messages)
    shares = [float(m.split("%")[0]) for m in messages if m.endswith("(model.safetensors)")]
    tensors = len(load_file(cached_tiny_checkpoint(**TIED) / "model.safetensors"))
    assert shares == sorted(shares) and all(0 < share <= 100 for share in shares)
    if step_s == 0.0:
        assert shares == []
    elif step_s < loader.PROGRESS_INTERVAL_S:
        assert 0 < len(shares) < tensors
    else:
        assert len(shares) == tensors and shares[-1] == 100


def test_sharded_checkpoint_loads_like_single_file(tmp_path):
    src = cached_tiny_checkpoint(**UNTIED)
    dst = _copy(tmp_path, **UNTIED)
    state = _state(dst)
    (dst / "model.safetensors").unlink()
    keys = sorted(state)
    shards = {"model-00001-of-00002.safetensors": keys[::2], "model-00002-of-00002.safetensors": keys[1::2]}
    weight_map = {}
    for file, names in shards.items():
        save_file({k: state[k] for k in names}, str(dst / file), metadata={"format": "pt"})
        weight_map.update({k: file for k in names})
    (dst / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    _assert_same_parameters(load_model(dst), load_model(src))
    # Quantized while it streams in: a fused projection's parts come from both shards, its rows filled in turn.
    sharded, single = (load_model(c, quant=WeightQuant("int4", 32)).state_dict() for c in (dst, src))
    assert sharded.keys() == single.keys() and any(name.endswith("qkv_proj.qweight") for name in single)
    assert all(torch.equal(sharded[name], value) for name, value in single.items())

    (dst / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(CheckpointError, match="shard file.*model-00002-of-00002.safetensors"):
        load_model(dst)


def test_legacy_key_layout_is_accepted(tmp_path):
    """Pre-4.52 spellings (model.layers.*, visual.*) map onto the same parameters."""
    src = cached_tiny_checkpoint(**UNTIED)
    dst = _copy(tmp_path, **UNTIED)
    state = _state(dst)
    renamed = {}
    for key, tensor in state.items():
        key = key.replace("model.language_model.", "model.").replace("model.visual.", "visual.")
        renamed[key] = tensor
    save_file(renamed, str(dst / "model.safetensors"), metadata={"format": "pt"})
    _assert_same_parameters(load_model(dst), load_model(src))


def test_both_rope_spellings_parse_identically():
    new = ModelConfig.from_dir(cached_tiny_checkpoint(**TIED))
    legacy_dir = cached_tiny_checkpoint(**TIED, legacy_rope_keys=True)
    raw = json.loads((legacy_dir / "config.json").read_text())
    assert "rope_scaling" in raw["text_config"] and "rope_parameters" not in raw["text_config"]
    legacy = ModelConfig.from_dir(legacy_dir)
    assert legacy.text == new.text and legacy.vision == new.vision
    assert new.text.rope_theta == 5_000_000.0 and new.text.mrope_section == (6, 5, 5)


def test_defaults_for_absent_rope_fields_and_tie_fallback():
    raw = json.loads((cached_tiny_checkpoint(**TIED) / "config.json").read_text())
    raw["text_config"].pop("rope_parameters")
    raw["text_config"]["rope_theta"] = 1234.0
    raw["vision_config"].pop("rope_parameters")
    raw.pop("tie_word_embeddings")
    raw["text_config"]["tie_word_embeddings"] = True
    cfg = ModelConfig.from_dict(raw)
    assert cfg.text.mrope_section == DEFAULT_MROPE_SECTION
    assert cfg.text.rope_theta == 1234.0
    assert cfg.vision.rope_theta == 10000.0
    assert cfg.tie_word_embeddings  # read from text_config when the top-level flag is absent
    assert (cfg.image_token_id, cfg.vision_start_token_id, cfg.vision_end_token_id) == (6, 3, 4)
    assert cfg.torch_dtype == torch.float32


def test_real_config_files_parse():
    for name, tie in (("2B", True), ("4B", True), ("8B", False)):
        cfg = ModelConfig.from_json_file(f"/work/shared/model-configs/Qwen3-VL-{name}-Instruct.config.json")
        assert cfg.tie_word_embeddings is tie
        assert cfg.text.mrope_section == (24, 20, 20) and cfg.text.rope_theta == 5e6
        assert cfg.torch_dtype == torch.bfloat16


# ---- bad input -----------------------------------------------------------------------------------


def test_missing_directory_and_config(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        load_model(tmp_path / "nope")
    dst = _copy(tmp_path, **TIED)
    (dst / "config.json").unlink()
    with pytest.raises(CheckpointError, match=r"config\.json: missing"):
        load_model(dst)


def test_invalid_config_json(tmp_path):
    dst = _copy(tmp_path, **TIED)
    (dst / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="cannot read JSON"):
        load_model(dst)
    raw = json.loads((cached_tiny_checkpoint(**TIED) / "config.json").read_text())
    raw["text_config"]["rope_parameters"]["rope_type"] = "yarn"
    (dst / "config.json").write_text(json.dumps(raw))
    with pytest.raises(CheckpointError, match="rope_type 'yarn' is not supported"):
        load_model(dst)
    raw["text_config"]["rope_parameters"]["rope_type"] = "default"
    del raw["text_config"]["num_hidden_layers"]
    (dst / "config.json").write_text(json.dumps(raw))
    with pytest.raises(CheckpointError, match="text_config.num_hidden_layers"):
        load_model(dst)


def test_pickle_only_checkpoint_is_refused(tmp_path):
    dst = _copy(tmp_path, **TIED)
    state = _state(dst)
    (dst / "model.safetensors").unlink()
    torch.save(state, dst / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match=r"only PyTorch pickle weights.*pytorch_model\.bin.*safetensors"):
        load_model(dst)


def test_no_weights_at_all(tmp_path):
    dst = _copy(tmp_path, **TIED)
    (dst / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="no weights"):
        load_model(dst)


def test_shape_mismatch_names_key_and_shapes(tmp_path):
    dst = _copy(tmp_path, **TIED)
    state = _state(dst)
    key = "model.language_model.layers.1.self_attn.k_proj.weight"
    state[key] = torch.zeros(state[key].shape[0] + 32, state[key].shape[1])
    save_file(state, str(dst / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"shape mismatch: model\.safetensors:" + key.replace(".", r"\.")):
        load_model(dst)


def test_unexpected_key(tmp_path):
    dst = _copy(tmp_path, **TIED)
    state = _state(dst)
    state["model.visual.blocks.99.attn.qkv.weight"] = torch.zeros(2, 2)
    save_file(state, str(dst / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"unexpected keys: model\.safetensors:model\.visual\.blocks\.99"):
        load_model(dst)


def test_missing_key(tmp_path):
    dst = _copy(tmp_path, **TIED)
    state = _state(dst)
    del state["model.language_model.layers.0.mlp.up_proj.weight"]
    save_file(state, str(dst / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"missing keys: model\.language_model\.layers\.0\.mlp\.up_proj\.weight"):
        load_model(dst)


def test_untied_checkpoint_without_lm_head_is_missing_a_key(tmp_path):
    dst = _copy(tmp_path, **UNTIED)
    state = _state(dst)
    del state["lm_head.weight"]
    save_file(state, str(dst / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"missing keys: lm_head\.weight"):
        load_model(dst)


def test_tied_checkpoint_with_redundant_lm_head_copy_loads(tmp_path):
    dst = _copy(tmp_path, **TIED)
    state = _state(dst)
    state["lm_head.weight"] = state["model.language_model.embed_tokens.weight"].clone()
    save_file(state, str(dst / "model.safetensors"), metadata={"format": "pt"})
    model = load_model(dst)
    assert model.lm_head.weight is model.language_model.embed_tokens.weight


def test_image_feature_count_mismatch_in_forward():
    from orin_vlm_node.kvcache.reference import causal_attention
    from orin_vlm_node.model import mrope_positions
    from support.checkpoints import image_prompt, random_pixel_values

    model = load_model(cached_tiny_checkpoint(**TIED))
    ids = image_prompt([[30], [31], [32]], [[1, 4, 4], [1, 4, 4]])  # two image runs in the prompt
    pixel_values, grid = random_pixel_values([[1, 4, 4]])  # ... but one image encoded
    vision = model.encode_images(pixel_values, grid)
    positions = torch.zeros(3, len(ids), dtype=torch.long)
    with pytest.raises(ValueError, match="8 image and video pad tokens but 4 feature rows"):
        model.forward(torch.tensor(ids), positions, lambda i, q, k, v: causal_attention(q, k, v, 0), vision)
    with pytest.raises(ValueError, match="more image-pad tokens than images"):
        mrope_positions(ids, grid, model.config.image_token_id, 2)
    with pytest.raises(ValueError, match="pixel_values has 16 rows"):
        model.encode_images(pixel_values, torch.tensor([[1, 4, 4], [1, 4, 4]]))
    with pytest.raises(ValueError, match=r"pixel_values must be \(N, 1536\)"):
        model.encode_images(pixel_values[:, :100], grid)
