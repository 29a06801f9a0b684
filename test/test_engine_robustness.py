"""The engine stays healthy: cancellation (before start, mid-decode, from another thread), pool
exhaustion (prefill and decode, with idle-session eviction), bad input, failures inside the model,
and reconfiguration (validation, lock policy, effects)."""

from __future__ import annotations

import queue
import threading
import weakref
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from test_engine_streaming import SCRIPT, scripted_engine

from orin_vlm_node.engine import Engine, EngineConfig, EngineError, Finished, Request, SamplingParams, TextDelta, Turn
from support.checkpoints import IM_END, cached_tiny_checkpoint

torch.set_num_threads(1)

GREEDY = SamplingParams(temperature=0.0)


def _finish(engine: Engine, request: Request) -> Finished:
    events = list(engine.generate(request))
    assert sum(isinstance(e, Finished) for e in events) == 1 and isinstance(events[-1], Finished)
    return events[-1]


def _healthy(engine: Engine) -> None:
    """Only sessions hold KV blocks after a request, and a normal request still works."""
    held = sum(len(engine.parts.cache.block_table(engine.parts.session_store.get(s).seq)) for s in engine.sessions())
    assert engine.parts.cache.stats()["blocks_used"] == held
    final = _finish(engine, Request(Turn("Go."), SamplingParams(temperature=0.0, max_new_tokens=5)))
    assert final.finish_reason == "length", final.error
    assert final.text == "Hello, 世界！"


@pytest.fixture
def engine(tmp_path_factory) -> Engine:
    return scripted_engine(tmp_path_factory)[0]


# -- cancellation ---------------------------------------------------------------------------------


def test_cancel_mid_decode_from_another_thread(engine):
    request = Request(Turn("Go."), GREEDY)
    events = engine.generate(request)
    first = next(events)
    assert isinstance(first, TextDelta)
    canceller = threading.Thread(target=lambda: engine.cancel(request.request_id))
    canceller.start()
    canceller.join()
    rest = list(events)
    final = rest[-1]
    assert final.finish_reason == "cancelled"
    assert final.text == first.text + "".join(e.text for e in rest[:-1])
    assert 0 < len(final.text) < len(SCRIPT)
    assert engine.parts.cache.stats()["blocks_used"] == 0 and engine.parts.cache.stats()["sequences"] == 0
    _healthy(engine)


def test_cancel_while_consumer_thread_streams(engine):
    request = Request(Turn("Go."), GREEDY, request_id="r-1")
    seen: queue.Queue = queue.Queue()

    def consume():
        for event in engine.generate(request):
            seen.put(event)

    worker = threading.Thread(target=consume)
    worker.start()
    assert isinstance(seen.get(timeout=30), TextDelta)
    assert engine.cancel("r-1") is True
    worker.join(timeout=30)
    events = []
    while not seen.empty():
        events.append(seen.get())
    assert events[-1].finish_reason in ("cancelled", "stop")  # the script may have ended first
    assert engine.cancel("r-1") is False  # finished requests are forgotten
    _healthy(engine)


def test_cancel_before_start_and_unknown_id(engine):
    assert engine.cancel("nope") is False
    request = Request(Turn("Go."), GREEDY)
    events = engine.generate(request)
    assert engine.cancel(request.request_id) is True
    final = list(events)[-1]
    assert final.finish_reason == "cancelled" and final.token_ids == () and final.text == ""
    _healthy(engine)


def test_cancelled_session_turn_keeps_answer_so_far(engine):
    request = Request(Turn("Go."), GREEDY, session_id="s")
    events = engine.generate(request)
    next(events)
    engine.cancel(request.request_id)
    final = list(events)[-1]
    assert final.finish_reason == "cancelled"
    stream = engine.session_token_ids("s")
    assert stream[-1] == IM_END and stream[-1 - len(final.token_ids) : -1] == list(final.token_ids)
    follow = _finish(engine, Request(Turn("Again."), GREEDY, session_id="s"))
    assert follow.finish_reason == "stop" and follow.text == SCRIPT


# -- pool exhaustion ------------------------------------------------------------------------------


def _prompt_len(engine: Engine, text: str) -> int:
    return len(engine.parts.turns.renderer.first_turn(None, Turn(text), [])[0])


def test_a_pool_that_cannot_hold_one_context_is_refused_and_a_full_one_serves_the_limit(tmp_path_factory):
    engine, answer = scripted_engine(tmp_path_factory, page_size=4)
    n = _prompt_len(engine, "Go.")
    blocks = -(-(n + 6) // 4)  # room for the prompt and a few answer tokens, not the whole answer
    with pytest.raises(ValueError, match="cannot hold one max_context_tokens=256 sequence"):
        engine.validate_changes(kv_pool_blocks=blocks)
    with pytest.raises(ValueError, match=f"{blocks} blocks x 4 tokens = {blocks * 4} tokens"):
        engine.reconfigure(kv_pool_blocks=blocks)
    assert engine.config.kv_pool_blocks == 0
    # Pool and context limit agree: a long answer stops at the limit, never in the middle of the pool.
    engine.reconfigure(kv_pool_blocks=blocks, max_context_tokens=blocks * 4)
    final = _finish(engine, Request(Turn("Go."), GREEDY))
    assert final.finish_reason == "length" and 0 < len(final.token_ids) < len(answer)
    assert SCRIPT.startswith(final.text) and final.text
    assert engine.parts.cache.stats()["blocks_used"] == 0
    long_prompt = "Describe every object in the room, one by one, with its colour. " * 3
    final = _finish(engine, Request(Turn(long_prompt), GREEDY))
    assert final.finish_reason == "error" and "prompt is too long" in final.error
    _healthy(engine)


def test_idle_sessions_are_evicted_before_exhausting(tmp_path_factory):
    engine, answer = scripted_engine(tmp_path_factory, page_size=4)
    n = _prompt_len(engine, "Go.")
    blocks = -(-(n + len(answer) + 2) // 4) + 1
    engine.reconfigure(kv_pool_blocks=blocks, max_context_tokens=blocks * 4, prefix_caching=False, max_sessions=2)
    assert _finish(engine, Request(Turn("Go."), GREEDY, session_id="old")).finish_reason == "stop"
    assert engine.sessions() == ["old"]
    final = _finish(engine, Request(Turn("Go."), GREEDY, session_id="new"))
    assert final.finish_reason == "stop" and final.text == SCRIPT
    assert engine.sessions() == ["new"]


def test_sessions_beyond_max_sessions_are_dropped_least_recent_first(tmp_path_factory):
    engine, _ = scripted_engine(tmp_path_factory, page_size=4)
    engine.reconfigure(max_sessions=2)
    for sid in ("a", "b", "c"):
        assert _finish(engine, Request(Turn("Go."), GREEDY, session_id=sid)).finish_reason == "stop"
    assert sorted(engine.sessions()) == ["b", "c"]
    engine.reconfigure(max_sessions=0)  # the KV layout changes: every session goes, and none is kept
    assert _finish(engine, Request(Turn("Go."), GREEDY, session_id="d")).finish_reason == "stop"
    assert engine.sessions() == [] and engine.parts.cache.stats()["blocks_used"] == 0


# -- bad input and failures -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "request_kwargs,fragment",
    [
        (dict(turn=Turn("")), "empty prompt"),
        (dict(turn=Turn("   \n")), "empty prompt"),
        (dict(turn=Turn("Look.", (np.zeros((2, 900, 3), np.uint8),))), "image 0"),
        (dict(turn=Turn("Look.", (np.zeros((64, 64, 3), np.float32),))), "image 0"),
        (dict(turn=Turn("Look.", ("not an image",))), "image 0"),
        (dict(turn=Turn("Look.", (np.zeros((64, 64, 3), np.uint8),), color="hsv")), "color"),
        (dict(turn=Turn("Hi"), sampling=SamplingParams(top_p=0.0)), "top_p"),
        (dict(turn=Turn("Hi"), sampling=SamplingParams(temperature=-1.0)), "temperature"),
        (dict(turn=Turn("Hi"), sampling=SamplingParams(repetition_penalty=0.0)), "repetition_penalty"),
        (dict(turn=Turn("Hi"), sampling=SamplingParams(max_new_tokens=0)), "max_new_tokens"),
        (dict(turn=Turn("word " * 400)), "prompt is too long"),
    ],
)
def test_bad_input_gives_clear_error_and_engine_keeps_serving(engine, request_kwargs, fragment):
    final = _finish(engine, Request(**request_kwargs))
    assert final.finish_reason == "error"
    assert fragment in final.error
    _healthy(engine)


def test_special_token_text_in_a_prompt_is_answered_as_plain_text(engine):
    """A typed image placeholder or end-of-text is text: no image is demanded, the sequence does not end, and
    the prompt is longer (in tokens) than with the expert setting that reads it as control tokens."""
    text = "Hi <|image_pad|> there<|endoftext|><|im_end|>"
    plain = _finish(engine, Request(Turn(text), GREEDY))
    assert plain.finish_reason == "stop" and plain.text == SCRIPT
    engine.reconfigure(prompt_special_tokens=True)
    try:
        raw = _finish(engine, Request(Turn(text), GREEDY))
    finally:
        engine.reconfigure(prompt_special_tokens=False)
    assert raw.finish_reason == "error" and "image placeholder" in raw.error
    _healthy(engine)


def test_a_full_conversation_starts_over_with_a_turn_that_fits_alone(tmp_path_factory):
    """A session turn that does not fit after the earlier turns (but does alone) starts the conversation
    over: the same answer and session as a fresh conversation, the tokens forgotten in the metrics. A turn
    too long even alone is an error that leaves the conversation as it was."""
    engine, _ = scripted_engine(tmp_path_factory, max_context_tokens=96)
    turn = Turn("more " * 20)
    fresh = _finish(engine, Request(turn, GREEDY, session_id="fresh"))
    assert fresh.finish_reason == "stop" and fresh.metrics["forgotten_tokens"] == 0
    fresh_conversation = engine.session_token_ids("fresh")  # before "s" takes the one session kept
    assert _finish(engine, Request(Turn("Go."), GREEDY, session_id="s")).finish_reason == "stop"
    before, held = engine.session_token_ids("s"), len(engine.parts.session_store.get("s").token_ids)
    assert len(before) + fresh.metrics["prompt_tokens"] > 96  # the turn does not fit after the first one
    final = _finish(engine, Request(turn, GREEDY, session_id="s"))
    assert final.finish_reason == "stop" and final.error is None
    assert (final.text, final.token_ids) == (fresh.text, fresh.token_ids)
    assert final.metrics["forgotten_tokens"] == held  # the earlier turns' tokens in the KV
    assert final.metrics["prompt_tokens"] == fresh.metrics["prompt_tokens"]
    assert engine.session_token_ids("s") == fresh_conversation
    after = engine.session_token_ids("s")
    final = _finish(engine, Request(Turn("more " * 200), GREEDY, session_id="s"))
    assert final.finish_reason == "error" and "prompt is too long" in final.error and "96" in final.error
    assert "earlier turns" not in final.error  # too long alone: starting over would not help
    assert engine.session_token_ids("s") == after
    assert _finish(engine, Request(Turn("Go."), GREEDY, session_id="s")).text == SCRIPT
    _healthy(engine)


@pytest.mark.parametrize("fail_at_call", [1, 4], ids=["prefill", "decode"])
def test_exception_inside_model_finishes_with_error(engine, monkeypatch, fail_at_call):
    real = engine.parts.model.forward
    calls = {"n": 0}

    def flaky(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == fail_at_call:
            raise RuntimeError("simulated device fault")
        return real(*args, **kwargs)

    monkeypatch.setattr(engine.parts.model, "forward", flaky)
    for session_id in (None, "s"):
        calls["n"] = 0
        final = _finish(engine, Request(Turn("Go."), GREEDY, session_id=session_id))
        assert final.finish_reason == "error" and "simulated device fault" in final.error
        assert engine.sessions() == []  # a failed first turn leaves no session behind
    _healthy(engine)


def test_missing_or_broken_model_directory_raises_engine_error(tmp_path):
    with pytest.raises(EngineError, match="does not exist"):
        Engine(EngineConfig(model_path=str(tmp_path / "missing")))
    (tmp_path / "empty").mkdir()
    with pytest.raises(EngineError, match="config.json"):
        Engine(EngineConfig(model_path=str(tmp_path / "empty")))
    with pytest.raises(EngineError, match="dtype"):
        Engine(
            EngineConfig(
                model_path=str(cached_tiny_checkpoint(layers=1, tie=False, deepstack=(0,), seed=11)), dtype="int8"
            )
        )


# -- reconfiguration ------------------------------------------------------------------------------


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
    _healthy(engine)


def test_reconfigure_applies_settings(engine):
    engine.reconfigure(sampling=SamplingParams(max_new_tokens=3, temperature=0.0))
    final = _finish(engine, Request(Turn("Go.")))
    assert final.finish_reason == "length" and final.text == "Hello, "
    tokens_before = engine.parts.image_processor.num_image_tokens(480, 640)
    engine.reconfigure(image_max_pixels=64 * 64 * 4)
    assert engine.parts.image_processor.num_image_tokens(480, 640) < tokens_before
    engine.reconfigure(use_paged_attention=False, max_context_tokens=128)
    info = engine.describe()
    assert info["paged_attention"] is False and info["max_context_tokens"] == 128
    assert "dynamic" in info["decode_path"] and info["kv_cache"]["kind"] == "contiguous"
    # The engine default (3 tokens) still applies; the request's own limit wins over it.
    assert _finish(engine, Request(Turn("Go."), SamplingParams(max_new_tokens=64))).text == SCRIPT


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
    assert _finish(engine, Request(Turn("Go."), GREEDY)).finish_reason in ("stop", "length")


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
    _finish(engine, Request(Turn("Go."), GREEDY))
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


def test_closing_the_iterator_mid_stream_frees_the_request(engine):
    events = engine.generate(Request(Turn("Go."), GREEDY))
    assert isinstance(next(events), TextDelta)
    events.close()
    assert engine.parts.cache.stats()["sequences"] == 0 and engine.parts.cache.stats()["blocks_used"] == 0
    _healthy(engine)  # the engine lock was released too


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
    assert _finish(engine, Request(Turn("Go."), GREEDY)).finish_reason in ("stop", "length")
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
