"""The settings schema and what is derived from it or held to it: EngineConfig's fields and defaults,
SamplingParams, the README's parameter table, the bounds checks every frontend shares."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from orin_vlm_node import settings
from orin_vlm_node.engine.config import EngineConfig, config_from_settings, sampling_from_settings
from orin_vlm_node.engine.events import SamplingParams
from tools.settings_table import render

REPO = Path(__file__).resolve().parent.parent


def test_engine_config_is_the_engine_settings_with_their_defaults():
    fields = {f.name: f for f in dataclasses.fields(EngineConfig)}
    engine = settings.settings_for("engine")
    # max_sessions and the default sampling are set through the Python API (the node derives max_sessions).
    assert set(fields) == {s.name for s in engine} | {"max_sessions", "sampling"}
    default = EngineConfig()
    for s in engine:
        value = getattr(default, s.name)
        assert value == s.default and type(value) is s.type, s.name


def test_sampling_settings_are_sampling_params_fields():
    names = {f.name for f in dataclasses.fields(SamplingParams)}
    assert {s.name for s in settings.settings_for("sampling")} <= names
    sampling = sampling_from_settings(settings.defaults())
    assert sampling.seed is None and sampling.temperature == 0.0 and sampling.max_new_tokens == 128


def test_config_from_settings_round_trips_every_engine_value():
    values = settings.defaults() | {"page_size": 32, "kv_pool_mb": 64, "use_cuda_graph": False, "top_k": 5}
    config = config_from_settings(values, max_sessions=2, max_batch=3)
    assert (config.page_size, config.kv_pool_mb, config.use_cuda_graph, config.max_sessions) == (32, 64, False, 2)
    assert config.max_batch == 3  # the frontend says how many requests it runs at once
    assert config.sampling.top_k == 5 and config.model_dir.name == "default_model"


def test_readme_parameter_table_is_the_rendered_schema():
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    assert render() in readme, "README's parameter table is out of date: paste `python -m tools.settings_table`"


@pytest.mark.parametrize(
    ("name", "value", "reason"),
    [
        ("page_size", 16, None),
        ("page_size", 0, "page_size must be in 1..256 tokens, got 0"),
        ("page_size", 1.5, "page_size must be an integer"),
        ("page_size", True, "page_size must be an integer"),
        ("temperature", 1, None),  # an int is a fine float
        ("temperature", float("nan"), "temperature must be a number"),
        ("dtype", "int8", "dtype must be one of auto, bf16, fp16, fp32"),
        ("multi_turn", "yes", "multi_turn must be true or false"),
        ("kernel_dir", 3, "kernel_dir must be a string"),
        ("flux_capacitor", 1, "unknown setting 'flux_capacitor'"),
        ("image_topics", ["front", "wrist"], None),
        ("image_topics", ("front",), None),
        ("image_topics", "front", "image_topics must be a list of non-empty strings"),
        ("image_topics", ["front", ""], "image_topics must be a list of non-empty strings"),
        ("image_topics", ["front", 3], "image_topics must be a list of non-empty strings"),
        ("image_topics", [], "image_topics must have 1..8 entries, got 0"),
        ("image_topics", [f"cam{i}" for i in range(9)], "image_topics must have 1..8 entries, got 9"),
        ("image_topics", ["front", "rear", "front"], "image_topics lists front more than once"),
    ],
)
def test_bounds_types_and_choices_are_checked_in_one_place(name, value, reason):
    found = settings.problem({name: value})
    assert found == reason if reason is None else found.startswith(reason)
    if reason:
        with pytest.raises(ValueError, match=reason.split(",")[0]):
            settings.check({name: value})


def test_every_setting_has_a_description_and_bounds_that_hold_its_default():
    for s in settings.SETTINGS:
        assert s.description and s.problem(s.default) is None, s.name
        assert (s.min is None) == (s.max is None), s.name
        assert s.flag == "--" + s.name.replace("_", "-")
