"""The fused elementwise kernels (``kernels/rms_norm.cu``, ``kernels/silu_mul.cu``) under the CPU CUDA emulator,
through ``CudaFusedOps`` (the GPU path's launch code), against the text decoder's torch ops: plain rows, the q
and k heads of a fused projection normalised (and rotated) in place with their two weights, the residual add
with the norm after it, SwiGLU, and a whole model answering with them."""

from __future__ import annotations

import re

import pytest
import torch
from cuda_harness.harness import RecordingLauncher
from cuda_harness.static_step import run_static_decode

from orin_vlm_node.cuda import launch as L
from orin_vlm_node.cuda.fused import CudaFusedOps
from orin_vlm_node.kvcache import KVSink
from orin_vlm_node.model.rope import TextRopeTables, apply_text_rope, mrope_cos_sin, mrope_streams, text_inv_freq
from orin_vlm_node.model.text import MLP, Product, RMSNorm, add_rms_norm, attach_fused_ops, rms_norm

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# The kernel sums the squares in another order than torch's mean and its rsqrt may round otherwise: the
# scale can differ in its last fp32 bits, which moves a half-precision result by one unit in its last place
# only rarely.
TOL = {torch.float32: (1e-6, 1e-6), torch.float16: (1e-3, 1e-3), torch.bfloat16: (8e-3, 8e-3)}


def _norm(dim: int, dtype: torch.dtype, seed: int) -> RMSNorm:
    norm = RMSNorm(dim, 1e-6)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.3 * torch.randn(dim, generator=torch.Generator().manual_seed(seed)))
    return norm.to(dtype)


def _check(got: torch.Tensor, want: torch.Tensor) -> None:
    rtol, atol = TOL[want.dtype]
    assert got.dtype == want.dtype and got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=rtol, atol=atol)
    if want.dtype != torch.float32:  # rounded to half precision: bit for bit but for rare last-place roundings
        assert (got == want).float().mean() >= 0.99


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("dim", [32, 128, 200, 2048])
def test_rms_norm_kernel_matches_the_torch_norm_on_rows(harness, dtype, dim):
    norm = _norm(dim, dtype, seed=dim)
    x = (3 * torch.randn(5, dim, generator=torch.Generator().manual_seed(1))).to(dtype)
    want = rms_norm(norm, x)  # torch ops: no kernel attached
    norm.fused = CudaFusedOps(harness)
    _check(rms_norm(norm, x), want)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("dim", [36, 64, 200, 2048, 2560, 4096, 5120])
@pytest.mark.parametrize("aligned", [True, False], ids=["aligned", "offset"])
def test_residual_add_and_norm_in_one_kernel_match_the_torch_add_then_norm(harness, dtype, dim, aligned):
    """Rows held in registers as 16-byte vectors (up to 4096 elements in fp16/bf16, 2048 in fp32; 2560: some
    threads hold one vector fewer) and rows that take the loop: longer (5120; 4096 in fp32), not a whole
    number of vectors (36 in half precision), or not 16-byte aligned (rows one element into their buffer)."""
    norm = _norm(dim, dtype, seed=dim + 1)
    gen = torch.Generator().manual_seed(2)
    skip = 0 if aligned else 1
    x = torch.randn(4 * dim + skip, generator=gen).to(dtype)[skip:].view(4, dim)
    proj = torch.nn.Linear(24, dim, bias=False).to(dtype)  # what the delta is: a projection's output
    delta = Product(torch.randn(4, 24, generator=gen).to(dtype), proj)
    want_sum, want = add_rms_norm(norm, x, delta)  # torch ops: no kernel attached
    norm.fused = CudaFusedOps(harness)
    got_sum, got = add_rms_norm(norm, x, delta)
    assert torch.equal(got_sum, want_sum)  # one rounded add, as torch's
    _check(got, want)
    assert add_rms_norm(norm, x, None)[0] is x  # no pending add: the plain norm


def _rope(tokens: int, dim: int, dtype: torch.dtype) -> TextRopeTables:
    angles = torch.rand(tokens, dim // 2, generator=torch.Generator().manual_seed(4)) * 50
    cos, sin = angles.cos().repeat(1, 2), angles.sin().repeat(1, 2)  # (L, hd) like mrope_cos_sin's
    return TextRopeTables.build(cos.to(dtype), sin.to(dtype))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rotate", [False, True], ids=["norm", "norm+rope"])
@pytest.mark.parametrize("hd", [64, 200, 256])
def test_q_and_k_heads_are_normalised_and_rotated_in_place_of_the_projection(harness, dtype, rotate, hd):
    """Head sizes below and above the 128 threads of a block (a thread holds two elements of a rotated row)."""
    tokens, nq, nkv = 3, 4, 2
    q_norm, k_norm = _norm(hd, dtype, seed=1), _norm(hd, dtype, seed=2)
    heads = torch.randn(tokens, nq + 2 * nkv, hd, generator=torch.Generator().manual_seed(3)).to(dtype)
    qk = heads[:, : nq + nkv]  # the q and k heads of each token, v heads left out: not contiguous
    weight = torch.cat((q_norm.weight.expand(nq, -1), k_norm.weight.expand(nkv, -1)))
    want = weight * q_norm.normalize(qk)
    rope = _rope(tokens, hd, dtype) if rotate else None
    if rope is not None:
        want = apply_text_rope(want, rope)
    got = CudaFusedOps(harness).rms_norm(qk, q_norm.weight, k_norm.weight, nq, q_norm.eps, rope)
    _check(got, want)


def test_launch_arguments_follow_the_one_rule_the_gpu_runtime_applies(harness):
    """A view with a token stride (the q/k heads of a fused projection) is passed in place; a tensor whose
    last dimension is not dense or that lies on another device, an int beyond int32 (it would wrap) and a
    wrong argument count are refused with the reason, by the harness as by the GPU runtime (both call
    ``launch.check_launch_args`` before they launch)."""
    cpu, w = torch.device("cpu"), torch.ones(8)
    cfg = L.rms_norm_launch(8, torch.float32)

    def args(x=None, out=None, heads=1, eps=1e-6):
        return [
            torch.empty(8, 8) if out is None else out,
            torch.ones(8, 8) if x is None else x,
            w,
            w,
            heads,
            1,
            8,
            8,
            eps,
        ]

    L.check_launch_args(cfg, args(torch.ones(8, 16)[:, :8]), cpu)
    L.check_launch_args(
        L.gemv_launch("float", 1, 8, 8, torch.float32),
        [torch.empty(1, 8), torch.ones(1, 8), w.view(1, 8), None, None, 1, 8, 8, 0],
        cpu,
    )
    refused = {
        "argument 1: expected non-negative strides and a dense last dimension": args(torch.ones(8, 8).t()),
        "argument 0: expected a tensor on cpu": args(out=torch.empty(8, 8, device="meta")),
        "argument 4: expected an int32, got 2147483648": args(heads=2**31),
        "argument 8: expected a float, got 'x'": args(eps="x"),
        "takes 9 arguments, got 8": args()[:8],
    }
    for message, bad in refused.items():
        with pytest.raises(L.LaunchArgumentError, match=re.escape(message)):
            L.check_launch_args(cfg, bad, cpu)
    with pytest.raises(L.LaunchArgumentError, match="argument 1: expected non-negative strides"):
        harness.launch(cfg, args(torch.ones(8, 8).t()))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows,inter", [(1, 96), (3, 1000), (5, 7)])
def test_silu_mul_kernel_matches_torch(harness, dtype, rows, inter):
    gate_up = (4 * torch.randn(rows, 2 * inter, generator=torch.Generator().manual_seed(inter))).to(dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    want = torch.nn.functional.silu(gate) * up
    _check(CudaFusedOps(harness).silu_mul(gate_up), want)


def test_fused_ops_refuse_rows_they_cannot_take(harness):
    ops = CudaFusedOps(harness)
    w = torch.ones(8)
    with pytest.raises(ValueError, match=r"\(L, H, D\)"):
        ops.rms_norm(torch.ones(2, 8), w, w, 1, 1e-6)
    with pytest.raises(ValueError, match="weight .* does not fit"):
        ops.rms_norm(torch.ones(2, 1, 8), torch.ones(8, dtype=torch.float16), w, 1, 1e-6)
    with pytest.raises(ValueError, match="rope table .* does not fit"):
        ops.rms_norm(torch.ones(2, 1, 8), w, w, 1, 1e-6, _rope(3, 8, torch.float32))
    with pytest.raises(ValueError, match="at most 256"):
        ops.rms_norm(torch.ones(1, 1, 512), torch.ones(512), torch.ones(512), 1, 1e-6, _rope(1, 512, torch.float32))
    with pytest.raises(ValueError, match=r"\(L, 2I\)"):
        ops.silu_mul(torch.ones(2, 7))
    with pytest.raises(ValueError, match="two .* rows alike"):
        ops.add_rms_norm(torch.ones(2, 8), torch.ones(3, 8), w, 1e-6)
    with pytest.raises(ValueError, match="no norm kernel"):
        L.rms_norm_launch(1, torch.float32, "layer_norm")
    with pytest.raises(ValueError, match="rows >= 1"):
        L.rms_norm_launch(0, torch.float32)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_a_model_with_the_fused_kernels_attached_answers_as_with_torch_ops(harness, tmp_path, dtype):
    from orin_vlm_node.engine import Engine, EngineConfig, Request, SamplingParams, Turn
    from support.checkpoints import make_tiny_checkpoint

    ckpt = make_tiny_checkpoint(tmp_path / "ckpt", layers=2, seed=5)
    engine = Engine(EngineConfig(model_path=str(ckpt), device="cpu", dtype=dtype, max_sessions=0))
    sampling = SamplingParams(temperature=0.0, max_new_tokens=12, ignore_eos=True)

    def answer() -> tuple[int, ...]:
        return tuple(list(engine.generate(Request(Turn("What does the robot see?"), sampling)))[-1].token_ids)

    want = answer()
    launcher = RecordingLauncher(harness)
    layers = engine.parts.model_config.text.num_hidden_layers
    assert (
        attach_fused_ops(engine.parts.model, CudaFusedOps(launcher)) == 5 * layers + 1
    )  # 4 norms + MLP a layer, final
    assert answer() == want
    # Per forward: the first layer's input norm alone; every other norm after a residual add (the next
    # layer's input norm takes the MLP's add, the post-attention norm the attention's, the final norm the
    # last MLP's); q and k norms with RoPE and the MLP activation in every layer.
    forwards = 12  # the prefill and 11 decode steps
    tag = {"fp32": "f32", "bf16": "bf16"}[dtype]
    assert launcher.kernels.count(f"rms_norm_{tag}") == forwards
    assert launcher.kernels.count(f"add_rms_norm_{tag}") == forwards * 2 * layers
    assert launcher.kernels.count(f"rms_norm_rope_{tag}") == forwards * layers
    assert launcher.kernels.count(f"silu_mul_{tag}") == forwards * layers
    assert not any(isinstance(m, MLP) and m.fused is None for m in engine.parts.model.modules())
    attach_fused_ops(engine.parts.model, None)
    assert answer() == want


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("hd", [64, 256])
def test_q_k_norm_rope_launch_stores_the_keys_and_values_in_a_kv_sink(harness, dtype, hd):
    """A static decode step's K/V stored by the q/k norm + RoPE launch itself: each rotated k head and each
    v head (read in place of the projection, strided) at its token's slot of the paged pools, nothing for a
    padding row (slot -1), no other slot touched; the normalised rows are those of the launch without a sink."""
    tokens, nq, nkv, page, blocks = 3, 4, 2, 4, 3
    q_norm, k_norm = _norm(hd, dtype, seed=1), _norm(hd, dtype, seed=2)
    heads = torch.randn(tokens, nq + 2 * nkv, hd, generator=torch.Generator().manual_seed(3)).to(dtype)
    qk, v = heads[:, : nq + nkv], heads[:, nq + nkv :]
    rope = _rope(tokens, hd, dtype)
    ops = CudaFusedOps(harness)
    want = ops.rms_norm(qk, q_norm.weight, k_norm.weight, nq, q_norm.eps, rope)
    pools = torch.full((2, blocks, page, nkv, hd), 7.0, dtype=dtype)  # k and v; 7: never written
    slots = torch.tensor([9, -1, 2])
    sink = KVSink(pools[0], pools[1], slots)
    got = ops.rms_norm(qk, q_norm.weight, k_norm.weight, nq, q_norm.eps, rope, sink, v)
    assert torch.equal(got, want)
    expected = torch.full_like(pools, 7.0).view(2, blocks * page, nkv, hd)
    for token, slot in enumerate(slots.tolist()):
        if slot >= 0:
            expected[0, slot], expected[1, slot] = want[token, nq:], v[token]
    assert torch.equal(pools.view(2, blocks * page, nkv, hd), expected)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    ("hd", "section"), [(128, (24, 20, 20)), (64, (12, 10, 10)), (32, (6, 5, 5)), (256, (48, 40, 40))]
)
def test_the_rope_tables_launch_gives_torchs_tables(harness, dtype, hd, section):
    """One launch builds the step's cos and signed sin tables: those of mrope_cos_sin + TextRopeTables.build
    for text positions (the three streams alike, up to 40000), an image's (streams apart) and positions read
    strided (a view of a wider tensor), each value within one unit in the last place. On a GPU both sides call
    the same cosf / sinf (the GPU test asserts the bits); here the harness's libm and torch's vectorised CPU
    cos differ in the last place of about 6% of fp32 values, which rounding to half precision hides."""
    inv_freq, streams = text_inv_freq(hd, 5_000_000.0), mrope_streams(hd, section)
    gen = torch.Generator().manual_seed(hd)
    text = torch.randint(0, 40000, (37,), generator=gen).expand(3, -1)
    image = torch.randint(0, 500, (3, 20), generator=gen)
    strided = torch.randint(0, 9000, (3, 40), generator=gen)[:, ::2]
    ops = CudaFusedOps(harness)
    for positions in (text, image, strided):
        got = ops.rope_tables(positions, inv_freq, streams, dtype)
        want = TextRopeTables.build(*mrope_cos_sin(positions, inv_freq, streams, dtype))
        for g, w in ((got.cos, want.cos), (got.sin_signed, want.sin_signed)):
            assert g.shape == w.shape and g.dtype == w.dtype
            torch.testing.assert_close(g, w, rtol=torch.finfo(dtype).eps, atol=0)  # one unit in the last place
            assert (g == w).float().mean() >= (0.9 if dtype == torch.float32 else 0.99)
    with pytest.raises(ValueError, match="positions"):
        ops.rope_tables(text[:2], inv_freq, streams, dtype)
    with pytest.raises(ValueError, match="streams alike"):
        ops.rope_tables(text, inv_freq, streams[1:], dtype)


def test_a_kv_sink_that_does_not_fit_the_heads_is_refused(harness):
    ops, w = CudaFusedOps(harness), torch.ones(8)
    qk, v, rope = torch.ones(2, 3, 8), torch.ones(2, 1, 8), _rope(2, 8, torch.float32)
    pools = torch.zeros(2, 4, 4, 1, 8)
    slots = torch.tensor([0, 1])
    ops.rms_norm(qk, w, w, 2, 1e-6, rope, KVSink(pools[0], pools[1], slots), v)
    refused = {
        "do not take 1 heads of 8": (KVSink(pools[0, :, :, :, :4], pools[1, :, :, :, :4], slots), v),
        "needs the values": (KVSink(pools[0], pools[1], slots), None),
        "slots must be": (KVSink(pools[0], pools[1], slots.int()), v),
    }
    for message, (sink, values) in refused.items():
        with pytest.raises(ValueError, match=message):
            ops.rms_norm(qk, w, w, 2, 1e-6, rope, sink, values)
    with pytest.raises(ValueError, match="only with RoPE"):
        ops.rms_norm(qk, w, w, 2, 1e-6, None, KVSink(pools[0], pools[1], slots), v)


@pytest.mark.parametrize(
    ("dtype", "kernel_attention"), [(torch.float32, True), (torch.bfloat16, True), (torch.bfloat16, False)]
)
def test_static_decode_stores_kv_in_the_norm_launch_as_the_write_launch_would(
    harness, tmp_path, monkeypatch, dtype, kernel_attention
):
    """The static decode step (what a CUDA graph captures) of a model with the fused kernels, three sequences
    of different lengths in buffers of four (one padding row), crossing pages: with the step's KV sink the
    q/k norm + RoPE launch stores the K/V, and logits, greedy tokens and the pool are those of the same step
    with the separate write (the kernel's launch, or torch's indexed copy where attention stays on torch: a
    head size the attention kernels lack), bit for bit, with no write launch in the step."""
    from orin_vlm_node.cuda import CudaPagedAttention
    from orin_vlm_node.kvcache import TorchPagedAttention
    from orin_vlm_node.kvcache.paged_step import PagedStaticDecode
    from orin_vlm_node.weights import load_model
    from support.checkpoints import make_tiny_checkpoint

    model = load_model(make_tiny_checkpoint(tmp_path / "ckpt", layers=2, seed=5), dtype)
    cfg = model.config.text
    launcher = RecordingLauncher(harness)
    attach_fused_ops(model, CudaFusedOps(launcher))

    def run() -> tuple[list[torch.Tensor], torch.Tensor, list[str]]:
        attention = (
            CudaPagedAttention(launcher, sm_count=16, min_tokens_per_split=16) if kernel_attention
            else TorchPagedAttention()
        )  # fmt: skip
        logits, pool, kernels = run_static_decode(model, dtype, attention, launcher.kernels, steps=6)
        return logits, pool, [k for step in kernels for k in step]

    with_sink = run()
    with monkeypatch.context() as patch:
        patch.setattr(PagedStaticDecode, "kv_sink", lambda self, layer, dtype: None)
        with_write = run()
    for a, b in zip(with_sink[0], with_write[0], strict=True):
        assert torch.equal(a, b)
    assert torch.equal(with_sink[1], with_write[1])
    tag = L.DTYPE_TAGS[str(dtype).removeprefix("torch.")]
    layers = cfg.num_hidden_layers
    assert not any(k.startswith("paged_kv_write") for k in with_sink[2])
    assert with_write[2].count(f"paged_kv_write_{tag}") == (6 * layers if kernel_attention else 0)
    assert with_sink[2].count(f"rms_norm_rope_{tag}") == with_write[2].count(f"rms_norm_rope_{tag}") == 6 * layers
