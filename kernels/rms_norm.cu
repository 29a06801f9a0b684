// RMS NORM of rows, the weight applied: one kernel where torch runs seven (cast, square, mean, add eps,
// rsqrt, scale, cast back) plus the weight product; at batch 1 a decode step is made of such small kernels.
//
// rms_norm_<dtype>: row r of `rows = tokens * heads` is head h = r % heads of token t = r / heads, read at
// x + t * x_token_stride + h * dim (the q and k heads of a fused q/k/v projection are normalised in place
// of their token rows; a plain norm has heads = 1 and x_token_stride = dim). Heads below `split` take
// weight_a, the others weight_b (q_norm and k_norm in one launch; weight_b is not read when split >= heads).
// out is contiguous [rows, dim].
//
// The arithmetic is torch's: x widened to fp32, mean of squares as sum * (1 / dim), x * rsqrt(mean + eps)
// rounded to the storage type, then the weight product computed in fp32 and rounded again (Qwen3's RMSNorm
// multiplies by its weight after casting back; for fp32 both roundings are exact).
#include "attention_common.cuh"

namespace orin_vlm {

constexpr int kNormThreads = 128;

// Grid: (rows); block: kNormThreads threads.
template <typename T>
__device__ __forceinline__ void rms_norm(T* __restrict__ out, const T* __restrict__ x, const T* __restrict__ weight_a,
                                         const T* __restrict__ weight_b, int heads, int split, int dim,
                                         int x_token_stride, float eps) {
  if (blockDim.x != kNormThreads) KERNEL_TRAP();
  __shared__ float warp_sums[kNormThreads / kWarpSize];
  const int row = blockIdx.x;
  const int head = row % heads;
  const T* xr = x + static_cast<size_t>(row / heads) * x_token_stride + static_cast<size_t>(head) * dim;
  const T* w = head < split ? weight_a : weight_b;
  float squares = 0.0f;
  for (int d = threadIdx.x; d < dim; d += kNormThreads) {
    const float v = to_float(__ldg(xr + d));
    squares += v * v;
  }
  squares = warp_sum(squares);
  const int warp = threadIdx.x / kWarpSize;
  if (threadIdx.x % kWarpSize == 0) warp_sums[warp] = squares;
  __syncthreads();
  float total = 0.0f;
#pragma unroll
  for (int i = 0; i < kNormThreads / kWarpSize; ++i) total += warp_sums[i];
  const float inv = rsqrtf(total * (1.0f / static_cast<float>(dim)) + eps);
  T* o = out + static_cast<size_t>(row) * dim;
  for (int d = threadIdx.x; d < dim; d += kNormThreads) {
    const float normed = to_float(from_float<T>(to_float(__ldg(xr + d)) * inv));
    o[d] = from_float<T>(to_float(__ldg(w + d)) * normed);
  }
}

}  // namespace orin_vlm

#define ORIN_RMS_NORM_KERNEL(DT, T)                                                                          \
  extern "C" __global__ void __launch_bounds__(orin_vlm::kNormThreads)                                      \
      rms_norm_##DT(T* out, const T* x, const T* weight_a, const T* weight_b, int heads, int split, int dim, \
                    int x_token_stride, float eps) {                                                        \
    orin_vlm::rms_norm<T>(out, x, weight_a, weight_b, heads, split, dim, x_token_stride, eps);              \
  }

ORIN_RMS_NORM_KERNEL(f32, float)
ORIN_RMS_NORM_KERNEL(f16, __half)
ORIN_RMS_NORM_KERNEL(bf16, __nv_bfloat16)
