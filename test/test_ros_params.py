"""The node's parameters (ros/params.py): declared from the settings schema with their descriptors,
mapped onto EngineConfig/SamplingParams, and the YAML files in config/ kept in step with the schema.
(The rules beyond bounds are the owning layers' and tested there: page size in test_kvcache_config,
device and image limits in test_engine_robustness.) Only the last test creates an rclpy node (no peers)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import yaml

from orin_vlm_node.engine.config import DEFAULT_MODEL_DIR, EngineConfig
from orin_vlm_node.engine.events import SamplingParams
from orin_vlm_node.ros.params import (
    ENGINE_FIELDS,
    SAMPLING_FIELDS,
    channel_values,
    check_changes,
    defaults,
    engine_config,
    engine_kwargs,
    max_sessions,
    sampling_params,
    unknown_parameters_problem,
)
from orin_vlm_node.settings import BY_NAME
from support.node_process import domain_id_for

CONFIG = Path(__file__).resolve().parent.parent / "config"


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
    assert set(SAMPLING_FIELDS) == sampling_fields


def test_default_yaml_lists_every_parameter_with_its_default():
    values = load_params(CONFIG / "orin_vlm.yaml")
    assert values == defaults()
    for name, value in values.items():
        # YAML types must match the declared types, or rclpy refuses the file at startup.
        assert type(value) is type(BY_NAME[name].default), name


@pytest.mark.parametrize("preset", ["jetson_2b.yaml", "jetson_4b.yaml", "jetson_8b.yaml"])
def test_jetson_presets_are_valid(preset):
    values = load_params(CONFIG / preset)
    assert set(values) <= set(BY_NAME)
    for name, value in values.items():
        assert type(value) is type(BY_NAME[name].default), f"{preset}: {name}"
    merged = {**defaults(), **values}
    assert check_changes(values) is None
    assert merged["device"] == "cuda" and merged["dtype"] in ("fp16", "bf16")
    assert merged["use_cuda_graph"] and merged["use_paged_attention"] and merged["kv_pool_mb"] > 0


def test_set_time_check_is_the_schema_bounds():
    assert check_changes({"page_size": 32, "temperature": 0.7}) is None
    assert check_changes({"dtype": "int8"}) == "dtype must be one of auto, bf16, fp16, fp32, got 'int8'"
    assert check_changes({"warp_speed": 9}) == "unknown setting 'warp_speed'"
    assert check_changes({"kv_pool_blocks": 1, "page_size": 8}) is None  # pool size: the engine checks


def test_mapping_onto_engine_config_and_sampling():
    values = {**defaults(), "kv_pool_mb": 512, "page_size": 32, "seed": -1, "temperature": 0.7, "top_k": 20}
    config = engine_config(values)
    assert config.model_path == "" and config.model_dir == DEFAULT_MODEL_DIR  # '' = the embedded default model
    assert config.kv_pool_mb == 512 and isinstance(config.kv_pool_mb, int)
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


@pytest.fixture
def ros_context(tmp_path, monkeypatch):
    """An rclpy context of this test alone (private domain, logs in tmp_path)."""
    rclpy = pytest.importorskip("rclpy", reason="rclpy (ROS 2 wheels) is installed by `make test`")
    monkeypatch.setenv("ROS_LOG_DIR", str(tmp_path))
    context = rclpy.Context()
    rclpy.init(context=context, domain_id=domain_id_for(__name__))
    try:
        yield context
    finally:
        rclpy.shutdown(context=context)


def test_declared_descriptors_enforce_ranges_and_read_only(ros_context):
    import rclpy
    from rcl_interfaces.msg import SetParametersResult
    from rclpy.parameter import Parameter

    from orin_vlm_node.ros.params import declare_parameters

    node = rclpy.create_node("params_probe", context=ros_context)
    values = declare_parameters(node)
    assert values == defaults()
    node.add_on_set_parameters_callback(
        lambda ps: SetParametersResult(
            successful=(reason := check_changes({p.name: p.value for p in ps})) is None,
            reason=reason or "",
        )
    )
    ok = node.set_parameters([Parameter("page_size", value=32)])[0]
    assert ok.successful
    refused = node.set_parameters([Parameter("dtype", value="int8")])[0]
    assert not refused.successful and "dtype must be one of" in refused.reason
    out_of_range = node.set_parameters([Parameter("page_size", value=512)])[0]
    assert not out_of_range.successful  # rclpy's own range check from the descriptor
    for name, value in (("model_path", "/elsewhere"), ("weight_quant", "int4")):  # fixed once the model loaded
        read_only = node.set_parameters([Parameter(name, value=value)])[0]
        assert not read_only.successful and "read-only" in read_only.reason, name
    described = node.describe_parameter("page_size")
    assert (described.integer_range[0].from_value, described.integer_range[0].to_value) == (1, 256)
    assert "one of: auto, bf16, fp16, fp32" in node.describe_parameter("dtype").additional_constraints
    assert "unit: tokens; applies: between requests" in node.describe_parameter("page_size").additional_constraints
    node.destroy_node()


def test_channel_overrides_are_checked_as_the_setting_they_override():
    assert check_changes({"arm.max_new_tokens": 64, "arm.system_prompt": "x", "nav.image_topics": ["a", "b"]}) is None
    assert check_changes({"arm.max_new_tokens": None}) is None  # not set: the node-wide value
    assert check_changes({"arm.max_new_tokens": 0}) == "arm.max_new_tokens must be in 1..32768 tokens, got 0"
    assert check_changes({"nav.image_topics": ["a", "a"]}) == "nav.image_topics lists a more than once"
    assert check_changes({"arm.temperature": 0.5}) == "unknown setting 'arm.temperature'"


def test_a_channel_uses_its_overrides_that_are_set_and_the_node_wide_rest():
    values = {**defaults(), "channels": ["arm", "nav"], "system_prompt": "node", "max_new_tokens": 50,
              "arm.max_new_tokens": 5, "arm.system_prompt": None, "nav.system_prompt": ""}  # fmt: skip
    arm, nav = channel_values(values, "arm"), channel_values(values, "nav")
    assert (arm["max_new_tokens"], arm["system_prompt"]) == (5, "node")
    assert (nav["max_new_tokens"], nav["system_prompt"]) == (50, "")  # set to empty: no system prompt
    assert channel_values(values, "") == values
    assert max_sessions({**values, "multi_turn": True}) == 2  # one conversation per channel
    assert max_sessions({**defaults(), "multi_turn": True}) == 1


def test_each_channel_gets_its_override_parameters_declared_unset(ros_context):
    import rclpy
    from rclpy.parameter import Parameter

    from orin_vlm_node.ros.params import declare_parameters

    overrides = [Parameter("channels", value=["arm", "nav"]), Parameter("nav.max_new_tokens", value=9)]
    node = rclpy.create_node("channels_probe", context=ros_context, parameter_overrides=overrides)
    values = declare_parameters(node)
    assert values["channels"] == ["arm", "nav"]
    assert [values[f"{ch}.max_new_tokens"] for ch in ("arm", "nav")] == [None, 9]
    assert values["arm.image_topics"] is None and values["arm.system_prompt"] is None
    described = node.describe_parameter("arm.max_new_tokens")
    assert (described.integer_range[0].from_value, described.integer_range[0].to_value) == (1, 32_768)
    assert "not set = the node-wide max_new_tokens" in described.description
    assert node.set_parameters([Parameter("arm.max_new_tokens", value=5)])[0].successful
    refused = node.set_parameters([Parameter("arm.image_topics", value=["front"])])[0]
    assert not refused.successful and "read-only" in refused.reason
    node.destroy_node()


def test_unknown_parameters_are_named_with_the_nearest_known_name():
    """rclpy drops a given parameter that is never declared; the node names each such one (typos first of all)."""
    known = [*defaults(), "use_sim_time", "arm.max_new_tokens"]
    assert unknown_parameters_problem(["page_size", "arm.max_new_tokens", "use_sim_time"], known) is None
    problem = unknown_parameters_problem(["kv_pool_mbs", "zzz", "arm.max_new_tokes", "page_size"], known)
    assert problem == (
        "unknown parameter(s) ignored: arm.max_new_tokes (did you mean arm.max_new_tokens?), "
        "kv_pool_mbs (did you mean kv_pool_mb?), zzz"
    )
