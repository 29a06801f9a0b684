"""Parameter table, validation and mapping onto EngineConfig/SamplingParams (ros_params), and the
YAML files in config/ kept in step with it. Only the last test creates an rclpy node (no peers)."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest
import yaml

from orin_vlm_node.engine.config import DEFAULT_MODEL_DIR, EngineConfig
from orin_vlm_node.engine.events import SamplingParams
from orin_vlm_node.ros.params import (
    ENGINE_FIELDS,
    PARAMS,
    SPECS,
    check_changes,
    check_value,
    defaults,
    engine_config,
    engine_kwargs,
    sampling_params,
)

CONFIG = Path(__file__).resolve().parent.parent / "config"


def no_cuda() -> bool:
    return False


def has_cuda() -> bool:
    return True


def load_params(path: Path) -> dict:
    doc = yaml.safe_load(path.read_text())
    assert list(doc) == ["/**"], f"{path.name}: parameters must apply to any node name/namespace"
    return doc["/**"]["ros__parameters"]


def test_engine_parameters_cover_engine_config_one_to_one():
    # max_sessions follows from multi_turn (the node keeps one conversation or none), it is no parameter.
    config_fields = {f.name for f in dataclasses.fields(EngineConfig)} - {"sampling", "max_sessions"}
    assert set(ENGINE_FIELDS) == config_fields
    # stop strings and ignore_eos are per-request options (CLI, benchmarks), not settings of a robot node
    sampling_fields = {f.name for f in dataclasses.fields(SamplingParams)} - {"stop", "ignore_eos"}
    assert {p.name for p in PARAMS if p.target == "sampling"} == sampling_fields


def test_default_yaml_lists_every_parameter_with_its_default():
    values = load_params(CONFIG / "orin_vlm.yaml")
    assert values == defaults()
    for name, value in values.items():
        # YAML types must match the declared types, or rclpy refuses the file at startup.
        assert type(value) is type(SPECS[name].default), name


@pytest.mark.parametrize("preset", ["jetson_2b.yaml", "jetson_4b.yaml", "jetson_8b.yaml"])
def test_jetson_presets_are_valid(preset):
    values = load_params(CONFIG / preset)
    assert set(values) <= set(SPECS)
    for name, value in values.items():
        assert type(value) is type(SPECS[name].default), f"{preset}: {name}"
        spec = SPECS[name]
        if spec.min_value is not None:
            assert spec.min_value <= value <= spec.max_value, f"{preset}: {name}"
    merged = {**defaults(), **values}
    assert check_changes(values, defaults(), cuda_available=has_cuda) is None
    assert merged["device"] == "cuda" and merged["dtype"] in ("fp16", "bf16")
    assert merged["use_cuda_graph"] and merged["use_paged_attention"] and merged["kv_pool_mb"] > 0


@pytest.mark.parametrize("size", [1, 2, 16, 64, 256])
def test_power_of_two_page_sizes_pass(size):
    assert check_value("page_size", size) is None


@pytest.mark.parametrize("size", [3, 24, 100, 255])
def test_other_page_sizes_are_refused_with_reason(size):
    assert check_value("page_size", size) == f"page_size must be a power of two (1, 2, 4, ..., 256), got {size}"


def test_device_cuda_needs_cuda():
    reason = check_value("device", "cuda", cuda_available=no_cuda)
    assert reason is not None and "CUDA is not available" in reason
    assert check_value("device", "cuda", cuda_available=has_cuda) is None
    assert check_value("device", "cpu", cuda_available=no_cuda) is None
    assert "must be one of auto, cuda, cpu" in check_value("device", "tpu")


def test_unknown_dtype_and_parameter():
    assert check_value("dtype", "int8") == "dtype must be one of auto, bf16, fp16, fp32, got 'int8'"
    assert check_value("dtype", "bf16") is None
    assert check_value("warp_speed", 9) == "unknown parameter 'warp_speed'"


def test_cross_field_rules_use_values_after_the_change():
    base = defaults()
    assert "image_min_pixels (5000) must not exceed image_max_pixels (4000)" in check_changes(
        {"image_min_pixels": 5000, "image_max_pixels": 4000}, base
    )
    assert check_changes({"image_min_pixels": 5000}, base) is None  # max 0 = checkpoint's value
    assert check_changes({"kv_pool_blocks": 1, "page_size": 8}, base) is None  # pool size: the engine checks


def test_mapping_onto_engine_config_and_sampling():
    values = {**defaults(), "kv_pool_mb": 512, "page_size": 32, "seed": -1, "temperature": 0.7, "top_k": 20}
    config = engine_config(values)
    assert config.model_path == str(DEFAULT_MODEL_DIR)  # '' = the embedded default model
    assert config.kv_pool_mb == 512.0 and isinstance(config.kv_pool_mb, float)
    assert config.page_size == 32
    assert config.sampling == SamplingParams(
        temperature=0.7,
        top_k=20,
        top_p=1.0,
        min_p=0.0,
        repetition_penalty=1.0,
        presence_penalty=0.0,
        seed=None,
        max_new_tokens=128,
    )
    assert sampling_params({**values, "seed": 7}).seed == 7
    assert engine_kwargs({**values, "model_path": "/models/x"}, ("model_path",)) == {
        "model_path": "/models/x",
        "max_sessions": 0,  # multi_turn off: the pool is sized for the running request alone
    }
    assert engine_kwargs({**values, "multi_turn": True}, ())["max_sessions"] == 1


def test_declared_descriptors_enforce_ranges_and_read_only(tmp_path, monkeypatch):
    rclpy = pytest.importorskip("rclpy", reason="rclpy (ROS 2 wheels) is installed by `make test`")
    from rcl_interfaces.msg import SetParametersResult
    from rclpy.parameter import Parameter

    from orin_vlm_node.ros.params import declare_parameters

    monkeypatch.setenv("ROS_LOG_DIR", str(tmp_path))
    context = rclpy.Context()
    rclpy.init(context=context, domain_id=(os.getpid() % 90) + 10)
    try:
        node = rclpy.create_node("params_probe", context=context)
        values = declare_parameters(node)
        assert values == defaults()
        node.add_on_set_parameters_callback(
            lambda ps: SetParametersResult(
                successful=(reason := check_changes({p.name: p.value for p in ps}, values)) is None,
                reason=reason or "",
            )
        )
        ok = node.set_parameters([Parameter("page_size", value=32)])[0]
        assert ok.successful
        refused = node.set_parameters([Parameter("page_size", value=24)])[0]
        assert not refused.successful and "power of two" in refused.reason
        out_of_range = node.set_parameters([Parameter("page_size", value=512)])[0]
        assert not out_of_range.successful  # rclpy's own range check from the descriptor
        read_only = node.set_parameters([Parameter("model_path", value="/elsewhere")])[0]
        assert not read_only.successful and "read-only" in read_only.reason
        described = node.describe_parameter("page_size")
        assert (described.integer_range[0].from_value, described.integer_range[0].to_value) == (1, 256)
        assert "one of: auto, bf16, fp16, fp32" in node.describe_parameter("dtype").additional_constraints
        node.destroy_node()
    finally:
        rclpy.shutdown(context=context)
