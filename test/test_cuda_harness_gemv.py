"""The quantized GEMV kernels (``kernels/quant_gemv.cu``) under the CPU CUDA emulator, through
``CudaQuantGemv`` (the GPU path's launch code), against the torch reference ``QuantizedLinear`` computes:
the float product with the dequantized weight, in fp32. The kernels accumulate in fp32, so the expected
difference is the rounding of the output to its dtype plus accumulation order."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from orin_vlm_node.cuda import launch as L
from orin_vlm_node.cuda.quant_gemv import CudaQuantGemv
from orin_vlm_node.model.quant import QuantizedLinear, WeightQuant, attach_kernels

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
RTOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}

# (N, K, group): the vector path (K and the group multiples of 32), N not a multiple of the 4 columns a
# block computes, K not a multiple of the group, odd K, groups smaller than a vector (the scalar path), and
# rows long enough that a lane loads more than one batch of vectors, the last one partly (4608: int8 9
# vectors a lane, int4 4 or 5).
SHAPES = [(64, 128, 32), (37, 256, 128), (21, 96, 64), (19, 75, 32), (8, 33, 2), (5, 64, 16), (6, 4608, 128)]


def _quantized(n: int, k: int, mode: str, group: int, seed: int) -> QuantizedLinear:
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.05
    return QuantizedLinear.from_weight(w, WeightQuant(mode, group))


@pytest.mark.parametrize("mode", ["int8", "int4"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n,k,group", SHAPES)
def test_gemv_kernels_match_the_torch_reference(harness, mode, dtype, n, k, group):
    module = _quantized(n, k, mode, group, seed=n * k)
    gemv = CudaQuantGemv(harness)
    weight = module.dequantize(torch.float32)
    for rows in (1, 3, 8):
        x = torch.randn(rows, k).to(dtype)
        assert gemv.fits(module, x)
        got = gemv(module, x)
        assert got.dtype == dtype and got.shape == (rows, n)
        expected = F.linear(x.float(), weight)
        scale = expected.abs().amax().item()
        torch.testing.assert_close(got.float(), expected, rtol=RTOL[dtype], atol=RTOL[dtype] * scale)


def test_a_quantized_projection_routes_decode_rows_to_the_kernels_and_prefill_to_torch(harness):
    module = _quantized(48, 128, "int4", 32, seed=1)
    launched: list[str] = []

    class Recording:
        def launch(self, cfg, args):
            launched.append(cfg.kernel)
            harness.launch(cfg, args)

    holder = torch.nn.Sequential(module)
    assert attach_kernels(holder, CudaQuantGemv(Recording())) == 1
    x = torch.randn(20, 128)
    torch.testing.assert_close(module(x[:4]), F.linear(x[:4], module.dequantize(torch.float32)))
    assert launched == ["quant_gemv_int4_f32_r4"]
    module(x)  # 20 rows: a prefill, torch's GEMM on the widened weight
    assert launched == ["quant_gemv_int4_f32_r4"]
    attach_kernels(holder, None)
    module(x[:1])
    assert len(launched) == 1


def test_gemv_launch_picks_the_rows_bucket_and_refuses_what_no_kernel_takes():
    assert L.gemv_launch("int8", 3, 37, torch.float16).kernel == "quant_gemv_int8_f16_r4"
    assert L.gemv_launch("int4", 1, 37, torch.bfloat16).grid == (10, 1, 1)
    with pytest.raises(L.UnsupportedShape, match="1..8 rows"):
        L.gemv_launch("int8", 9, 37, torch.float16)
    with pytest.raises(L.UnsupportedShape, match="int3"):
        L.gemv_launch("int3", 1, 37, torch.float16)
    assert not CudaQuantGemv(None).fits(_quantized(8, 32, "int8", 32, seed=0), torch.randn(9, 32))
