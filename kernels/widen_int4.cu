// WIDEN INT4: a packed INT4 weight (model/quant.py's format) widened to the activations' dtype in one pass, for
// the products of many rows (a prefill), which torch's tiled GEMM computes on the widened weight.
//
// widen_int4_<dtype>: qweight [N, ceil(K / 2)] uint8 (even k in the low nibble), scales and offsets
// [N, ceil(K / G)] fp16 -> out [N, K]: w = q * s + m, rounded in fp32 as torch's reference does it
// (QuantizedLinear.dequantize: the product, then the sum, each rounded, then the dtype), so the product of
// many rows is the reference's to the bit. Written with torch ops that reference takes about ten kernels and
// fp32 copies of the whole weight (the 2B's gate/up: 100 MB each), every prefill; here one read of the
// stored bytes and one write of the widened weight.
#include "attention_common.cuh"

namespace orin_vlm {

constexpr int kWidenThreads = 256;

// Grid: (ceil(N * ceil(K / 2) / kWidenThreads)); block: kWidenThreads threads; one stored byte (two weights,
// one for the last byte of an odd K) per thread, so a warp reads 32 adjacent bytes and writes 64 adjacent
// weights of a row. `group` is a power of two (quant.py refuses others).
template <typename T>
__device__ __forceinline__ void widen_int4(T* __restrict__ out, const unsigned char* __restrict__ qweight,
                                           const __half* __restrict__ scales, const __half* __restrict__ offsets,
                                           int N, int K, int group) {
  if (blockDim.x != kWidenThreads) KERNEL_TRAP();
  const long long row_bytes = (K + 1) / 2;
  const long long i = static_cast<long long>(blockIdx.x) * kWidenThreads + threadIdx.x;
  if (i >= static_cast<long long>(N) * row_bytes) return;
  const long long n = i / row_bytes;
  const int k = static_cast<int>(i % row_bytes) * 2;
  const int groups = (K + group - 1) / group;
  const unsigned byte = __ldg(qweight + i);
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    if (k + h >= K) break;
    const long long g = n * groups + (k + h) / group;
    const float q = static_cast<float>((byte >> (4 * h)) & 0xFu);
    const float value = __fadd_rn(__fmul_rn(q, to_float(__ldg(scales + g))), to_float(__ldg(offsets + g)));
    out[n * K + k + h] = from_float<T>(value);
  }
}

}  // namespace orin_vlm

#define ORIN_WIDEN_INT4_KERNEL(DT, T)                                                                             \
  extern "C" __global__ void __launch_bounds__(orin_vlm::kWidenThreads) widen_int4_##DT(                          \
      T* out, const unsigned char* qweight, const __half* scales, const __half* offsets, int N, int K, int group) { \
    KERNEL_PROLOGUE();                                                                                            \
    orin_vlm::widen_int4<T>(out, qweight, scales, offsets, N, K, group);                                          \
  }

ORIN_WITH_f32(ORIN_WIDEN_INT4_KERNEL(f32, float))
ORIN_WITH_f16(ORIN_WIDEN_INT4_KERNEL(f16, __half))
ORIN_WITH_bf16(ORIN_WIDEN_INT4_KERNEL(bf16, __nv_bfloat16))
