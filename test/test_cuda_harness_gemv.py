"""The GEMV kernels (``kernels/gemv.cuh``) under the CPU CUDA emulator, through ``CudaGemv`` (the GPU path's
launch code), against torch: for a quantized weight what the reference ``QuantizedLinear`` computes (the float
product with the dequantized weight), for a float weight ``F.linear``, both in fp32. The kernels accumulate in
fp32, so the expected difference is the rounding of the output to its dtype plus accumulation order. The SwiGLU
epilogue (the MLP's gate/up product and its activation in one kernel) against torch's product followed by
``F.silu(gate) * up``, each rounded to the activation dtype as the separate ops round. An INT4 weight widened
for a prefill's many rows (``widen_int4``) against the reference's widened weight. Which projections of a model
take these kernels is ``test_cuda_harness_gemv_routing.py``'s."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from cuda_harness.harness import HarnessError, RecordingLauncher

from orin_vlm_node.cuda import launch as L
from orin_vlm_node.cuda.gemv import CudaGemv
from orin_vlm_node.weights.gemv_linear import GemvLinear
from support.random_weights import random_quantized

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


@pytest.mark.parametrize("mode", ["int8", "int4"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n,k,group", SHAPES)
def test_gemv_kernels_match_the_torch_reference(harness, mode, dtype, n, k, group):
    module = random_quantized(n, k, mode, group, seed=n * k)
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
    module = random_quantized(n, k, "int4", group, seed=n + k)
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
        gemv.widen(random_quantized(n, k, "int8", group, seed=1), dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("swiglu", [False, True])
def test_int4_products_hold_over_the_activations_whole_range(harness, dtype, swiglu):
    """The int4 vector path multiplies x, scaled by 2^64 or 2^60, with weights widened to subnormal floats:
    exact for |x| in [2^-41, 2^64). Activations spanning that range (fp32 and bf16 from 1e-12 to 1e18, fp16
    from its subnormals up to where the outputs stay finite), exact zeros among them, against the reference
    in float64."""
    n, k = 24, 256
    module = random_quantized(2 * n if swiglu else n, k, "int4", 32, seed=7)
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
        module = random_quantized(2 * n, k, mode, group, seed=n * k)
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
        CudaGemv(harness)(random_quantized(7, 32, "int8", 32, seed=0), torch.randn(1, 32), swiglu=True)


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


def test_a_gemv_launch_sized_for_other_slices_traps(harness):
    """The kernel counts its slices from K as launch.gemv_slices does, and a grid sized otherwise (for one warp a
    column, or one block more) traps instead of leaving columns unwritten."""
    module = random_quantized(8, 3072, "int8", 32, seed=1)  # int8 rows of 3072: two steps, two warps a column pair
    x = torch.randn(1, 3072)
    cfg = L.gemv_launch("int8", 1, 8, 3072, torch.float32)
    y = torch.full((1, 8), float("nan"))
    args = [y, x, module.qweight, module.scales, None, 1, 8, 3072, 32]
    harness.launch(cfg, args)
    torch.testing.assert_close(y, F.linear(x, module.dequantize(torch.float32)), rtol=1e-5, atol=1e-5)
    for grid in (L.gemv_launch("int8", 1, 8, 64, torch.float32).grid, (cfg.grid[0] + 1, 1, 1)):
        with pytest.raises(HarnessError, match="trap"):
            harness.launch(L.LaunchConfig(cfg.kernel, grid, cfg.block, 0), args)
    gemv = CudaGemv(None)
    assert gemv.fits(random_quantized(8, 32, "int8", 32, seed=0), torch.randn(16, 32))  # a batch of 16: two launches
    assert not gemv.fits(random_quantized(8, 32, "int8", 32, seed=0), torch.randn(17, 32))
    half = GemvLinear(torch.nn.Linear(32, 8, bias=False).half(), gemv, rows=8)
    assert not gemv.fits(half, torch.randn(2, 32))  # fp32 rows, fp16 weight
    assert gemv.fits(half, torch.randn(2, 32).half())
