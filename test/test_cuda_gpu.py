"""On a real GPU: kernels built by build.py, loaded by runtime.py, against the torch reference; CUDA-graph decode.

Skipped without CUDA or PyCUDA (see docs/cuda-kernels.md for running these on a Jetson).
"""

from __future__ import annotations

import functools
import importlib.util

import pytest
import torch

from orin_vlm_node.cuda import AttentionShape, CudaPagedAttention, DecodeGraph, select_backend
from orin_vlm_node.kvcache.attention import TorchPagedAttention
from orin_vlm_node.kvcache.config import KVCacheConfig
from orin_vlm_node.kvcache.paged import PagedKVCache
from support.quantized_copies import awq_copy, gptq_copy, int_copy

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (torch.cuda.is_available() is False)"),
    pytest.mark.skipif(importlib.util.find_spec("pycuda") is None, reason="needs PyCUDA (pip install pycuda)"),
]


@pytest.fixture(scope="module")
def kernel_cache(tmp_path_factory) -> str:
    """One kernel cache for the module: the first engine builds the kernels (the cold path), the others load
    the cubins it cached, as a robot's restarts do (the diagnostics step of the GPU check times both)."""
    return str(tmp_path_factory.mktemp("kernel_cache"))


@pytest.fixture(scope="module")
def backend(kernel_cache):
    shape = AttentionShape(torch.float16, 128, 16, 8)
    choice = select_backend("cuda", True, shape, kernel_cache_dir=kernel_cache, allow_kernel_fallback=False)
    assert choice.kernels and isinstance(choice.attention_impl, CudaPagedAttention)
    return choice


@pytest.fixture(scope="module")
def all_kernels(kernel_cache):
    """Every dtype's kernels in one runtime, for the tests that compare each dtype with torch (a node loads its
    model's dtype only, as ``backend`` does); each dtype built as the node builds it."""
    from orin_vlm_node.cuda.launch import DTYPE_TAGS
    from orin_vlm_node.cuda.runtime import load_runtime

    device = torch.device("cuda", torch.cuda.current_device())
    runtime = load_runtime(device, cache_dir=kernel_cache, dtypes=tuple(DTYPE_TAGS.values())).runtime
    assert runtime.dtypes == sorted(DTYPE_TAGS.values())
    return runtime


@pytest.fixture(scope="module")
def timer():
    """``device_us`` on one capture stream for the module, as the engine binds it."""
    from orin_vlm_node.cuda.graph import device_us

    return functools.partial(device_us, stream=torch.cuda.Stream())


def test_gpu_launches_are_programmatic_dependent_from_hopper_on(backend):
    """On sm_90 and later every kernel is launched so it may start while the one before it finishes (each
    waits for that one's stores first): the load-time check of dependent launches, eager and captured,
    passed. Before sm_90 launches stay plain and the status says why."""
    runtime = backend.launcher
    if torch.cuda.get_device_capability() >= (9, 0):
        assert runtime.programmatic and runtime.programmatic_status == "on", runtime.programmatic_status
    else:
        assert not runtime.programmatic and runtime.programmatic_status.startswith("off (sm_")
    assert f"programmatic dependent launch {runtime.programmatic_status}" in backend.status


def test_gpu_decode_graphs_keep_the_faster_of_dependent_and_plain_launches(tmp_path_factory, kernel_cache):
    """The engine's decode graphs: each captured both ways at its first use and the faster replay kept, both
    times in ``describe``; a benchmark's forced on and off (``bench.gpu_engines.launching``) capture one way
    (off wherever dependent launch does not work). The tokens are the same all three ways (the same kernels, launched
    differently), and the runtime's switch is back as it was after the captures."""
    import re

    from bench.gpu_engines import launching
    from orin_vlm_node.engine import Engine, EngineConfig, Request, SamplingParams, Turn

    path = str(_tiny(tmp_path_factory, 64))
    common = dict(model_path=path, device="cuda", dtype="fp32", max_context_tokens=512, kernel_cache_dir=kernel_cache,
                  allow_kernel_fallback=False)  # fmt: skip
    sampling = SamplingParams(temperature=0.0, max_new_tokens=64, ignore_eos=True)
    turn = Turn("Tell the robot what to do next, step by step.")
    tokens, ways = {}, {}
    for setting in ("auto", "on", "off"):
        engine = Engine(EngineConfig(**common))
        if setting != "auto":
            launching(engine, setting)
        tokens[setting] = list(engine.generate(Request(turn, sampling)))[-1].token_ids
        ways[setting] = engine.describe()["decode"]["dependent_launch"]
        runtime = engine.parts.attention.launcher
        dependent = runtime.programmatic_status == "on"
        assert runtime.programmatic == dependent
    assert tokens["auto"] == tokens["on"] == tokens["off"]
    assert ways["auto"] and set(ways["off"].values()) == {"off"}
    assert set(ways["on"].values()) == {"on" if dependent else "off"}
    timed = r"(on|off) \(a replay \d+ us dependent, \d+ us plain\)" if dependent else "off"
    assert all(re.fullmatch(timed, way) for way in ways["auto"].values()), ways["auto"]


def _caches(impl, dtype, page, nkv, hd, max_ctx):
    cfg = KVCacheConfig(
        num_layers=1,
        num_kv_heads=nkv,
        head_dim=hd,
        dtype=dtype,
        device="cuda",
        page_size=page,
        kv_pool_blocks=2 * (max_ctx // page) + 8,
        max_context_tokens=max_ctx,
        prefix_caching=False,
    )
    return PagedKVCache(cfg, attention_impl=impl), PagedKVCache(cfg, attention_impl=TorchPagedAttention())


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize(
    ("hd", "nq", "nkv", "page"), [(128, 16, 8, 16), (64, 8, 1, 32), (128, 32, 4, 1), (32, 8, 2, 16), (256, 16, 1, 64)]
)
def test_gpu_prefill_and_decode_match_torch(all_kernels, dtype, hd, nq, nkv, page):
    impl = CudaPagedAttention(all_kernels, sm_count=all_kernels.sm_count)
    ours, ref = _caches(impl, dtype, page, nkv, hd, 2048)
    atol = {torch.float32: 1e-4, torch.float16: 4e-3, torch.bfloat16: 3e-2}[dtype]
    sa, sb = ours.new_sequence(), ref.new_sequence()
    for chunk in (700, 333):
        q = torch.randn(chunk, nq, hd, device="cuda").to(dtype)
        k = torch.randn(chunk, nkv, hd, device="cuda").to(dtype)
        v = torch.randn(chunk, nkv, hd, device="cuda").to(dtype)
        torch.testing.assert_close(ours.step(sa, chunk)(0, q, k, v), ref.step(sb, chunk)(0, q, k, v), atol=atol, rtol=0)
    ba, bb = ours.new_static_decode_buffers(), ref.new_static_decode_buffers()
    da, db = ours.static_decode_attention(ba), ref.static_decode_attention(bb)
    # Split-K in one launch (the last split of a group combines): 40 steps on the same counters.
    assert impl.decode_plan(2048, nq, nkv)[0] > 1
    for _ in range(40):
        ours.prepare_static_decode(sa, ba)
        ref.prepare_static_decode(sb, bb)
        q = torch.randn(1, nq, hd, device="cuda").to(dtype)
        k = torch.randn(1, nkv, hd, device="cuda").to(dtype)
        v = torch.randn(1, nkv, hd, device="cuda").to(dtype)
        torch.testing.assert_close(da(0, q, k, v), db(0, q, k, v), atol=atol, rtol=0)


def test_gpu_graph_decode_replays_across_page_boundaries(backend):
    """Capture the static decode attention once; replays after host-side prepare match eager torch."""
    impl = backend.attention_impl
    dtype, hd, nq, nkv, page = torch.float16, 128, 16, 8, 16
    ours, ref = _caches(impl, dtype, page, nkv, hd, 1024)
    sa, sb = ours.new_sequence(), ref.new_sequence()
    n = 40
    q0 = torch.randn(n, nq, hd, device="cuda").to(dtype)
    k0 = torch.randn(n, nkv, hd, device="cuda").to(dtype)
    v0 = torch.randn(n, nkv, hd, device="cuda").to(dtype)
    ours.step(sa, n)(0, q0, k0, v0)
    ref.step(sb, n)(0, q0, k0, v0)
    ba, bb = ours.new_static_decode_buffers(), ref.new_static_decode_buffers()
    da, db = ours.static_decode_attention(ba), ref.static_decode_attention(bb)
    q_in = torch.zeros(1, nq, hd, device="cuda", dtype=dtype)
    k_in = torch.zeros(1, nkv, hd, device="cuda", dtype=dtype)
    v_in = torch.zeros(1, nkv, hd, device="cuda", dtype=dtype)
    runner = DecodeGraph(lambda: da(0, q_in, k_in, v_in), "cuda", stream=torch.cuda.Stream())
    for _ in range(30):  # slots 40..69 cross the page boundaries at 48 and 64
        ours.prepare_static_decode(sa, ba)
        ref.prepare_static_decode(sb, bb)
        q_in.normal_()
        k_in.normal_()
        v_in.normal_()
        out = runner.run().clone()
        torch.testing.assert_close(out, db(0, q_in, k_in, v_in), atol=4e-3, rtol=0)
    assert runner.captured and runner.replays >= 29, runner.describe()


def same_greedy_answer(fast, slow, text: str, tokens: int):
    """The greedy answers of engines ``fast`` and ``slow`` to ``text``, ``tokens`` long (EOS ignored), are full
    length and the same tokens."""
    from orin_vlm_node.engine import Request, SamplingParams, Turn

    request = Request(Turn(text), SamplingParams(temperature=0.0, max_new_tokens=tokens, ignore_eos=True))
    a = list(fast.generate(request))[-1]
    b = list(slow.generate(request))[-1]
    assert a.finish_reason == b.finish_reason == "length"
    assert a.token_ids == b.token_ids


def _tiny(tmp_path_factory, head_dim: int):
    from support.checkpoints import make_tiny_checkpoint

    return make_tiny_checkpoint(
        tmp_path_factory.mktemp(f"gpu_ckpt_hd{head_dim}"), layers=2, num_heads=8, num_kv_heads=2,
        head_dim=head_dim, hidden=128, tie=False, seed=7,
    )  # fmt: skip


@pytest.mark.parametrize("head_dim", [32, 64, 128, 256])
def test_gpu_engine_kernels_and_graphs_match_the_torch_path_across_context_buckets(
    tmp_path_factory, kernel_cache, head_dim
):
    """fp32, 300 greedy tokens from a 1024-token limit: the static step moves from the 256 to the 512
    bucket (a second graph) and crosses many pages; tokens equal the eager torch path's."""
    from orin_vlm_node.engine import Engine, EngineConfig

    path = str(_tiny(tmp_path_factory, head_dim))
    common = dict(model_path=path, device="cuda", dtype="fp32", max_context_tokens=1024, kernel_cache_dir=kernel_cache)
    fast = Engine(EngineConfig(**common, allow_kernel_fallback=False))
    slow = Engine(EngineConfig(**common, use_cuda_kernels=False, use_cuda_graph=False))
    info = fast.describe()
    assert info["kernels"].startswith("kernels: on") and info["decode_path"] == "kernels+graphs (static step)"
    assert slow.describe()["decode_path"] == "torch reference (static step)"
    same_greedy_answer(fast, slow, "Tell the robot what to do next, step by step.", 300)
    decode = fast.describe()["decode"]
    assert decode["graphs"] == "on" and decode["graphs_captured"] >= 2, decode


def test_gpu_engine_batches_in_graphs_and_every_request_gets_its_tokens_alone(tmp_path_factory, kernel_cache):
    """fp32, kernels + graphs: four requests of different lengths decode together (batch buckets 4, then 2
    and 1 as they finish, 3 replaying the bucket of 4 with a padding row), each with its tokens alone."""
    from orin_vlm_node.engine import Engine, EngineConfig, Finished, Request, SamplingParams, Turn

    path = str(_tiny(tmp_path_factory, 64))
    engine = Engine(EngineConfig(model_path=path, device="cuda", dtype="fp32", max_context_tokens=1024,
                                 kernel_cache_dir=kernel_cache, allow_kernel_fallback=False, max_batch=4))  # fmt: skip
    requests = [
        Request(Turn(text), SamplingParams(temperature=0.0, max_new_tokens=n, ignore_eos=True))
        for text, n in [("Describe the scene.", 40), ("Count the boxes. " * 30, 300), ("Where?", 90), ("Go.", 150)]
    ]
    alone = [list(engine.generate(r))[-1].token_ids for r in requests]
    streams = [engine.generate(r) for r in requests]
    finals: list = [None] * len(streams)
    while any(f is None for f in finals):
        for i, stream in enumerate(streams):
            if finals[i] is None:
                event = next(stream)
                finals[i] = event if isinstance(event, Finished) else None
    assert [f.finish_reason for f in finals] == ["length"] * 4
    assert [f.token_ids for f in finals] == alone
    assert max(f.metrics["batch_size"] for f in finals) == 4
    decode = engine.describe()["decode"]
    assert decode["graphs"] == "on" and decode["graphs_captured"] >= 4, decode


def test_gpu_overlapped_decode_answers_as_the_step_by_step_decode(tmp_path_factory, kernel_cache):
    """fp32, kernels + graphs: the static step overlaps on CUDA (token N read after step N+1 launched,
    through pinned memory and an event); switched off, the same engine reads every token before the next
    step. Every event of greedy, seeded and penalised answers, one ending at a stop string, is the same."""
    from orin_vlm_node.engine import Engine, EngineConfig, Request, SamplingParams, Turn

    path = str(_tiny(tmp_path_factory, 64))
    engine = Engine(EngineConfig(model_path=path, device="cuda", dtype="fp32", max_context_tokens=1024,
                                 kernel_cache_dir=kernel_cache, allow_kernel_fallback=False))  # fmt: skip
    turn = Turn("Tell the robot what to do next, step by step.")
    samplings = [
        SamplingParams(temperature=0.0, max_new_tokens=120),
        SamplingParams(temperature=0.8, top_p=0.9, seed=5, repetition_penalty=1.2, max_new_tokens=80),
        SamplingParams(temperature=0.0, presence_penalty=0.5, max_new_tokens=80),
    ]

    def answers() -> list[list[tuple]]:
        return [[(type(e).__name__, e.text, e.token_ids) for e in engine.generate(Request(turn, s))] for s in samplings]

    assert engine.parts.decode_step.overlap
    overlapped = answers()
    text = overlapped[0][-1][1]
    stop = text[len(text) // 2 :][:3]
    samplings.append(SamplingParams(temperature=0.0, max_new_tokens=120, stop=(stop,)))
    overlapped.append(answers()[-1])
    engine.parts.decode_step.overlap = False
    assert answers() == overlapped
    assert overlapped[-1][-1][1] == text[: text.index(stop)]
    assert engine.describe()["kv_blocks_used"] == 0


@pytest.mark.parametrize("mode", ["int8", "int4"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize(("n", "k"), [(4096, 2048), (2048, 6144), (37, 75)])
def test_gpu_quantized_gemv_matches_the_torch_reference(all_kernels, mode, dtype, n, k):
    import torch.nn.functional as F

    from orin_vlm_node.cuda.gemv import CudaGemv
    from orin_vlm_node.weights.quant import QuantizedLinear, WeightQuant

    weight = torch.randn(n, k, device="cuda") * 0.02
    module = QuantizedLinear.from_weight(weight, WeightQuant(mode, 128 if k % 128 == 0 else 32))
    gemv = CudaGemv(all_kernels)
    reference = module.dequantize(torch.float32)
    for rows in (1, 4, 8):
        x = torch.randn(rows, k, device="cuda").to(dtype)
        expected = F.linear(x.float(), reference)
        tol = {torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[dtype] * expected.abs().amax().item()
        torch.testing.assert_close(gemv(module, x).float(), expected, rtol=0, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("n", "k", "group"), [(12288, 2048, 128), (37, 75, 32)])
def test_gpu_int4_weight_widened_for_a_prefill_is_the_reference_to_the_bit(all_kernels, dtype, n, k, group):
    """``widen_int4`` on the GPU gives what torch's ops give for the reference's widened weight, bit for bit
    (nvcc must not contract its product and sum into one rounding), and a prefill's rows multiply it."""
    from orin_vlm_node.cuda.gemv import CudaGemv
    from orin_vlm_node.weights.quant import QuantizedLinear, WeightQuant

    module = QuantizedLinear.from_weight(torch.randn(n, k, device="cuda") * 0.02, WeightQuant("int4", group))
    gemv = CudaGemv(all_kernels)
    assert torch.equal(gemv.widen(module, dtype), module.dequantize(dtype))
    x = torch.randn(40, k, device="cuda").to(dtype)
    want = module(x)
    module.kernels = gemv
    assert torch.equal(module(x), want)


def _projection(gemv, mode: str, dtype: torch.dtype, n: int, k: int):
    """A random N x K projection whose products ``gemv`` computes: float weights in ``dtype``, or quantized."""
    from orin_vlm_node.weights.gemv_linear import GemvLinear
    from orin_vlm_node.weights.quant import QuantizedLinear, WeightQuant

    weight = torch.randn(n, k, device="cuda") * 0.02
    if mode != "float":
        module = QuantizedLinear.from_weight(weight, WeightQuant(mode, 128))
        module.kernels = gemv
        return module
    linear = torch.nn.Linear(k, n, bias=False, device="cuda", dtype=dtype)
    with torch.no_grad():
        linear.weight.copy_(weight)
    return GemvLinear(linear, gemv, rows=gemv.max_rows)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("n", "k"), [(4096, 2048), (2048, 6144), (37, 75)])
def test_gpu_float_gemv_matches_f_linear_and_is_timed_against_it(all_kernels, timer, dtype, n, k):
    import torch.nn.functional as F

    from orin_vlm_node.cuda.gemv import CudaGemv
    from orin_vlm_node.weights.gemv_linear import GemvLinear

    linear = torch.nn.Linear(k, n, bias=False, device="cuda", dtype=dtype)
    gemv = CudaGemv(all_kernels, timer)
    module = GemvLinear(linear, gemv, rows=gemv.max_rows)
    for rows in (1, 3, 8):
        x = torch.randn(rows, k, device="cuda").to(dtype)
        expected = F.linear(x.float(), linear.weight.float())
        tol = {torch.float16: 2e-3, torch.bfloat16: 1.6e-2, torch.float32: 1e-5}[dtype] * expected.abs().amax().item()
        torch.testing.assert_close(module(x).float(), expected, rtol=0, atol=tol)
    rows, why = gemv.faster_rows([linear.weight])  # device time in CUDA graphs, both sides
    assert rows in (0, 1, 2, 4, 8) and "kernel vs F.linear: 1 row " in why, why


@pytest.mark.parametrize("mode", ["float", "int8", "int4"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gpu_swiglu_epilogue_matches_the_product_then_the_activation(all_kernels, timer, mode, dtype):
    """The 2B's fused gate/up shape (2 x 6144 rows of 2048): silu(gate) * up from one kernel, against the
    product rounded to the dtype, then torch's activation; a float weight is timed with its activation."""
    import torch.nn.functional as F

    from orin_vlm_node.cuda.gemv import CudaGemv
    from orin_vlm_node.weights.gemv_linear import GemvLinear
    from orin_vlm_node.weights.quant import QuantizedLinear, WeightQuant

    weight = (torch.randn(12288, 2048, device="cuda") * 0.02).to(dtype)
    gemv = CudaGemv(all_kernels, timer)
    if mode == "float":
        linear = torch.nn.Linear(2048, 12288, bias=False, device="meta")
        linear.weight = torch.nn.Parameter(weight, requires_grad=False)
        module, reference = GemvLinear(linear, gemv, rows=gemv.max_rows), weight.float()
    else:
        module = QuantizedLinear.from_weight(weight, WeightQuant(mode, 128))
        module.kernels, reference = gemv, module.dequantize(torch.float32)
    for rows in (1, 4, 8):
        x = torch.randn(rows, 2048, device="cuda").to(dtype)
        gate, up = F.linear(x.float(), reference).to(dtype).float().chunk(2, dim=-1)
        expected = F.silu(gate).to(dtype).float() * up
        tol = {torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[dtype] * expected.abs().amax().item()
        torch.testing.assert_close(gemv(module, x, swiglu=True).float(), expected, rtol=0, atol=tol)
    if mode == "float":
        rows, why = gemv.faster_rows([weight], swiglu=True)
        assert rows in (0, 1, 2, 4, 8) and "kernel vs F.linear: 1 row " in why, why


def test_gpu_engine_float_gemv_says_what_it_measured_and_answers_as_without_kernels(tmp_path_factory, kernel_cache):
    """fp32: the float projections the GEMV kernel won (timed at startup) inside the captured decode graphs
    give the tokens of torch's products, 200 greedy tokens; turning the kernels off at runtime puts the
    model back as loaded."""
    from orin_vlm_node.engine import Engine, EngineConfig
    from orin_vlm_node.weights.gemv_linear import GemvLinear

    path = str(_tiny(tmp_path_factory, 64))
    common = dict(model_path=path, device="cuda", dtype="fp32", max_context_tokens=512, kernel_cache_dir=kernel_cache)
    fast = Engine(EngineConfig(**common, allow_kernel_fallback=False))
    slow = Engine(EngineConfig(**common, use_cuda_kernels=False, use_cuda_graph=False))
    path_used = fast.describe()["weight_path"]
    assert path_used.startswith("float weights: GEMV kernels for decode rows: ") and "kernel vs F.linear" in path_used
    assert slow.describe()["weight_path"].startswith("float weights: F.linear")
    same_greedy_answer(fast, slow, "Tell the robot what to do next, step by step.", 200)
    fast.reconfigure(use_cuda_kernels=False)
    assert not any(isinstance(m, GemvLinear) for m in fast.parts.model.modules())


def test_gpu_engine_holds_little_beyond_weights_and_pool_and_rebuilds_do_not_grow_it(tmp_path_factory, kernel_cache):
    """What torch reserves for an engine beyond its weights and KV pool (decode graphs, cuBLAS's workspace
    on the capture stream, buffers) is tens of MB: it was about half a GB for a 9 MB model when every
    timing graph of the startup took a stream of its own, each given a cuBLAS workspace for good. Rebuilding
    the backend at runtime (weight shapes timed again, graphs captured again) leaves it where it was."""
    import gc

    from orin_vlm_node.engine import Engine, EngineConfig, Request, SamplingParams, Turn

    def reserved() -> int:
        gc.collect()
        torch.cuda.empty_cache()
        return torch.cuda.memory_reserved()

    path = str(_tiny(tmp_path_factory, 64))
    before = reserved()
    engine = Engine(EngineConfig(model_path=path, device="cuda", dtype="fp16", max_context_tokens=512,
                                 kernel_cache_dir=kernel_cache, allow_kernel_fallback=False))  # fmt: skip
    sampling = SamplingParams(temperature=0.0, max_new_tokens=40, ignore_eos=True)
    turn = Turn("Tell the robot what to do next.")

    def extra_mb() -> float:
        assert list(engine.generate(Request(turn, sampling)))[-1].finish_reason == "length"
        held = engine.parts.weight_bytes + engine.describe()["kv_cache"]["pool_bytes"]
        return (reserved() - before - held) / 2**20

    first = extra_mb()
    assert first < 128, f"{first:.0f} MB reserved beyond the weights and the KV pool"
    for _ in range(3):
        engine.reconfigure(use_cuda_graph=False)
        engine.reconfigure(use_cuda_graph=True)
    assert extra_mb() <= first + 8


def test_gpu_engine_loads_its_dtypes_kernels_once_and_unloads_those_a_reconfiguration_replaced(
    tmp_path_factory, kernel_cache
):
    """An fp16 engine builds and loads the fp16 kernels only; reconfigurations that rebuild the backend keep
    that runtime (its modules are not loaded again); a dtype change loads the new dtype's and unloads the old
    (a launch on it is refused), so the GPU's free memory stays where it was over many changes."""
    from orin_vlm_node.cuda import launch as L
    from orin_vlm_node.cuda.runtime import CudaRuntimeError
    from orin_vlm_node.engine import Engine, EngineConfig, Request, SamplingParams, Turn

    path = str(_tiny(tmp_path_factory, 64))
    engine = Engine(EngineConfig(model_path=path, device="cuda", dtype="fp16", max_context_tokens=512,
                                 kernel_cache_dir=kernel_cache, allow_kernel_fallback=False))  # fmt: skip
    runtime = engine.parts.attention.launcher
    assert runtime.dtypes == ["f16"]
    assert set(runtime.kernels()) == {k for names in L.kernel_modules(["f16"]).values() for k in names}
    engine.reconfigure(page_size=32)
    engine.reconfigure(use_cuda_graph=False)
    assert engine.parts.attention.launcher is runtime and "(loaded before, reused)" in engine.parts.attention.status
    sampling = SamplingParams(temperature=0.0, max_new_tokens=16, ignore_eos=True)
    turn = Turn("Tell the robot what to do next.")

    def answers() -> None:
        assert list(engine.generate(Request(turn, sampling)))[-1].finish_reason == "length"

    def free_mb() -> float:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        return torch.cuda.mem_get_info()[0] / 2**20

    engine.reconfigure(dtype="bf16")
    assert engine.parts.attention.launcher.dtypes == ["bf16"]
    out, gate_up = (
        torch.empty(1, 256, device="cuda", dtype=torch.float16),
        torch.zeros(1, 512, device="cuda", dtype=torch.float16),
    )
    with pytest.raises(CudaRuntimeError, match="not loaded"):
        runtime.launch(L.silu_mul_launch(1, 256, torch.float16), [out, gate_up, 1, 256])
    answers()
    before = free_mb()
    for dtype in ("fp16", "bf16") * 4:
        engine.reconfigure(dtype=dtype)
    answers()
    assert free_mb() >= before - 16, f"{before - free_mb():.0f} MB of GPU memory gone over 8 dtype changes"
    last = engine.parts.attention.launcher  # bf16, the last change's
    last.launch(L.silu_mul_launch(1, 256, torch.bfloat16), [out.bfloat16(), gate_up.bfloat16(), 1, 256])
    engine.close()  # the lifecycle node's cleanup
    with pytest.raises(CudaRuntimeError, match="not loaded"):
        last.launch(L.silu_mul_launch(1, 256, torch.bfloat16), [out.bfloat16(), gate_up.bfloat16(), 1, 256])


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_gpu_engine_quantized_kernels_and_graphs_match_the_torch_path(tmp_path_factory, kernel_cache, mode):
    """fp32 activations: the GEMV kernels inside the captured decode graphs give the tokens of the torch
    path (weights widened for torch's GEMM), 200 greedy tokens."""
    from orin_vlm_node.engine import Engine, EngineConfig

    path = str(_tiny(tmp_path_factory, 64))
    common = dict(model_path=path, device="cuda", dtype="fp32", max_context_tokens=512, kernel_cache_dir=kernel_cache,
                  weight_quant=mode, weight_quant_group_size=32)  # fmt: skip
    fast = Engine(EngineConfig(**common, allow_kernel_fallback=False))
    slow = Engine(EngineConfig(**common, use_cuda_kernels=False, use_cuda_graph=False))
    assert fast.describe()["weight_path"].startswith(f"{mode}: GEMV kernels")
    assert slow.describe()["weight_path"].startswith(f"{mode}: torch")
    same_greedy_answer(fast, slow, "Tell the robot what to do next, step by step.", 200)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_gpu_fused_norms_rope_and_silu_match_torch_ops_on_the_gpu(all_kernels, dtype):
    """The fused elementwise kernels against the decoder's torch ops on the GPU itself (same roundings: in half
    precision all but rare last-place differences identical). The RoPE tables to the bit: the kernel calls the
    cosf / sinf that torch's cos and sin kernels call."""
    import torch.nn.functional as F

    from orin_vlm_node.cuda.fused import CudaFusedOps
    from orin_vlm_node.model.rope import TextRopeTables, apply_text_rope, mrope_cos_sin, mrope_streams, text_inv_freq
    from orin_vlm_node.model.text import RMSNorm

    ops = CudaFusedOps(all_kernels)
    inv_freq, streams = text_inv_freq(128, 5_000_000.0, "cuda"), mrope_streams(128, (24, 20, 20), "cuda")
    for positions in (
        torch.arange(8190, 8194, device="cuda").expand(3, -1),
        torch.randint(0, 9000, (3, 64), device="cuda"),
    ):
        tables = ops.rope_tables(positions, inv_freq, streams, dtype)
        want = TextRopeTables.build(*mrope_cos_sin(positions, inv_freq, streams, dtype))
        assert torch.equal(tables.cos, want.cos) and torch.equal(tables.sin_signed, want.sin_signed)
    tol = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 8e-3}[dtype]
    tokens, nq, nkv, hd, hidden = 4, 16, 8, 128, 2048
    norm = RMSNorm(hidden, 1e-6).to("cuda", dtype)
    q_norm, k_norm = (RMSNorm(hd, 1e-6).to("cuda", dtype) for _ in range(2))
    for m in (norm, q_norm, k_norm):
        torch.nn.init.normal_(m.weight, 1.0, 0.3)
    x = 3 * torch.randn(tokens, hidden, device="cuda").to(dtype)
    got = ops.rms_norm(x.unsqueeze(1), norm.weight, norm.weight, 1, norm.eps).view_as(x)
    torch.testing.assert_close(got, norm.weight * norm.normalize(x), rtol=tol, atol=tol)
    delta = torch.randn_like(x)
    total, got = ops.add_rms_norm(x, delta, norm.weight, norm.eps)
    assert torch.equal(total, x + delta)
    torch.testing.assert_close(got, norm.weight * norm.normalize(x + delta), rtol=tol, atol=tol)
    heads = torch.randn(tokens, nq + 2 * nkv, hd, device="cuda").to(dtype)
    angles = torch.rand(tokens, hd // 2, device="cuda") * 50
    rope = TextRopeTables.build(angles.cos().repeat(1, 2).to(dtype), angles.sin().repeat(1, 2).to(dtype))
    weight = torch.cat((q_norm.weight.expand(nq, -1), k_norm.weight.expand(nkv, -1)))
    want = apply_text_rope(weight * q_norm.normalize(heads[:, : nq + nkv]), rope)
    got = ops.rms_norm(heads[:, : nq + nkv], q_norm.weight, k_norm.weight, nq, q_norm.eps, rope)
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    if dtype != torch.float32:  # rounded to half precision: the same but for rare last-place roundings
        assert (got == want).float().mean() >= 0.99
    # The same launch storing the keys and values of a static decode step (its KV sink): the same rows out,
    # the rotated keys and the strided values at their slots, nothing for the padding row (slot -1).
    from orin_vlm_node.kvcache import KVSink

    pools = torch.zeros(2, 8, 16, nkv, hd, device="cuda", dtype=dtype)
    slots = torch.tensor([70, -1, 3, 16], device="cuda")
    v = heads[:, nq + nkv :]
    stored = ops.rms_norm(
        heads[:, : nq + nkv], q_norm.weight, k_norm.weight, nq, q_norm.eps, rope, KVSink(*pools, slots), v
    )
    assert torch.equal(stored, got)
    flat = pools.view(2, -1, nkv, hd)
    used = [(t, s) for t, s in enumerate(slots.tolist()) if s >= 0]
    assert all(torch.equal(flat[0, s], got[t, nq:]) and torch.equal(flat[1, s], v[t]) for t, s in used)
    assert int(flat.abs().sum(dim=(2, 3)).count_nonzero()) == 2 * len(used)
    gate_up = 4 * torch.randn(tokens, 2 * 6144, device="cuda").to(dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    want = F.silu(gate) * up
    got = ops.silu_mul(gate_up)
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    assert (got == want).float().mean() >= 0.99  # one exp, one division, one product: torch's very ops


@pytest.mark.parametrize("layout", [None, "channel"])
def test_gpu_an_fp8_checkpoint_widens_on_the_device_to_the_values_it_has_on_the_cpu(tmp_path, layout):
    """On CUDA the FP8 weights travel as bytes and are widened on the GPU (integer shifts, an fp16 view, the
    scales multiplied in place): the same values as the CPU load, which the CPU suite holds to transformers'."""
    from orin_vlm_node.weights import load_model
    from orin_vlm_node.weights.keys import checkpoint_views
    from support.checkpoints import cached_tiny_checkpoint
    from support.quantized_copies import fp8_copy

    source = cached_tiny_checkpoint(layers=2, tie=False, dtype=torch.bfloat16)
    block = None if layout else (24, 40)  # Qwen's layout with partial blocks; llm-compressor's per channel
    ckpt = fp8_copy(source, tmp_path / "fp8", block=block, compressed_tensors=layout)
    on_cpu = checkpoint_views(load_model(ckpt, torch.bfloat16))
    on_gpu = checkpoint_views(load_model(ckpt, torch.bfloat16, device="cuda"))
    assert all(v.is_cuda for v in on_gpu.values())
    for name, value in on_cpu.items():
        assert torch.equal(on_gpu[name].cpu(), value), name


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_gpu_a_float_checkpoint_is_quantized_on_the_device_to_the_cpu_loads_bytes(mode):
    """On CUDA each checkpoint matrix is moved, cast to the model's dtype (bf16 on disk, fp16 here) and quantized
    on the device a piece at a time: the stored bytes, scales and offsets are the CPU load's, bit for bit (the
    same IEEE operations: min, max, one division, round half to even), the untied LM head's INT8 too."""
    from orin_vlm_node.weights import load_model
    from orin_vlm_node.weights.quant import WeightQuant
    from support.checkpoints import cached_tiny_checkpoint

    ckpt = cached_tiny_checkpoint(layers=2, tie=False, dtype=torch.bfloat16)
    quant = WeightQuant(mode, 32)
    on_cpu = load_model(ckpt, torch.float16, quant=quant).state_dict()
    on_gpu = load_model(ckpt, torch.float16, device="cuda", quant=quant).state_dict()
    assert on_cpu.keys() == on_gpu.keys()
    assert any(key.endswith("qweight") for key in on_gpu)
    for name, value in on_cpu.items():
        assert on_gpu[name].is_cuda and torch.equal(on_gpu[name].cpu(), value), name


INT4_WRITERS = {  # how a 4-bit checkpoint of groups of 32 is written: compressed-tensors', AutoAWQ's, GPTQ's layouts
    "w4a16": lambda src, dst: int_copy(src, dst, bits=4, strategy="group", group_size=32, symmetric=True),
    "w4a16_asym": lambda src, dst: int_copy(src, dst, bits=4, strategy="group", group_size=32, symmetric=False),
    "awq": lambda src, dst: awq_copy(src, dst, group_size=32),
    "gptq_asym": lambda src, dst: gptq_copy(src, dst, group_size=32, sym=False),
}


@pytest.mark.parametrize("layout", list(INT4_WRITERS))
def test_gpu_an_int4_checkpoint_is_kept_on_the_device_as_on_the_cpu_and_the_kernels_run_it(
    tmp_path_factory, tmp_path, kernel_cache, layout
):
    """On CUDA a 4-bit checkpoint is kept on the device (pack-quantized nibbles as they are; AWQ's and GPTQ's
    words paired into them there): the kept projections hold the CPU load's bytes, the rest the CPU load's values,
    and the engine's GEMV kernels answer inside the decode graphs as the torch path does on the same stored
    weights."""
    from orin_vlm_node.engine import Engine, EngineConfig
    from orin_vlm_node.weights import load_model
    from orin_vlm_node.weights.quant import WeightQuant

    ckpt = INT4_WRITERS[layout](_tiny(tmp_path_factory, 64), tmp_path / "w4")
    quant = WeightQuant("int4", 32)
    on_cpu = load_model(ckpt, torch.float32, quant=quant).state_dict()
    on_gpu = load_model(ckpt, torch.float32, device="cuda", quant=quant).state_dict()
    assert on_cpu.keys() == on_gpu.keys()
    for name, value in on_cpu.items():
        assert torch.equal(on_gpu[name].cpu(), value), name
    common = dict(model_path=str(ckpt), device="cuda", dtype="fp32", max_context_tokens=512,
                  kernel_cache_dir=kernel_cache, weight_quant="int4", weight_quant_group_size=32)  # fmt: skip
    fast = Engine(EngineConfig(**common, allow_kernel_fallback=False))
    slow = Engine(EngineConfig(**common, use_cuda_kernels=False, use_cuda_graph=False))
    same_greedy_answer(fast, slow, "Tell the robot what to do next.", 64)
