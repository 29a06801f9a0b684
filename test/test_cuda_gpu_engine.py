"""On a real GPU, the engine: its decode graphs (dependent and plain launches, every context bucket, batches,
overlapped decode) answer as the torch path does; the GEMV kernels chosen by measurement; little memory held
beyond the weights and the KV pool; each dtype's kernels loaded once; quantized weights and checkpoints kept on
the device as on the CPU.

Skipped without CUDA or PyCUDA (see docs/cuda-kernels.md for running these on a Jetson)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from support.quantized_copies import awq_copy, gptq_copy, int_copy

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (torch.cuda.is_available() is False)"),
    pytest.mark.skipif(importlib.util.find_spec("pycuda") is None, reason="needs PyCUDA (pip install pycuda)"),
]


def test_gpu_decode_graphs_keep_the_faster_of_dependent_and_plain_launches(tmp_path_factory, gpu_cache):
    """The engine's decode graphs: each captured both ways at its first use and the faster replay kept, both
    times in ``describe``; a benchmark's forced on and off (``bench.gpu_engines.launching``) capture one way
    (off wherever dependent launch does not work). The tokens are the same all three ways (the same kernels, launched
    differently), and the runtime's switch is back as it was after the captures."""
    import re

    from bench.gpu_engines import launching
    from orin_vlm_node.engine import Engine, EngineConfig, Request, SamplingParams, Turn

    path = str(_tiny(tmp_path_factory, 64))
    common = dict(model_path=path, device="cuda", dtype="fp32", max_context_tokens=512, kernel_cache_dir=gpu_cache,
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
    tmp_path_factory, gpu_cache, head_dim
):
    """fp32, 300 greedy tokens from a 1024-token limit: the static step moves from the 256 to the 512
    bucket (a second graph) and crosses many pages; tokens equal the eager torch path's."""
    from orin_vlm_node.engine import Engine, EngineConfig

    path = str(_tiny(tmp_path_factory, head_dim))
    common = dict(model_path=path, device="cuda", dtype="fp32", max_context_tokens=1024, kernel_cache_dir=gpu_cache)
    fast = Engine(EngineConfig(**common, allow_kernel_fallback=False))
    slow = Engine(EngineConfig(**common, use_cuda_kernels=False, use_cuda_graph=False))
    info = fast.describe()
    assert info["kernels"].startswith("kernels: on") and info["decode_path"] == "kernels+graphs (static step)"
    assert slow.describe()["decode_path"] == "torch reference (static step)"
    same_greedy_answer(fast, slow, "Tell the robot what to do next, step by step.", 300)
    decode = fast.describe()["decode"]
    assert decode["graphs"] == "on" and decode["graphs_captured"] >= 2, decode


def test_gpu_engine_batches_in_graphs_and_every_request_gets_its_tokens_alone(tmp_path_factory, gpu_cache):
    """fp32, kernels + graphs: four requests of different lengths decode together (batch buckets 4, then 2
    and 1 as they finish, 3 replaying the bucket of 4 with a padding row), each with its tokens alone."""
    from orin_vlm_node.engine import Engine, EngineConfig, Finished, Request, SamplingParams, Turn

    path = str(_tiny(tmp_path_factory, 64))
    engine = Engine(EngineConfig(model_path=path, device="cuda", dtype="fp32", max_context_tokens=1024,
                                 kernel_cache_dir=gpu_cache, allow_kernel_fallback=False, max_batch=4))  # fmt: skip
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


def test_gpu_overlapped_decode_answers_as_the_step_by_step_decode(tmp_path_factory, gpu_cache):
    """fp32, kernels + graphs: the static step overlaps on CUDA (token N read after step N+1 launched,
    through pinned memory and an event); switched off, the same engine reads every token before the next
    step. Every event of greedy, seeded and penalised answers, one ending at a stop string, is the same."""
    from orin_vlm_node.engine import Engine, EngineConfig, Request, SamplingParams, Turn

    path = str(_tiny(tmp_path_factory, 64))
    engine = Engine(EngineConfig(model_path=path, device="cuda", dtype="fp32", max_context_tokens=1024,
                                 kernel_cache_dir=gpu_cache, allow_kernel_fallback=False))  # fmt: skip
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


def test_gpu_engine_float_gemv_says_what_it_measured_and_answers_as_without_kernels(tmp_path_factory, gpu_cache):
    """fp32: the float projections the GEMV kernel won (timed at startup) inside the captured decode graphs
    give the tokens of torch's products, 200 greedy tokens; turning the kernels off at runtime puts the
    model back as loaded."""
    from orin_vlm_node.engine import Engine, EngineConfig
    from orin_vlm_node.weights.gemv_linear import GemvLinear

    path = str(_tiny(tmp_path_factory, 64))
    common = dict(model_path=path, device="cuda", dtype="fp32", max_context_tokens=512, kernel_cache_dir=gpu_cache)
    fast = Engine(EngineConfig(**common, allow_kernel_fallback=False))
    slow = Engine(EngineConfig(**common, use_cuda_kernels=False, use_cuda_graph=False))
    path_used = fast.describe()["weight_path"]
    assert path_used.startswith("float weights: GEMV kernels for decode rows: ") and "kernel vs F.linear" in path_used
    assert slow.describe()["weight_path"].startswith("float weights: F.linear")
    same_greedy_answer(fast, slow, "Tell the robot what to do next, step by step.", 200)
    fast.reconfigure(use_cuda_kernels=False)
    assert not any(isinstance(m, GemvLinear) for m in fast.parts.model.modules())


def test_gpu_engine_holds_little_beyond_weights_and_pool_and_rebuilds_do_not_grow_it(tmp_path_factory, gpu_cache):
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
                                 kernel_cache_dir=gpu_cache, allow_kernel_fallback=False))  # fmt: skip
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
    tmp_path_factory, gpu_cache
):
    """An fp16 engine builds and loads the fp16 kernels only; reconfigurations that rebuild the backend keep
    that runtime (its modules are not loaded again); a dtype change loads the new dtype's and unloads the old
    (a launch on it is refused), so the GPU's free memory stays where it was over many changes."""
    from orin_vlm_node.cuda import launch as L
    from orin_vlm_node.cuda.runtime import CudaRuntimeError
    from orin_vlm_node.engine import Engine, EngineConfig, Request, SamplingParams, Turn

    path = str(_tiny(tmp_path_factory, 64))
    engine = Engine(EngineConfig(model_path=path, device="cuda", dtype="fp16", max_context_tokens=512,
                                 kernel_cache_dir=gpu_cache, allow_kernel_fallback=False))  # fmt: skip
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
def test_gpu_engine_quantized_kernels_and_graphs_match_the_torch_path(tmp_path_factory, gpu_cache, mode):
    """fp32 activations: the GEMV kernels inside the captured decode graphs give the tokens of the torch
    path (weights widened for torch's GEMM), 200 greedy tokens."""
    from orin_vlm_node.engine import Engine, EngineConfig

    path = str(_tiny(tmp_path_factory, 64))
    common = dict(model_path=path, device="cuda", dtype="fp32", max_context_tokens=512, kernel_cache_dir=gpu_cache,
                  weight_quant=mode, weight_quant_group_size=32)  # fmt: skip
    fast = Engine(EngineConfig(**common, allow_kernel_fallback=False))
    slow = Engine(EngineConfig(**common, use_cuda_kernels=False, use_cuda_graph=False))
    assert fast.describe()["weight_path"].startswith(f"{mode}: GEMV kernels")
    assert slow.describe()["weight_path"].startswith(f"{mode}: torch")
    same_greedy_answer(fast, slow, "Tell the robot what to do next, step by step.", 200)


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
    tmp_path_factory, tmp_path, gpu_cache, layout
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
                  kernel_cache_dir=gpu_cache, weight_quant="int4", weight_quant_group_size=32)  # fmt: skip
    fast = Engine(EngineConfig(**common, allow_kernel_fallback=False))
    slow = Engine(EngineConfig(**common, use_cuda_kernels=False, use_cuda_graph=False))
    same_greedy_answer(fast, slow, "Tell the robot what to do next.", 64)
