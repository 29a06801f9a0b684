"""The GEMV kernels (``kernels/gemv.cuh``) under the CPU CUDA emulator, through ``CudaGemv`` (the GPU path's
launch code), against torch: for a quantized weight what the reference ``QuantizedLinear`` computes (the float
product with the dequantized weight), for a float weight ``F.linear``, both in fp32. The kernels accumulate in
fp32, so the expected difference is the rounding of the output to its dtype plus accumulation order. Then the
routing: which projections of a model take the kernel (quantized ones always, float ones for the rows the
timing gave them), a model that computes what it computed before, and detaching that restores the model.
The SwiGLU epilogue (the MLP's gate/up product and its activation in one kernel) against torch's product
followed by ``F.silu(gate) * up``, each rounded to the activation dtype as the separate ops round. An INT4
weight widened for a prefill's many rows (``widen_int4``) against the reference's widened weight."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from cuda_harness.harness import HarnessError, RecordingLauncher
from cuda_harness.static_step import PROMPTS, run_static_decode

from orin_vlm_node.cuda import launch as L
from orin_vlm_node.cuda.fused import CudaFusedOps
from orin_vlm_node.cuda.gemv import CudaGemv
from orin_vlm_node.kvcache import KVSink
from orin_vlm_node.model import load_model
from orin_vlm_node.model.gemv_linear import GemvLinear, attach_gemv
from orin_vlm_node.model.quant import QuantizedLinear, WeightQuant
from orin_vlm_node.model.rope import TextRopeTables
from orin_vlm_node.model.text import HeadNorms, product_epilogue
from support.checkpoints import cached_tiny_checkpoint

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
RTOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}

# (N, K, group): the vector path (K and the group multiples of 32), N not a multiple of the 4, 8 or 16 columns
# a block computes, K not a multiple of the group, odd K, groups smaller than a vector (the scalar path), and
# rows long enough that a warp takes more than one step along them, shared among the block's warps (3072: two
# warps a column, each with its slice of K; 4608: four, the last slice's vectors fewer).
SHAPES = [
    (64, 128, 32),
    (37, 256, 128),
    (21, 96, 64),
    (19, 75, 32),
    (8, 33, 2),
    (5, 64, 16),
    (6, 4608, 128),
    (10, 3072, 64),
]


def _quantized(n: int, k: int, mode: str, group: int, seed: int) -> QuantizedLinear:
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.05
    return QuantizedLinear.from_weight(w, WeightQuant(mode, group))


@pytest.mark.parametrize("mode", ["int8", "int4"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n,k,group", SHAPES)
def test_gemv_kernels_match_the_torch_reference(harness, mode, dtype, n, k, group):
    module = _quantized(n, k, mode, group, seed=n * k)
    gemv = CudaGemv(harness)
    weight = module.dequantize(torch.float32)
    for rows in (1, 3, 8, 13):  # 13: a batch beyond one launch's 8 rows, in two launches
        x = torch.randn(rows, k).to(dtype)
        assert gemv.fits(module, x)
        got = gemv(module, x)
        assert got.dtype == dtype and got.shape == (rows, n)
        expected = F.linear(x.float(), weight)
        scale = expected.abs().amax().item()
        torch.testing.assert_close(got.float(), expected, rtol=RTOL[dtype], atol=RTOL[dtype] * scale)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n,k,group", SHAPES)
def test_an_int4_weight_is_widened_in_one_launch_for_many_rows_to_the_bit(harness, dtype, n, k, group):
    """Rows beyond what the GEMV launches take (a prefill) multiply the weight widened by ``widen_int4``: the
    reference's widened weight to the bit (q * s, then + m, each rounded in fp32, then the dtype), so the product
    is the reference's; one launch, then torch's product."""
    module = _quantized(n, k, "int4", group, seed=n + k)
    launcher = RecordingLauncher(harness)
    gemv = CudaGemv(launcher)
    assert torch.equal(gemv.widen(module, dtype), module.dequantize(dtype))
    x = torch.randn(CudaGemv.max_quantized_rows + 3, k).to(dtype)
    want = module(x)  # no kernels attached: the torch reference
    module.kernels = gemv
    launcher.kernels.clear()
    assert not module.kernel_takes(x) and torch.equal(module(x), want)
    assert launcher.kernels == [f"widen_int4_{L.DTYPE_TAGS[str(dtype).removeprefix('torch.')]}"]
    with pytest.raises(ValueError, match="widen takes an int4 weight"):
        gemv.widen(_quantized(n, k, "int8", group, seed=1), dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("swiglu", [False, True])
def test_int4_products_hold_over_the_activations_whole_range(harness, dtype, swiglu):
    """The int4 vector path multiplies x, scaled by 2^64 or 2^60, with weights widened to subnormal floats:
    exact for |x| in [2^-41, 2^64). Activations spanning that range (fp32 and bf16 from 1e-12 to 1e18, fp16
    from its subnormals up to where the outputs stay finite), exact zeros among them, against the reference
    in float64."""
    n, k = 24, 256
    module = _quantized(2 * n if swiglu else n, k, "int4", 32, seed=7)
    module.kernels = CudaGemv(harness)
    gen = torch.Generator().manual_seed(11)
    # log10 |x|; fp16 outputs stay finite (silu(gate) * up squares the magnitudes)
    low, high = (-7.0, 1.5 if swiglu else 3.5) if dtype == torch.float16 else (-12.0, 18.0)
    for rows in (1, 3):
        magnitude = 10 ** (low + (high - low) * torch.rand(rows, k, generator=gen, dtype=torch.float64))
        x = (torch.randn(rows, k, generator=gen, dtype=torch.float64).sign() * magnitude).to(dtype)
        x[:, ::17] = 0
        assert module.kernel_takes(x)
        got = module.kernels(module, x, swiglu=swiglu).double()
        product = F.linear(x.double(), module.dequantize(torch.float64))
        if swiglu:
            gate, up = product.to(dtype).double().chunk(2, dim=-1)
            product = F.silu(gate).to(dtype).double() * up
        expected = product.to(dtype).double()  # what rounding the exact result to the output dtype gives
        assert torch.isfinite(got).all()
        scale = expected.abs().amax(dim=-1, keepdim=True)  # each row's own magnitude
        assert ((got - expected).abs() <= RTOL[dtype] * scale).all()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n,k", [(64, 128), (37, 256), (19, 75), (6, 4608), (5, 36)])
def test_the_float_gemv_kernel_matches_f_linear(harness, dtype, n, k):
    """Float weights: K a multiple of 32 (the vector path, 4608: several batches of vectors a lane, the last
    one partly), and not (75, 36: the scalar path)."""
    gen = torch.Generator().manual_seed(n + k)
    linear = torch.nn.Linear(k, n, bias=False).to(dtype)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(n, k, generator=gen) * 0.05)
    module = GemvLinear(linear, CudaGemv(harness), rows=8)
    for rows in (1, 3, 8):
        x = torch.randn(rows, k, generator=gen).to(dtype)
        assert module.kernels.fits(module, x)
        got = module.kernels(module, x)
        assert got.dtype == dtype and got.shape == (rows, n)
        expected = F.linear(x.float(), linear.weight.float())
        scale = expected.abs().amax().item()
        torch.testing.assert_close(got.float(), expected, rtol=RTOL[dtype], atol=RTOL[dtype] * scale)
    assert not module.kernels.fits(module, torch.zeros(9, k, dtype=dtype))  # float weights: one launch's rows


@pytest.mark.parametrize("mode", ["float", "int8", "int4"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n,k,group", [(64, 128, 32), (37, 256, 128), (19, 75, 32), (6, 4608, 128)])
def test_the_swiglu_epilogue_matches_the_product_then_the_activation(harness, mode, dtype, n, k, group):
    """A fused gate/up weight of 2n rows -> n columns of silu(gate) * up: vector and scalar paths, rows that
    make a lane load several batches of vectors, odd n."""
    if mode == "float":
        gen = torch.Generator().manual_seed(n * k)
        linear = torch.nn.Linear(k, 2 * n, bias=False).to(dtype)
        with torch.no_grad():
            linear.weight.copy_(torch.randn(2 * n, k, generator=gen) * 0.05)
        module, weight = GemvLinear(linear, CudaGemv(harness), rows=8), linear.weight.float()
    else:
        module = _quantized(2 * n, k, mode, group, seed=n * k)
        module.kernels = CudaGemv(harness)
        weight = module.dequantize(torch.float32)
    for rows in (1, 3, 8) if mode == "float" else (1, 3, 8, 13):  # quantized: 13 rows in two launches
        x = (torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)) * 2).to(dtype)
        assert module.kernel_takes(x)
        got = module.kernels(module, x, swiglu=True)
        assert got.dtype == dtype and got.shape == (rows, n)
        gate, up = F.linear(x.float(), weight).to(dtype).float().chunk(2, dim=-1)
        expected = F.silu(gate).to(dtype).float() * up
        scale = expected.abs().amax().item()
        torch.testing.assert_close(got.float(), expected, rtol=RTOL[dtype], atol=RTOL[dtype] * scale)
    with pytest.raises(ValueError, match="gate and up rows alike"):
        CudaGemv(harness)(_quantized(7, 32, "int8", 32, seed=0), torch.randn(1, 32), swiglu=True)


def _module(mode: str, n: int, k: int, group: int, dtype: torch.dtype, kernels: CudaGemv):
    """A projection of n x k of ``mode`` whose products the kernels compute."""
    if mode == "float":
        linear = torch.nn.Linear(k, n, bias=False).to(dtype)
        with torch.no_grad():
            linear.weight.copy_(torch.randn(n, k, generator=torch.Generator().manual_seed(n + k)) * 0.05)
        return GemvLinear(linear, kernels, rows=8)
    module = _quantized(n, k, mode, group, seed=n + k)
    module.kernels = kernels
    return module


@pytest.mark.parametrize("mode", ["float", "int8", "int4"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n,k,group", [(37, 96, 32), (64, 128, 32), (2056, 64, 32), (37, 3072, 64)])
def test_the_norm_epilogue_gives_what_the_product_then_the_add_rms_norm_kernel_give(harness, mode, dtype, n, k, group):
    """The product's launch adds its rows to the residual and normalises them (the block that finishes last,
    in the harness's scrambled block order): the sum and the norm are the separate add_rms_norm kernel's to
    the bit, rows held in registers (n 64; 2056 in half precision) or looped over (37; 2056 in fp32), one
    launch a batch of up to 8 rows (13 quantized rows: two), and the finish counter is zero again after."""
    launcher = RecordingLauncher(harness)
    gemv = CudaGemv(launcher)
    module = _module(mode, n, k, group, dtype, gemv)
    gen = torch.Generator().manual_seed(n)
    weight = (1 + 0.3 * torch.randn(n, generator=gen)).to(dtype)
    batches = (1, 3, 8) if mode == "float" else (1, 3, 8, 13)
    for rows in batches if n < 2048 else (3,):  # a long row (many blocks): one batch
        x = torch.randn(rows, k, generator=gen).to(dtype)
        residual = (3 * torch.randn(rows, n, generator=gen)).to(dtype)
        want_sum, want = CudaFusedOps(harness).add_rms_norm(residual, gemv(module, x), weight, 1e-6)
        launcher.kernels.clear()
        got_sum, got = gemv.add_rms_norm(module, x, residual, weight, 1e-6)
        assert torch.equal(got_sum, want_sum) and torch.equal(got, want)
        buckets = {1: [1], 3: [4], 8: [8], 13: [8, 8]}[rows]  # 13 rows: 8, then 5 in the 8-row kernel
        assert launcher.kernels == [f"gemv_{mode}_{L.DTYPE_TAGS[str(dtype)[6:]]}_r{r}" for r in buckets]
        assert not gemv._counters["cpu"].any()


def test_the_norm_epilogue_refuses_rows_that_do_not_belong_to_the_product(harness):
    """A residual or norm weight of another shape or dtype is refused before any launch; a SwiGLU kernel
    given a finish counter traps (it has no norm epilogue)."""
    gemv = CudaGemv(harness)
    module = _module("int8", 16, 32, 32, torch.float32, gemv)
    x, weight = torch.randn(2, 32), torch.ones(16)
    for residual, w in ((torch.zeros(2, 15), weight), (torch.zeros(3, 16), weight), (torch.zeros(2, 16), weight[:8]),
                        (torch.zeros(2, 16).half(), weight)):  # fmt: skip
        with pytest.raises(ValueError, match="a norm epilogue adds"):
            gemv.add_rms_norm(module, x, residual, w, 1e-6)
    cfg = L.gemv_launch("int8", 2, 8, 32, torch.float32, swiglu=True)
    args = [torch.empty(2, 8), x, module.qweight, module.scales, None, torch.zeros(2, 8), torch.ones(8),
            torch.empty(2, 8), torch.empty(2, 8), torch.zeros(1, dtype=torch.int32), *[None] * 8,
            2, 8, 32, 32, 0, 0, 0, 1e-6]  # fmt: skip
    with pytest.raises(HarnessError, match="trap"):
        harness.launch(cfg, args)


@pytest.mark.parametrize("mode", ["float", "int8", "int4"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    "hidden,inter,group", [(37, 64, 32), (64, 96, 32), (2056, 64, 32), (96, 200, 64), (40, 4608, 64)]
)
def test_an_mlp_in_one_launch_gives_what_its_launch_a_product_give(harness, mode, dtype, hidden, inter, group):
    """One row's MLP in one launch (gemv_mlp: the SwiGLU product's blocks, then the down product's with the add +
    norm after it, ordered by the tickets the blocks take as they start, in the harness's scrambled block
    order): the sum and the norm are those of the SwiGLU launch followed by the down product's launch with its
    norm epilogue, to the bit, for hidden sizes held in registers or looped over (the norm) and inter sizes of
    whole vectors or not, and the chain's counters are zero again after it."""
    launcher = RecordingLauncher(harness)
    gemv = CudaGemv(launcher)
    gate_up = _module(mode, 2 * inter, hidden, group, dtype, gemv)
    down = _module(mode, hidden, inter, group, dtype, gemv)
    gen = torch.Generator().manual_seed(hidden + inter)
    weight = (1 + 0.3 * torch.randn(hidden, generator=gen)).to(dtype)
    x = torch.randn(1, hidden, generator=gen).to(dtype)
    residual = (3 * torch.randn(1, hidden, generator=gen)).to(dtype)
    assert gemv.chains((gate_up, down), x)
    want_sum, want = gemv.add_rms_norm(down, gemv(gate_up, x, swiglu=True), residual, weight, 1e-6)
    launcher.kernels.clear()
    got_sum, got = gemv.mlp_add_rms_norm(gate_up, down, x, residual, weight, 1e-6)
    assert torch.equal(got_sum, want_sum) and torch.equal(got, want)
    assert launcher.kernels == [f"gemv_mlp_{mode}_{L.DTYPE_TAGS[str(dtype)[6:]]}"]
    assert not gemv._counters["cpu"].any()


@pytest.mark.parametrize("mode", ["float", "int8", "int4"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("hidden,inter,attn", [(37, 64, 48), (64, 96, 32), (2056, 64, 64), (40, 4608, 3072)])
def test_a_layer_tail_in_one_launch_gives_what_its_launches_give(harness, mode, dtype, hidden, inter, attn):
    """A layer's rest after attention for one row in one launch (gemv_tail: the o product's blocks with the add +
    post-attention norm, then the SwiGLU product's, then the down product's with the add + norm, each waiting for
    the one before, blocks in scrambled order): the two sums and norms are those of the o launch with its norm
    epilogue followed by the MLP launch, to the bit, and the chain's counters are zero again after it."""
    launcher = RecordingLauncher(harness)
    gemv = CudaGemv(launcher)
    o, gate_up, down = (_module(mode, n, k, 32, dtype, gemv) for n, k in ((hidden, attn), (2 * inter, hidden),
                                                                        (hidden, inter)))  # fmt: skip
    gen = torch.Generator().manual_seed(hidden + inter + attn)
    post_weight, weight = ((1 + 0.3 * torch.randn(hidden, generator=gen)).to(dtype) for _ in range(2))
    x = torch.randn(1, attn, generator=gen).to(dtype)
    residual = (3 * torch.randn(1, hidden, generator=gen)).to(dtype)
    assert gemv.chains((o, gate_up, down), x)
    sum_o, normed_o = gemv.add_rms_norm(o, x, residual, post_weight, 1e-5)
    want_sum, want = gemv.mlp_add_rms_norm(gate_up, down, normed_o, sum_o, weight, 1e-6)
    launcher.kernels.clear()
    got_sum, got = gemv.tail_add_rms_norm((o, gate_up, down), x, residual, (post_weight, 1e-5), weight, 1e-6)
    assert torch.equal(got_sum, want_sum) and torch.equal(got, want)
    assert launcher.kernels == [f"gemv_tail_{mode}_{L.DTYPE_TAGS[str(dtype)[6:]]}"]
    assert not gemv._counters["cpu"].any()
    gemv.tail_chain = False
    assert not gemv.chains((o, gate_up, down), x) and gemv.chains((gate_up, down), normed_o)


def test_an_mlp_launch_refuses_what_is_not_one_row_of_an_mlp_and_traps_a_wait_on_later_blocks(harness):
    """Rows, weights stored differently or not an MLP's shapes are refused before any launch, and ``chains`` says
    no for them; in the harness (blocks one after another) a down block that would wait for act blocks that have
    not run traps, where a GPU would wait for them forever."""
    gemv = CudaGemv(harness)
    gate_up, down = _module("int8", 64, 32, 32, torch.float32, gemv), _module("int8", 32, 32, 32, torch.float32, gemv)
    x, residual, weight = torch.randn(1, 32), torch.zeros(1, 32), torch.ones(32)
    others = {
        "rows": (gate_up, down, torch.randn(2, 32), torch.zeros(2, 32)),
        "storage": (gate_up, _module("int4", 32, 32, 32, torch.float32, gemv), x, residual),
        "shape": (gate_up, _module("int8", 32, 16, 16, torch.float32, gemv), x, residual),
    }
    for what, (up, dn, rows, res) in others.items():
        assert not gemv.chains((up, dn), rows) or what == "shape"  # a shape is the launch's to check
        with pytest.raises(ValueError, match="a chained launch takes one row"):
            gemv.mlp_add_rms_norm(up, dn, rows, res, weight, 1e-6)
    cfg = L.gemv_chain_launch("mlp", "int8", 32, 32, 32, torch.float32)
    up_tiles = L.gemv_launch("int8", 1, 32, 32, torch.float32, swiglu=True).grid[0]
    chain = torch.zeros(L.chain_counters("mlp"), dtype=torch.int32)
    chain[0] = up_tiles  # the first block to start takes the first down ticket
    args = [torch.empty(1, 32), x, gate_up.qweight, gate_up.scales, None, torch.empty(1, 32), down.qweight, down.scales,
            None, residual, weight, torch.empty(1, 32), torch.empty(1, 32), chain, 32, 32, 32, 1e-6]  # fmt: skip
    with pytest.raises(HarnessError, match="only later blocks make"):
        harness.launch(cfg, args)


# (head_dim, q heads, kv heads): Qwen3-VL's GQA of 2 at a small head size; one kv head; heads of 24, which
# the 16 columns of an int4 block (8 of int8) do not divide, so a block computes parts of two heads.
HEAD_SHAPES = [(32, 4, 2, 64), (64, 2, 1, 64), (24, 6, 3, 64), (32, 4, 2, 3072)]  # dim, q heads, kv heads, K


@pytest.mark.parametrize("mode", ["float", "int8", "int4"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("dim,nq,nkv,k", HEAD_SHAPES)
def test_the_heads_epilogue_gives_what_the_product_then_the_norm_rope_kernel_give(
    harness, mode, dtype, dim, nq, nkv, k
):
    """The q/k/v product's launch normalises and rotates its q and k heads (the block that finishes a head
    last, in the harness's scrambled block order), and with a KV sink stores each rotated key and each value
    at its token's slot, nothing for a padding row (slot -1): the heads, the values and the pools are those of
    the product followed by the rms_norm_rope kernel, to the bit; one launch a batch of up to 8 rows (13
    quantized rows: two); the finish counters are zero again after."""
    launcher = RecordingLauncher(harness)
    gemv = CudaGemv(launcher)
    heads = nq + nkv
    module = _module(mode, (nq + 2 * nkv) * dim, k, 32, dtype, gemv)
    gen = torch.Generator().manual_seed(dim)
    q_w, k_w = ((1 + 0.3 * torch.randn(dim, generator=gen)).to(dtype) for _ in range(2))
    ops = CudaFusedOps(harness)
    for rows in (1, 3, 8) if mode == "float" else (1, 3, 13):
        x = torch.randn(rows, k, generator=gen).to(dtype)
        angles = torch.rand(rows, dim // 2, generator=gen) * 50
        rope = TextRopeTables.build(angles.cos().repeat(1, 2).to(dtype), angles.sin().repeat(1, 2).to(dtype))
        product = gemv(module, x).view(rows, -1, dim)
        slots = torch.randperm(4 * rows, generator=gen)[:rows]
        slots[rows // 2] = -1
        sinks = [torch.full((2, rows, 4, nkv, dim), 7.0, dtype=dtype) for _ in range(2)]  # k and v pools
        want = ops.rms_norm(product[:, :heads], q_w, k_w, nq, 1e-6, rope, KVSink(*sinks[0], slots), product[:, heads:])
        assert torch.equal(want, ops.rms_norm(product[:, :heads], q_w, k_w, nq, 1e-6, rope))
        for sink in (None, KVSink(*sinks[1], slots)):
            launcher.kernels.clear()
            qk, v = gemv.norm_rope_heads(module, x, HeadNorms(q_w, k_w, nq, 1e-6), rope, sink)
            assert torch.equal(qk, want) and torch.equal(v, product[:, heads:])
            buckets = {1: [1], 3: [4], 8: [8], 13: [8, 8]}[rows]
            assert launcher.kernels == [f"gemv_{mode}_{L.DTYPE_TAGS[str(dtype)[6:]]}_r{r}" for r in buckets]
            assert not gemv._counters["cpu"].any()
        assert torch.equal(sinks[1], sinks[0])
        assert (sinks[1] != 7).sum() == 2 * (rows - 1) * nkv * dim  # the padding row stored nothing


def test_the_heads_epilogue_refuses_what_is_not_a_layer_of_heads(harness):
    """A projection whose rows are not q heads then as many k as v heads, norm weights or RoPE tables of
    another size, and a KV sink that does not take the heads are refused before any launch; a launch with
    heads but no finish counters traps."""
    gemv = CudaGemv(harness)
    module = _module("int8", 4 * 8, 32, 32, torch.float32, gemv)  # 4 heads of 8: 2 q, 1 k, 1 v
    x, w = torch.randn(2, 32), torch.ones(8)
    angles = torch.rand(2, 4)
    rope = TextRopeTables.build(angles.cos().repeat(1, 2), angles.sin().repeat(1, 2))
    gemv.norm_rope_heads(module, x, HeadNorms(w, w, 2, 1e-6), rope)
    slots = torch.tensor([0, 1])
    refused = {
        "a heads epilogue takes": ((w, w, 1, rope, None), (torch.ones(6), torch.ones(6), 2, rope, None)),
        "weight": ((w, torch.ones(4), 2, rope, None),),
        "rope table": ((w, w, 2, TextRopeTables.build(angles.cos(), angles.sin()), None),),
        "do not take": ((w, w, 2, rope, KVSink(torch.zeros(2, 4, 2, 8), torch.zeros(2, 4, 2, 8), slots)),),
        "slots must be": ((w, w, 2, rope, KVSink(torch.zeros(2, 4, 1, 8), torch.zeros(2, 4, 1, 8), slots.int())),),
    }
    for message, cases in refused.items():
        for q_w, k_w, split, tables, sink in cases:
            with pytest.raises(ValueError, match=message):
                gemv.norm_rope_heads(module, x, HeadNorms(q_w, k_w, split, 1e-6), tables, sink)
    cfg = L.gemv_launch("int8", 2, 32, 32, torch.float32)
    args = [torch.empty(2, 32), x, module.qweight, module.scales, *[None] * 5, None, torch.empty(2, 3, 8), w, w,
            rope.cos, rope.sin_signed, None, None, None, 2, 32, 32, 32, 3, 2, 8, 1e-6]  # fmt: skip
    with pytest.raises(HarnessError, match="trap"):
        harness.launch(cfg, args)


def _timer(launcher: RecordingLauncher, kernel_wins_up_to: int):
    """A stand-in for the device timing: runs the product once and says the GEMV kernel took 1 us for up to
    ``kernel_wins_up_to`` rows and 3 us above, torch 2 us."""

    def time_us(fn, calls):
        before = len(launcher.kernels)
        rows = fn().shape[0]
        if not _gemv_launched(launcher, before):
            return 2.0
        return 1.0 if rows <= kernel_wins_up_to else 3.0

    return time_us


def _gemv_launched(launcher: RecordingLauncher, since: int) -> bool:
    return any(k.startswith("gemv_") for k in launcher.kernels[since:])


def test_a_float_weight_takes_the_kernel_for_the_row_buckets_it_won_and_says_so(harness):
    launcher = RecordingLauncher(harness)
    weight = torch.randn(40, 64)
    rows, why = CudaGemv(launcher, _timer(launcher, 2)).faster_rows([weight])
    assert rows == 2  # 1 and 2 rows won, 4 lost: 8 not timed
    assert (
        why
        == "kernel for 1..2 rows (kernel vs F.linear: 1 row 1.0 vs 2.0 us, 2 rows 1.0 vs 2.0 us, 4 rows 3.0 vs 2.0 us)"
    )
    assert launcher.kernels == ["gemv_float_f32_r1", "gemv_float_f32_r2", "gemv_float_f32_r4"]
    assert CudaGemv(launcher, _timer(launcher, 0)).faster_rows([weight])[0] == 0
    assert CudaGemv(launcher, _timer(launcher, 8)).faster_rows([weight])[0] == 8
    not_contiguous = CudaGemv(launcher, _timer(launcher, 8)).faster_rows([weight.t()])
    assert not_contiguous[0] == 0 and not_contiguous[1].startswith("F.linear (")

    def failing(fn, calls):
        raise RuntimeError("capture failed")

    assert CudaGemv(launcher, failing).faster_rows([weight]) == (
        0,
        "F.linear (kernel vs F.linear: 1 rows not timed: RuntimeError: capture failed)",
    )


def test_a_swiglu_weight_is_timed_with_its_activation_on_both_sides(harness):
    """The epilogue kernel against what the MLP runs without it: F.linear, then the silu_mul kernel."""
    launcher = RecordingLauncher(harness)
    rows, why = CudaGemv(launcher, _timer(launcher, 1)).faster_rows([torch.randn(40, 64)], epilogue="swiglu")
    assert rows == 1 and why.startswith("kernel for 1..1 rows (kernel vs F.linear: 1 row 1.0 vs 2.0 us")
    assert launcher.kernels == ["gemv_float_swiglu_f32_r1", "silu_mul_f32", "gemv_float_swiglu_f32_r2", "silu_mul_f32"]


def test_an_o_or_down_weight_is_timed_with_the_add_and_norm_after_it_on_both_sides(harness):
    """The kernel with its norm epilogue (one launch) against F.linear followed by the add_rms_norm kernel;
    with the epilogue off, the kernel followed by add_rms_norm too."""
    launcher = RecordingLauncher(harness)
    gemv = CudaGemv(launcher, _timer(launcher, 1))
    rows, why = gemv.faster_rows([torch.randn(40, 64)], epilogue="norm")
    assert rows == 1 and why.startswith("kernel for 1..1 rows (kernel vs F.linear: 1 row 1.0 vs 2.0 us")
    assert launcher.kernels == ["gemv_float_f32_r1", "add_rms_norm_f32", "gemv_float_f32_r2", "add_rms_norm_f32"]
    launcher.kernels.clear()
    gemv.norm_epilogue = False
    assert gemv.faster_rows([torch.randn(40, 64)], epilogue="norm")[0] == 1
    assert launcher.kernels[:3] == ["gemv_float_f32_r1", "add_rms_norm_f32", "add_rms_norm_f32"]


def test_a_q_k_v_weight_is_timed_with_the_norms_rope_and_kv_sink_after_it_on_both_sides(harness):
    """The kernel with its heads epilogue (one launch) against F.linear followed by the rms_norm_rope kernel;
    with the epilogue off, the kernel followed by rms_norm_rope too. The log names the epilogue."""
    launcher = RecordingLauncher(harness)
    gemv = CudaGemv(launcher, _timer(launcher, 1))
    weight = torch.randn(8 * 16, 64)  # 4 q heads, 2 k and 2 v heads of 16
    rows, why = gemv.faster_rows([weight], epilogue="heads 4 16")
    assert rows == 1 and why.startswith("kernel for 1..1 rows (kernel vs F.linear: 1 row 1.0 vs 2.0 us")
    assert launcher.kernels == ["gemv_float_f32_r1", "rms_norm_rope_f32", "gemv_float_f32_r2", "rms_norm_rope_f32"]
    launcher.kernels.clear()
    gemv.norm_epilogue = False
    assert gemv.faster_rows([weight], epilogue="heads 4 16")[0] == 1
    assert launcher.kernels[:3] == ["gemv_float_f32_r1", "rms_norm_rope_f32", "rms_norm_rope_f32"]


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_a_quantized_swiglu_runs_apart_for_the_rows_where_that_measured_faster_to_the_bit(harness, mode):
    """A quantized gate/up shape is timed with the SwiGLU in the product's launch against the plain product then
    the silu_mul kernel, walking through its layers' weights; for the row buckets the second won its products
    take it, with the first's results to the bit (the kernel rounds each sum to the dtype first, as silu_mul
    reads them), and the other rows and shapes keep the one launch."""
    launcher = RecordingLauncher(harness)
    weights = [torch.randn(2 * 24, 96) for _ in range(3)]
    modules = [QuantizedLinear.from_weight(w, WeightQuant(mode, 32)) for w in weights]
    timed: list[tuple[int, bool]] = []

    def time_us(fn, calls):  # the product then silu_mul 1 us up to 2 rows, the SwiGLU launch always 2 us
        before = len(launcher.kernels)
        rows = fn().shape[0]
        apart = "silu_mul" in " ".join(launcher.kernels[before:])
        timed.append((rows, apart))
        return (1.0 if rows <= 2 else 3.0) if apart else 2.0

    gemv = CudaGemv(launcher, time_us)
    x = torch.randn(8, 96)
    want = {rows: gemv(modules[0], x[:rows], swiglu=True) for rows in (1, 2, 4)}  # before timing: one launch
    rows, why = gemv.swiglu_rows(modules, torch.float32)
    assert rows == 2 and timed == [(1, True), (1, False), (2, True), (2, False), (4, True), (4, False)]
    assert why == ("product then silu_mul for 1..2 rows (then silu_mul vs in the launch: 1 row 1.0 vs 2.0 us, "
                   "2 rows 1.0 vs 2.0 us, 4 rows 3.0 vs 2.0 us)")  # fmt: skip
    for n, expected in want.items():
        launcher.kernels.clear()
        assert torch.equal(gemv(modules[0], x[:n], swiglu=True), expected)
        if n <= 2:
            assert launcher.kernels == [f"gemv_{mode}_f32_r{n}", "silu_mul_f32"]
        else:
            assert launcher.kernels == [f"gemv_{mode}_swiglu_f32_r{n}"]
    other = QuantizedLinear.from_weight(torch.randn(2 * 16, 96), WeightQuant(mode, 32))  # a shape not timed
    launcher.kernels.clear()
    gemv(other, x[:1], swiglu=True)
    assert launcher.kernels == [f"gemv_{mode}_swiglu_f32_r1"]


def test_a_timed_graph_walks_through_the_weights_of_the_shape_as_a_decode_step_does(harness):
    """One product per weight in turn (layers' weights are not in L2 when their product starts), as many
    products as the timing's byte budget asks for, at most 16."""
    weights = [torch.randn(8, 32) for _ in range(3)]
    read: list[int] = []

    class WeightsRead(RecordingLauncher):
        def launch(self, cfg, args):
            read.append(args[2].data_ptr())
            super().launch(cfg, args)

    calls_asked: list[int] = []

    def time_us(fn, calls):
        calls_asked.append(calls)
        for _ in range(calls):
            fn()
        return 1.0  # a tie: the kernel is not faster, so only one row is timed

    assert CudaGemv(WeightsRead(harness), time_us).faster_rows(weights)[0] == 0
    assert calls_asked == [16, 16]
    assert read == [w.data_ptr() for w in weights] * 5 + [weights[0].data_ptr()]


@pytest.mark.parametrize("mode", ["none", "int4"])
def test_a_model_routed_to_the_kernels_computes_what_it_computed_and_detaching_restores_it(harness, mode):
    """A tiny model in fp32: each float shape timed once; a forward of one token (a decode step's rows) runs
    every projection and the head through the kernels, one of 20 tokens (a prefill) only the last layer's o
    product and MLP and the head (the last token's rows; INT4 weights of the other products widened by a kernel
    for torch's), and both give the logits the model gave before; None
    puts back the modules as loaded;
    without CUDA graphs the float weights are not timed and stay as loaded."""
    from orin_vlm_node.engine import Engine, EngineConfig

    path = cached_tiny_checkpoint()
    cache = Engine(EngineConfig(model_path=str(path), device="cpu", max_sessions=0)).cache
    # The LM head stays float: a model with both quantized and float weights to route.
    model = load_model(path, quant=WeightQuant(mode, 32, lm_head=False) if mode != "none" else None)
    sites = [*model.language_model.projection_sites(), (model, "lm_head")]
    loaded = [getattr(parent, attr) for parent, attr in sites]

    def logits(tokens: int) -> torch.Tensor:
        seq = cache.new_sequence()
        ids = torch.arange(5, 5 + tokens)
        out = model.forward(ids, torch.arange(tokens).expand(3, -1), cache.step(seq, tokens))
        cache.release(seq)
        return out

    want = {tokens: logits(tokens) for tokens in (1, 20)}
    launcher = RecordingLauncher(harness)
    timed: list[tuple] = []

    def time_us(fn, calls):
        before = len(launcher.kernels)
        timed.append(tuple(fn().shape))
        return 1.0 if _gemv_launched(launcher, before) else 2.0

    what = attach_gemv(model, CudaGemv(launcher, time_us))
    floats = 1 if mode == "int4" else len(sites)
    epilogue = [product_epilogue(parent, attr) for parent, attr in sites]
    keys = {
        (tuple(m.weight.shape), e)
        for m, e in zip(loaded, epilogue, strict=True)
        if isinstance(getattr(m, "weight", None), torch.Tensor)
    }
    swiglus = 2 if mode == "int4" else 0  # the quantized gate/up shape: its two ways tie at one row, so it stops
    assert len(timed) == 2 * len(L.GEMV_ROW_BUCKETS) * len(keys) + swiglus  # every bucket won: each key timed once
    assert ("+ SwiGLU: kernel for 1..8 rows" in what) == (mode == "none")
    tie = "+ SwiGLU: SwiGLU in the product's launch (then silu_mul vs in the launch: 1 row 1.0 vs 1.0 us)"
    assert (tie in what) == (mode == "int4")
    assert ("+ q/k norms + RoPE: kernel for 1..8 rows" in what) == (mode == "none")
    assert what.startswith("GEMV kernels for decode rows: ")
    assert f"{floats} of {floats} float ones" in what
    assert (f"{len(sites) - 1} quantized projections" in what) == (mode == "int4")
    routed = [getattr(parent, attr) for parent, attr in sites]
    kinds = [QuantizedLinear] * (len(sites) - 1) if mode == "int4" else [GemvLinear] * (len(sites) - 1)
    assert [type(m) for m in routed] == [*kinds, GemvLinear]
    assert all(m.kernels is not None for m in routed)
    assert routed[-1].matrix is model.language_model.embed_tokens.weight  # the tied head: no copy
    launcher.kernels.clear()
    torch.testing.assert_close(logits(1), want[1], rtol=1e-4, atol=1e-5)
    stored = "int4" if mode == "int4" else "float"  # the gate/up products with the activation in the kernel
    epilogues = ["_swiglu" if e == "swiglu" else "" for e in epilogue[:-1]]
    assert launcher.kernels == [f"gemv_{stored}{e}_f32_r1" for e in epilogues] + ["gemv_float_f32_r1"]
    assert epilogues.count("_swiglu") == model.config.text.num_hidden_layers
    launcher.kernels.clear()
    torch.testing.assert_close(logits(20), want[20], rtol=1e-4, atol=1e-5)  # a prefill: torch's products (on
    # INT4 weights widened by a launch each), but for the last layer's o product and MLP and the head: the last
    # token's rows only, the rows of a decode step
    layers = model.config.text.num_hidden_layers
    widened = ["widen_int4_f32"] * (4 * (layers - 1) + 1) if mode == "int4" else []
    tail = [f"gemv_{stored}_f32_r1", f"gemv_{stored}_swiglu_f32_r1", f"gemv_{stored}_f32_r1"]
    assert launcher.kernels == [*widened, *tail, "gemv_float_f32_r1"]
    assert attach_gemv(model, None) == ""
    assert all(getattr(parent, attr) is m for (parent, attr), m in zip(sites, loaded, strict=True))
    assert all(m.kernels is None for m in model.modules() if isinstance(m, QuantizedLinear))
    timed.clear()  # a decode without CUDA graphs: float weights stay on torch, untimed
    what = attach_gemv(model, CudaGemv(launcher, time_us), floats=False)
    assert what.endswith(f"float ones: F.linear ({floats}; decode not in CUDA graphs)") and not timed
    assert all(getattr(parent, attr) is m for (parent, attr), m in zip(sites, loaded, strict=True))


@pytest.mark.parametrize("mode", ["none", "int4"])
def test_a_decode_step_runs_its_norms_in_the_launches_of_the_products_before_them(harness, mode):
    """With the GEMV and the fused kernels attached, a one-token forward runs every residual add + norm in the
    launch of the product before it (each layer's o and down projections; the first layer's input norm has
    no add) and the q/k norms + RoPE in the q/k/v product's launch: no add_rms_norm or rms_norm_rope launch,
    everything after a layer's attention one launch (o + add + norm, gate/up + SwiGLU, down + add + norm:
    gemv_tail), and the logits of the separate launches to the bit, as with the o product alone (``tail_chain``
    off: gemv_mlp) and with a launch a product (``mlp_chain`` off). A prefill's rows (more than a launch takes)
    keep the separate launches, but for the last layer's tail (its last row: o, the MLP, the post-attention and
    final norms)."""
    from orin_vlm_node.engine import Engine, EngineConfig
    from orin_vlm_node.model.text import attach_fused_ops

    path = cached_tiny_checkpoint()
    cache = Engine(EngineConfig(model_path=str(path), device="cpu", max_sessions=0)).cache
    model = load_model(path, quant=WeightQuant(mode, 32) if mode != "none" else None)
    launcher = RecordingLauncher(harness)
    gemv = CudaGemv(launcher, _timer(launcher, 8))  # float weights: the kernel won every rows bucket
    attach_gemv(model, gemv)
    attach_fused_ops(model, CudaFusedOps(launcher))
    layers = model.config.text.num_hidden_layers

    def logits(tokens: int, epilogue: bool) -> torch.Tensor:
        gemv.norm_epilogue = epilogue
        launcher.kernels.clear()
        seq = cache.new_sequence()
        out = model.forward(torch.arange(5, 5 + tokens), torch.arange(tokens).expand(3, -1), cache.step(seq, tokens))
        cache.release(seq)
        return out

    separate = logits(1, epilogue=False)
    assert launcher.kernels.count("add_rms_norm_f32") == 2 * layers
    assert launcher.kernels.count("rms_norm_rope_f32") == layers
    assert torch.equal(logits(1, epilogue=True), separate)
    assert "add_rms_norm_f32" not in launcher.kernels and "rms_norm_rope_f32" not in launcher.kernels
    assert launcher.kernels.count("rms_norm_f32") == 1  # the first layer's input norm: no residual add before it
    stored = "int4" if mode == "int4" else "float"
    assert launcher.kernels.count(f"gemv_tail_{stored}_f32") == layers  # o, the MLP and both norms after attention
    gemvs = 2 * layers + 1  # q/k/v and the tail a layer, and the LM head
    assert len(launcher.kernels) == 2 + gemvs  # and the RoPE tables, the input norm (attention is torch's here)
    for chains, per_layer in (({"tail_chain": False}, 3), ({"mlp_chain": False}, 4)):  # o alone; every product alone
        vars(gemv).update(chains)
        assert torch.equal(logits(1, epilogue=True), separate)
        assert len(launcher.kernels) == 2 + per_layer * layers + 1
        assert launcher.kernels.count(f"gemv_mlp_{stored}_f32") == layers * (per_layer == 3)
    gemv.mlp_chain = gemv.tail_chain = True
    torch.testing.assert_close(logits(20, epilogue=True), logits(20, epilogue=False), rtol=0, atol=0)
    assert launcher.kernels.count("add_rms_norm_f32") == 2 * layers  # the last two: the last layer's tail's
    logits(20, epilogue=True)
    assert launcher.kernels.count("add_rms_norm_f32") == 2 * layers - 2
    assert launcher.kernels.count("rms_norm_rope_f32") == layers


def test_a_quantized_lm_head_takes_the_kernels_and_the_model_computes_what_it_computed(harness):
    path = cached_tiny_checkpoint()
    model = load_model(path, quant=WeightQuant("int8"))  # the LM head quantized too (tied: a copy)
    from orin_vlm_node.engine import Engine, EngineConfig

    cache = Engine(EngineConfig(model_path=str(path), device="cpu", max_sessions=0)).cache
    ids = torch.arange(5, 25)  # 20 tokens: more rows than the kernels take

    def logits() -> torch.Tensor:
        seq = cache.new_sequence()
        out = model.forward(ids, torch.arange(len(ids)).expand(3, -1), cache.step(seq, len(ids)))
        cache.release(seq)
        return out

    want = logits()
    launcher = RecordingLauncher(harness)
    what = attach_gemv(model, CudaGemv(launcher, _timer(launcher, 8)))  # the SwiGLU's two ways tie: in the launch
    projections = 4 * model.config.text.num_hidden_layers
    assert what.startswith(f"GEMV kernels for decode rows: {projections} quantized projections + int8 LM head; ")
    assert what.endswith("SwiGLU: SwiGLU in the product's launch (then silu_mul vs in the launch: 1 row 1.0 vs 1.0 us)")
    launcher.kernels.clear()
    torch.testing.assert_close(logits(), want, rtol=1e-4, atol=1e-5)
    # a prefill: torch's products, but the last layer's o product and MLP and the head for the last row
    assert launcher.kernels == ["gemv_int8_f32_r1", "gemv_int8_swiglu_f32_r1", "gemv_int8_f32_r1", "gemv_int8_f32_r1"]


def test_a_quantized_projection_routes_decode_rows_to_the_kernels_and_prefill_to_torch(harness):
    module = _quantized(48, 128, "int4", 32, seed=1)
    launcher = RecordingLauncher(harness)
    module.kernels = CudaGemv(launcher)
    x = torch.randn(20, 128)
    torch.testing.assert_close(module(x[:4]), F.linear(x[:4], module.dequantize(torch.float32)))
    assert launcher.kernels == ["gemv_int4_f32_r4"]
    module(x)  # 20 rows: a prefill, torch's GEMM on the weight widened by a kernel
    assert launcher.kernels == ["gemv_int4_f32_r4", "widen_int4_f32"]


def test_gemv_launch_picks_the_rows_bucket_and_refuses_what_no_kernel_takes():
    assert L.gemv_launch("int8", 3, 37, 64, torch.float16).kernel == "gemv_int8_f16_r4"
    assert L.gemv_launch("float", 5, 37, 64, torch.float16).kernel == "gemv_float_f16_r8"
    assert L.gemv_launch("int4", 1, 37, 64, torch.bfloat16).grid == (3, 1, 1)  # 16 columns a block: 4 a warp
    assert L.gemv_launch("int4", 1, 37, 64, torch.bfloat16, swiglu=True).grid == (5, 1, 1)  # 2 a warp, + up rows
    assert L.gemv_launch("int8", 1, 37, 64, torch.bfloat16).grid == (5, 1, 1)  # 8 columns a block: 2 a warp
    assert L.gemv_launch("float", 1, 37, 64, torch.bfloat16).grid == (10, 1, 1)  # 4 columns a block: 1 a warp
    assert L.gemv_launch("int4", 2, 37, 64, torch.bfloat16, swiglu=True).kernel == "gemv_int4_swiglu_bf16_r2"
    with pytest.raises(L.UnsupportedShape, match="1..8 rows"):
        L.gemv_launch("int8", 9, 37, 64, torch.float16)
    with pytest.raises(L.UnsupportedShape, match="int3"):
        L.gemv_launch("int3", 1, 37, 64, torch.float16)


def test_long_rows_share_a_blocks_columns_among_its_warps_by_their_length_alone():
    """A warp's pass over a row of 2048 weights is one step in every format (8 vectors a lane in flight: fp16
    one row of 8, int8 two of 4, int4 four of 2, each 512 weights of int4 a vector), so the 2B's o product keeps
    a warp to its columns; its down product (K 6144, three steps) shares each column among the block's 4
    warps, 4 times the blocks; two steps, 2 warps. fp32 vectors hold half the weights (twice the steps)."""
    assert [L.gemv_slices(m, 2048, torch.float16) for m in L.GEMV_MODES] == [1, 1, 1]
    assert [L.gemv_slices(m, 4096, torch.float16) for m in L.GEMV_MODES] == [2, 2, 2]
    assert [L.gemv_slices(m, 6144, torch.float16) for m in L.GEMV_MODES] == [4, 4, 4]
    assert L.gemv_slices("float", 2048, torch.float32) == 2 and L.gemv_slices("float", 2048, torch.bfloat16) == 1
    assert L.gemv_slices("int4", 2048, torch.float16, swiglu=True) == 1  # two columns with their up rows: 4 rows
    assert L.gemv_slices("float", 2048, torch.float16, swiglu=True) == 2  # 2 rows: 4 vectors a row in flight
    assert L.gemv_launch("int4", 1, 2048, 2048, torch.float16).grid == (128, 1, 1)
    assert L.gemv_launch("int4", 1, 2048, 6144, torch.float16).grid == (512, 1, 1)  # 4 columns a block
    assert L.gemv_launch("int8", 1, 2048, 4096, torch.float16).grid == (512, 1, 1)  # 2 warps a column pair
    assert L.gemv_chain_launch("tail", "int4", 6144, 2048, 2048, torch.float16).grid == (128 + 768 + 512, 1, 1)


def test_a_gemv_launch_sized_for_other_slices_traps(harness):
    """The kernel counts its slices from K as launch.gemv_slices does, and a grid sized otherwise (for one warp a
    column, or one block more) traps instead of leaving columns unwritten."""
    module = _quantized(8, 3072, "int8", 32, seed=1)  # int8 rows of 3072: two steps, two warps a column pair
    x = torch.randn(1, 3072)
    cfg = L.gemv_launch("int8", 1, 8, 3072, torch.float32)
    y = torch.full((1, 8), float("nan"))
    args = [y, x, module.qweight, module.scales, None, *[None] * 13, 1, 8, 3072, 32, 0, 0, 0, 1e-6]
    harness.launch(cfg, args)
    torch.testing.assert_close(y, F.linear(x, module.dequantize(torch.float32)), rtol=1e-5, atol=1e-5)
    for grid in (L.gemv_launch("int8", 1, 8, 64, torch.float32).grid, (cfg.grid[0] + 1, 1, 1)):
        with pytest.raises(HarnessError, match="trap"):
            harness.launch(L.LaunchConfig(cfg.kernel, grid, cfg.block, 0), args)
    gemv = CudaGemv(None)
    assert gemv.fits(_quantized(8, 32, "int8", 32, seed=0), torch.randn(16, 32))  # a batch of 16: two launches
    assert not gemv.fits(_quantized(8, 32, "int8", 32, seed=0), torch.randn(17, 32))
    half = GemvLinear(torch.nn.Linear(32, 8, bias=False).half(), gemv, rows=8)
    assert not gemv.fits(half, torch.randn(2, 32))  # fp32 rows, fp16 weight
    assert gemv.fits(half, torch.randn(2, 32).half())


@pytest.mark.parametrize("prompts", [PROMPTS, (7,)], ids=["three", "one"])
@pytest.mark.parametrize("mode", ["none", "int4"])
def test_a_static_decode_step_stores_kv_from_the_q_k_v_products_launch(harness, tmp_path, mode, prompts):
    """The static decode step (what a CUDA graph captures) with the GEMV kernels and the attention kernel,
    three sequences of different lengths in buffers of four (one padding row), or one sequence alone, crossing
    pages: the q/k/v product's launch normalises and rotates the heads and stores the step's K/V at their slots,
    and logits and the pool are those of the step with the separate launches (norm + RoPE storing them, add +
    norm, a launch a product), bit for bit; a layer is then 5 launches (q/k/v, attention, o, gate/up, down), 3
    for one sequence (o, the MLP and both norms one launch)."""
    from orin_vlm_node.cuda import CudaPagedAttention
    from orin_vlm_node.model.text import attach_fused_ops
    from support.checkpoints import make_tiny_checkpoint

    quant = WeightQuant(mode, 32) if mode != "none" else None
    model = load_model(make_tiny_checkpoint(tmp_path / "ckpt", layers=2, seed=5), quant=quant)
    launcher = RecordingLauncher(harness)
    gemv = CudaGemv(launcher, _timer(launcher, 8))  # float weights: the kernel won every rows bucket
    attach_gemv(model, gemv)
    attach_fused_ops(model, CudaFusedOps(launcher))

    def run(epilogue: bool) -> tuple[list[torch.Tensor], torch.Tensor, list[list[str]]]:
        gemv.norm_epilogue = epilogue
        attention = CudaPagedAttention(launcher, sm_count=16, min_tokens_per_split=16)
        return run_static_decode(model, torch.float32, attention, launcher.kernels, steps=4, prompts=prompts)

    fused, separate = run(epilogue=True), run(epilogue=False)
    for a, b in zip(fused[0], separate[0], strict=True):
        assert torch.equal(a, b)
    assert torch.equal(fused[1], separate[1])
    layers = model.config.text.num_hidden_layers
    for kernels in fused[2]:
        assert not any(k.startswith(("rms_norm_rope", "add_rms_norm", "paged_kv_write")) for k in kernels)
        per_layer = 5 if len(prompts) > 1 else 3  # one sequence: o, the MLP and both norms one launch
        assert kernels.count(f"gemv_tail_{'float' if mode == 'none' else mode}_f32") == layers * (per_layer == 3)
        assert len(kernels) == 2 + per_layer * layers + 1  # the RoPE tables, the input norm, the layers, the LM head
    assert all(kernels.count("rms_norm_rope_f32") == layers for kernels in separate[2])


@pytest.mark.parametrize("name", ["qkv", "o", "mlp", "tail"])
def test_the_epilogue_benchmark_times_the_launches_the_decoder_runs(harness, name):
    """The GPU benchmark's ``epilogues`` part (``bench.gpu.epilogue_sides``) run here on small shapes: each
    side launches what its name says (the product, then the separate launch; or the product with the epilogue
    in its launch), and the epilogue's results are those of the separate launch after the same kernel."""
    from bench.gpu import epilogue_sides

    launcher = RecordingLauncher(harness)
    n, k = (8 * 16, 64) if name == "qkv" else (48, 64)  # 4 q heads, 2 k and 2 v heads of 16
    sides = epilogue_sides(launcher, name, n, k, (4, 2, 16), copies=2, device="cpu")
    separate = "rms_norm_rope_f16" if name == "qkv" else "add_rms_norm_f16"
    results = {}
    for side, (fn, items) in sides.items():
        launcher.kernels.clear()
        results[side] = [fn(item) for item in items]
        mode = "int4" if side.startswith("int4") else "float"
        if name == "mlp":  # cuBLAS's products (torch's) with the activation and the add + norm; the kernels' two; one
            ours = {"then": [f"gemv_{mode}_swiglu_f16_r1", f"gemv_{mode}_f16_r1"], "fused": [f"gemv_mlp_{mode}_f16"]}
            launches = ["silu_mul_f16", separate] if side == "fp16_cublas_then" else ours[side.rsplit("_", 1)[1]]
        elif name == "tail":  # the same after o and its add + norm; the kernels' o launch and MLP launch; one
            ours = {"then": [f"gemv_{mode}_f16_r1", f"gemv_mlp_{mode}_f16"], "fused": [f"gemv_tail_{mode}_f16"]}
            cublas = [separate, "silu_mul_f16", separate]
            launches = cublas if side == "fp16_cublas_then" else ours[side.rsplit("_", 1)[1]]
        else:
            product = [] if side == "fp16_cublas_then" else [f"gemv_{mode}_f16_r1"]
            launches = product + ([] if side.endswith("fused") else [separate])
        assert launcher.kernels == launches * len(items)
    for kind in ("fp16_kernel", "int4"):
        for then, fused in zip(results[f"{kind}_then"], results[f"{kind}_fused"], strict=True):
            assert all(torch.equal(a, b) for a, b in zip(then, fused, strict=True))
