"""Reconfiguring the engine: invalid changes refused with the reason, valid ones applied, a model reload that
frees the old model and pool before loading and answers ``describe`` from before meanwhile, changes that wait
for the request in flight, the kernels in use reused and those replaced unloaded, the freed heap given back."""

from __future__ import annotations

import threading
import weakref
from types import SimpleNamespace

import pytest
import torch
from test_engine_streaming import SCRIPT, assert_healthy, finish_one, scripted_engine

from orin_vlm_node.engine import Engine, Request, SamplingParams, Turn

torch.set_num_threads(1)

GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture
def engine(tmp_path_factory) -> Engine:
    return scripted_engine(tmp_path_factory)[0]


@pytest.mark.parametrize(
    "fields,fragment",
    [
        (dict(page_size=3), "power of two"),
        (dict(page_size=512), "page_size must be in 1..256"),
        (dict(kv_pool_blocks=1), "too small"),
        (dict(use_paged_attention=False, kv_pool_blocks=8), "too small"),
        (dict(kv_pool_mb=-1.0), "kv_pool_mb"),
        (dict(device="cuda"), "CUDA is not available"),
        (dict(device="tpu"), "device"),
        (dict(dtype="int8"), "dtype must be one of"),
        (dict(max_context_tokens=0), "max_context_tokens"),
        (dict(image_min_pixels=10_000, image_max_pixels=5_000), "image_min_pixels"),
        (dict(sampling=SamplingParams(top_k=-2)), "top_k"),
        (dict(flux_capacitor=True), "unknown engine setting"),
    ],
)
def test_invalid_changes_are_rejected_with_reason(engine, fields, fragment):
    if fields.get("device") == "cuda" and torch.cuda.is_available():
        pytest.skip("this machine has CUDA, so device=cuda is valid here")
    before = engine.config
    with pytest.raises(ValueError, match=fragment):
        engine.validate_changes(**fields)
    with pytest.raises(ValueError, match=fragment):
        engine.reconfigure(**fields)
    assert engine.config == before
    assert_healthy(engine)


def test_reconfigure_applies_settings(engine):
    engine.reconfigure(sampling=SamplingParams(max_new_tokens=3, temperature=0.0))
    final = finish_one(engine, Request(Turn("Go.")))
    assert final.finish_reason == "length" and final.text == "Hello, "
    tokens_before = engine.parts.image_processor.num_image_tokens(480, 640)
    engine.reconfigure(image_max_pixels=64 * 64 * 4)
    assert engine.parts.image_processor.num_image_tokens(480, 640) < tokens_before
    engine.reconfigure(use_paged_attention=False, max_context_tokens=128)
    info = engine.describe()
    assert info["paged_attention"] is False and info["max_context_tokens"] == 128
    assert "dynamic" in info["decode_path"] and info["kv_cache"]["kind"] == "contiguous"
    # The engine default (3 tokens) still applies; the request's own limit wins over it.
    assert finish_one(engine, Request(Turn("Go."), SamplingParams(max_new_tokens=64))).text == SCRIPT


def _before_model_loads(monkeypatch, hook) -> None:
    """Run ``hook()`` each time the engine is about to load a model (then load it)."""
    import orin_vlm_node.engine.assemble as assemble_module

    load = assemble_module.load_model

    def hooked(*args, **kwargs):
        hook()
        return load(*args, **kwargs)

    monkeypatch.setattr(assemble_module, "load_model", hooked)


def test_a_model_reload_frees_the_old_model_and_pool_before_loading(engine, monkeypatch):
    """A runtime dtype change loads the model again: the old weights, KV pool and decode step are gone by
    then (on a Jetson two models at once would not fit beside the robot's other software), and the engine
    answers with the new dtype."""
    old_model, old_cache = weakref.ref(engine.parts.model), weakref.ref(engine.parts.cache)
    alive_at_load = []
    _before_model_loads(monkeypatch, lambda: alive_at_load.append((old_model() is not None, old_cache() is not None)))
    engine.reconfigure(dtype="bf16")
    assert alive_at_load == [(False, False)]
    assert engine.describe()["dtype"] == "bfloat16"
    assert finish_one(engine, Request(Turn("Go."), GREEDY)).finish_reason in ("stop", "length")


def test_describe_during_a_model_reload_gives_the_description_from_before(engine, monkeypatch):
    """The node's diagnostics ask every second, from their own thread: while a reconfiguration loads the model
    again (seconds on a Jetson), they get the description from before it, marked busy, not an error from a
    half-built engine; afterwards the new one."""
    loading, finish = threading.Event(), threading.Event()

    def hold() -> None:
        loading.set()
        assert finish.wait(30)

    _before_model_loads(monkeypatch, hold)
    before = engine.describe()
    worker = threading.Thread(target=lambda: engine.reconfigure(dtype="bf16"))
    worker.start()
    try:
        assert loading.wait(30)
        during = engine.describe()
    finally:
        finish.set()
        worker.join(30)
    assert during == {**before, "busy": True}
    assert engine.describe()["dtype"] == "bfloat16" and engine.describe()["busy"] is False


def test_reconfigure_waits_for_in_flight_request(engine):
    events = engine.generate(Request(Turn("Go."), GREEDY))
    next(events)  # the request now holds the engine
    assert engine.describe()["busy"] is True  # diagnostics still answer, from the last snapshot
    worker = threading.Thread(target=lambda: engine.reconfigure(page_size=8))
    worker.start()
    worker.join(timeout=0.5)
    assert worker.is_alive(), "reconfigure must wait for the running request"
    final = list(events)[-1]
    assert final.finish_reason == "stop" and final.text == SCRIPT
    worker.join(timeout=30)
    assert not worker.is_alive() and engine.describe()["page_size"] == 8
    assert engine.describe()["busy"] is False


def test_describe_and_auto_device_dtype(engine):
    info = engine.describe()
    for key in (
        "model_path",
        "device",
        "dtype",
        "paged_attention",
        "page_size",
        "kv_blocks_total",
        "kv_blocks_used",
        "decode_path",
        "kernels",
        "kv_pool",
        "decode",
        "sessions",
        "last_metrics",
        "prefix_caching",
    ):
        assert key in info
    if not torch.cuda.is_available():
        assert info["device"] == "cpu" and info["dtype"] == "float32"
        assert info["decode_path"] == "torch reference (dynamic step)"
        assert info["kernels"] == "kernels: off (cpu device)" and not info["kernels_degraded"]
        assert "auto: 5 x 256-token context" in info["kv_pool"]  # max_batch=4 requests + max_sessions=1
    finish_one(engine, Request(Turn("Go."), GREEDY))
    metrics = engine.describe()["last_metrics"]
    for key in (
        "ttft_s",
        "prefill_tokens_per_s",
        "decode_tokens_per_s",
        "prompt_tokens",
        "prefill_tokens",
        "prefix_hit_tokens",
        "generated_tokens",
        "blocks_in_use",
        "peak_memory_mb",
    ):
        assert key in metrics
    assert metrics["generated_tokens"] == len(engine.parts.tokenizer.encode(SCRIPT)) + 1
    assert metrics["decode_tokens_per_s"] > 0 and metrics["ttft_s"] > 0


class _FakeKernels:
    """A kernel runtime as the engine sees it (``BackendChoice.loaded``): which dtype it holds, whether it was
    closed (its modules unloaded)."""

    def __init__(self, dtype: torch.dtype):
        self.dtypes, self.closed = [str(dtype)], 0

    def close(self) -> None:
        self.closed += 1


def test_reconfigurations_reuse_the_kernels_in_use_and_unload_those_they_replace(monkeypatch, tmp_path_factory):
    """The CUDA kernels of a runtime stay loaded in GPU memory until they are unloaded: a reconfiguration that
    asks for the same kernels gets the runtime in use (not a second copy), one that replaces them unloads the old
    once the new parts are built, and one that fails and rolls back keeps the original and unloads the
    attempt's. (Kernel selection stands in for CUDA here: one runtime per dtype, as the node builds them.)"""
    from orin_vlm_node.cuda import BackendChoice
    from orin_vlm_node.engine import assemble as assemble_module

    loads: list[_FakeKernels] = []

    def select(config, model_config, dtype, device, loaded=()):
        for earlier in loaded:
            if earlier.runtime.dtypes == [str(dtype)]:
                return BackendChoice(False, "fake", loaded=SimpleNamespace(runtime=earlier.runtime, reused=True))
        loads.append(_FakeKernels(dtype))
        return BackendChoice(False, "fake", loaded=SimpleNamespace(runtime=loads[-1], reused=False))

    monkeypatch.setattr(assemble_module, "select_attention", select)
    engine = scripted_engine(tmp_path_factory)[0]
    first = engine.parts.attention.loaded.runtime
    engine.reconfigure(page_size=32)
    engine.reconfigure(use_cuda_graph=False)
    engine.reconfigure(use_cuda_graph=True)
    assert loads == [first] and engine.parts.attention.loaded.runtime is first and not first.closed
    engine.reconfigure(dtype="bf16")
    second = engine.parts.attention.loaded.runtime
    assert loads == [first, second] and (first.closed, second.closed) == (1, 0)

    real_build_cache = assemble_module.build_kv_cache

    def fail_once(*args) -> None:
        monkeypatch.setattr(assemble_module, "build_kv_cache", real_build_cache)
        raise OSError("no memory for the pool")

    monkeypatch.setattr(assemble_module, "build_kv_cache", fail_once)
    with pytest.raises(ValueError, match="previous settings restored: no memory for the pool"):
        engine.reconfigure(dtype="fp32")
    third = loads[-1]
    assert engine.parts.attention.loaded.runtime is second and (second.closed, third.closed) == (0, 1)
    assert finish_one(engine, Request(Turn("Go."), GREEDY)).finish_reason in ("stop", "length")
    engine.close()  # the lifecycle node's cleanup: the kernels in use go too
    assert [k.closed for k in loads] == [1, 1, 1] and engine.parts.model is None and engine.parts.cache is None


def test_a_rebuild_that_replaced_the_model_or_pool_gives_the_freed_heap_back(engine, monkeypatch):
    """glibc keeps a replaced model's or pool's memory in its heap after a reload (a soak with runtime dtype changes
    grew the node to about 1 GB): a rebuild that replaced either trims the heap once its new parts are built, one
    that kept them (kernels, graphs) does not, and closing the engine trims."""
    from orin_vlm_node import host_memory
    from orin_vlm_node.engine import assemble as assemble_module

    trims: list[int] = []
    monkeypatch.setattr(assemble_module.host_memory, "trim", lambda: trims.append(len(trims)) or True)
    engine.reconfigure(dtype="bf16")
    engine.reconfigure(page_size=8)
    assert len(trims) == 2
    engine.reconfigure(use_cuda_graph=False)
    assert len(trims) == 2
    engine.close()
    assert len(trims) == 3
    monkeypatch.undo()
    assert isinstance(host_memory.trim(), bool)  # glibc's malloc_trim here; False where there is none
