"""On a real GPU: kernels built by build.py, loaded by runtime.py, against the torch reference; CUDA-graph decode
(the engine on the GPU is ``test_cuda_gpu_engine.py``'s).

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

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (torch.cuda.is_available() is False)"),
    pytest.mark.skipif(importlib.util.find_spec("pycuda") is None, reason="needs PyCUDA (pip install pycuda)"),
]


@pytest.fixture(scope="module")
def backend(gpu_cache):
    shape = AttentionShape(torch.float16, 128, 16, 8)
    choice = select_backend("cuda", True, shape, kernel_cache_dir=gpu_cache, allow_kernel_fallback=False)
    assert choice.kernels and isinstance(choice.attention_impl, CudaPagedAttention)
    return choice


@pytest.fixture(scope="module")
def all_kernels(gpu_cache):
    """Every dtype's kernels in one runtime, for the tests that compare each dtype with torch (a node loads its
    model's dtype only, as ``backend`` does); each dtype built as the node builds it."""
    from orin_vlm_node.cuda.launch import DTYPE_TAGS
    from orin_vlm_node.cuda.runtime import load_runtime

    device = torch.device("cuda", torch.cuda.current_device())
    runtime = load_runtime(device, cache_dir=gpu_cache, dtypes=tuple(DTYPE_TAGS.values())).runtime
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


def _assert_rope_tables_are_torchs(ops, dtype: torch.dtype) -> None:
    """The kernel's M-RoPE tables equal torch's to the bit, at long-context and scattered positions."""
    from orin_vlm_node.model.rope import TextRopeTables, mrope_cos_sin, mrope_streams, text_inv_freq

    inv_freq, streams = text_inv_freq(128, 5_000_000.0, "cuda"), mrope_streams(128, (24, 20, 20), "cuda")
    for positions in (
        torch.arange(8190, 8194, device="cuda").expand(3, -1),
        torch.randint(0, 9000, (3, 64), device="cuda"),
    ):
        tables = ops.rope_tables(positions, inv_freq, streams, dtype)
        want = TextRopeTables.build(*mrope_cos_sin(positions, inv_freq, streams, dtype))
        assert torch.equal(tables.cos, want.cos) and torch.equal(tables.sin_signed, want.sin_signed)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_gpu_fused_norms_rope_and_silu_match_torch_ops_on_the_gpu(all_kernels, dtype):
    """The fused elementwise kernels against the decoder's torch ops on the GPU itself (same roundings: in half
    precision all but rare last-place differences identical). The RoPE tables to the bit: the kernel calls the
    cosf / sinf that torch's cos and sin kernels call."""
    import torch.nn.functional as F

    from orin_vlm_node.cuda.fused import CudaFusedOps
    from orin_vlm_node.model.rope import TextRopeTables, apply_text_rope
    from orin_vlm_node.model.text import RMSNorm

    ops = CudaFusedOps(all_kernels)
    _assert_rope_tables_are_torchs(ops, dtype)
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
