// RMS NORM of rows, the weight applied, optionally followed by the rotary embedding: one kernel where torch
// runs about eight (cast, square, mean, add eps, rsqrt, scale, cast back, weight product) and four more for
// RoPE (x * cos, swap halves, * sin, add); at batch 1 a decode step is made of such small kernels.
//
// add_rms_norm_<dtype>: the residual add before a norm too: sum = x + delta (rounded to the storage type, as
// torch's add) is written to sum_out and normalised into out, one row per token ([rows, dim], contiguous).
//
// rms_norm_<dtype> / rms_norm_rope_<dtype>: row r of `rows = tokens * heads` is head h = r % heads of token
// t = r / heads, read at x + t * x_token_stride + h * dim (the q and k heads of a fused q/k/v projection are
// normalised in place of their token rows; a plain norm has heads = 1 and x_token_stride = dim). Heads below
// `split` take weight_a, the others weight_b (q_norm and k_norm in one launch; weight_b is not read when
// split >= heads). out is contiguous [rows, dim].
//
// The arithmetic is torch's, rounding where torch's separate ops round: x widened to fp32, mean of squares
// as sum * (1 / dim), x * rsqrt(mean + eps) rounded to the storage type, the weight product rounded (Qwen3's
// RMSNorm multiplies by its weight after casting back). RoPE (the _rope kernels; dim even, <= 256):
// y = x * cos + swap_halves(x) * sin_signed with the token's rows of the two tables ([tokens, dim], the
// storage type, sin_signed = [-sin, sin] of the halves), each product and the sum rounded on its own and
// never contracted into a fused multiply-add.
#include "attention_common.cuh"

namespace orin_vlm {

constexpr int kNormThreads = 128;
constexpr int kMaxRopeDim = 256;

// 1 / sqrt(mean of squares + eps) of a row whose squares each thread of the block summed in part.
__device__ __forceinline__ float rms_scale(float squares, int dim, float eps) {
  __shared__ float warp_sums[kNormThreads / kWarpSize];
  squares = warp_sum(squares);
  if (threadIdx.x % kWarpSize == 0) warp_sums[threadIdx.x / kWarpSize] = squares;
  __syncthreads();
  float total = 0.0f;
#pragma unroll
  for (int i = 0; i < kNormThreads / kWarpSize; ++i) total += warp_sums[i];
  return rsqrtf(total * (1.0f / static_cast<float>(dim)) + eps);
}

// Grid: (rows); block: kNormThreads threads.
template <typename T, bool ROPE>
__device__ __forceinline__ void rms_norm(T* __restrict__ out, const T* __restrict__ x, const T* __restrict__ weight_a,
                                         const T* __restrict__ weight_b, const T* __restrict__ cos,
                                         const T* __restrict__ sin_signed, int heads, int split, int dim,
                                         int x_token_stride, float eps) {
  if (blockDim.x != kNormThreads) KERNEL_TRAP();
  const int row = blockIdx.x;
  const int token = row / heads;
  const int head = row % heads;
  const T* xr = x + static_cast<size_t>(token) * x_token_stride + static_cast<size_t>(head) * dim;
  const T* w = head < split ? weight_a : weight_b;
  float squares = 0.0f;
  for (int d = threadIdx.x; d < dim; d += kNormThreads) {
    const float v = to_float(__ldg(xr + d));
    squares += v * v;
  }
  const float inv = rms_scale(squares, dim, eps);
  T* o = out + static_cast<size_t>(row) * dim;
  if constexpr (!ROPE) {
    for (int d = threadIdx.x; d < dim; d += kNormThreads) {
      const float normed = to_float(from_float<T>(to_float(__ldg(xr + d)) * inv));
      o[d] = from_float<T>(to_float(__ldg(w + d)) * normed);
    }
  } else {
    if (dim > kMaxRopeDim || dim % 2 != 0) KERNEL_TRAP();
    __shared__ float normed_row[kMaxRopeDim];  // the weighted row, as rounded to T: RoPE pairs d with d +- dim/2
    for (int d = threadIdx.x; d < dim; d += kNormThreads) {
      const float normed = to_float(from_float<T>(to_float(__ldg(xr + d)) * inv));
      normed_row[d] = to_float(from_float<T>(to_float(__ldg(w + d)) * normed));
    }
    __syncthreads();
    const int half = dim / 2;
    const T* c = cos + static_cast<size_t>(token) * dim;
    const T* s = sin_signed + static_cast<size_t>(token) * dim;
    for (int d = threadIdx.x; d < dim; d += kNormThreads) {
      const float a = to_float(from_float<T>(__fmul_rn(normed_row[d], to_float(__ldg(c + d)))));
      const float b = to_float(from_float<T>(__fmul_rn(normed_row[d < half ? d + half : d - half], to_float(__ldg(s + d)))));
      o[d] = from_float<T>(__fadd_rn(a, b));
    }
  }
}

// Grid: (rows); block: kNormThreads threads. Each thread reads back only the sums it wrote itself.
template <typename T>
__device__ __forceinline__ void add_rms_norm(T* __restrict__ sum_out, T* __restrict__ out, const T* __restrict__ x,
                                             const T* __restrict__ delta, const T* __restrict__ weight, int dim,
                                             float eps) {
  if (blockDim.x != kNormThreads) KERNEL_TRAP();
  const size_t row = static_cast<size_t>(blockIdx.x) * dim;
  float squares = 0.0f;
  for (int d = threadIdx.x; d < dim; d += kNormThreads) {
    const T sum = from_float<T>(__fadd_rn(to_float(__ldg(x + row + d)), to_float(__ldg(delta + row + d))));
    sum_out[row + d] = sum;
    const float v = to_float(sum);
    squares += v * v;
  }
  const float inv = rms_scale(squares, dim, eps);
  for (int d = threadIdx.x; d < dim; d += kNormThreads) {
    const float normed = to_float(from_float<T>(to_float(sum_out[row + d]) * inv));
    out[row + d] = from_float<T>(to_float(__ldg(weight + d)) * normed);
  }
}

}  // namespace orin_vlm

#define ORIN_RMS_NORM_KERNELS(DT, T)                                                                            \
  extern "C" __global__ void __launch_bounds__(orin_vlm::kNormThreads)                                         \
      rms_norm_##DT(T* out, const T* x, const T* weight_a, const T* weight_b, int heads, int split, int dim,    \
                    int x_token_stride, float eps) {                                                           \
    orin_vlm::rms_norm<T, false>(out, x, weight_a, weight_b, nullptr, nullptr, heads, split, dim,              \
                                 x_token_stride, eps);                                                         \
  }                                                                                                            \
  extern "C" __global__ void __launch_bounds__(orin_vlm::kNormThreads)                                         \
      rms_norm_rope_##DT(T* out, const T* x, const T* weight_a, const T* weight_b, const T* cos,               \
                         const T* sin_signed, int heads, int split, int dim, int x_token_stride, float eps) {  \
    orin_vlm::rms_norm<T, true>(out, x, weight_a, weight_b, cos, sin_signed, heads, split, dim, x_token_stride, \
                                eps);                                                                          \
  }                                                                                                            \
  extern "C" __global__ void __launch_bounds__(orin_vlm::kNormThreads)                                         \
      add_rms_norm_##DT(T* sum_out, T* out, const T* x, const T* delta, const T* weight, int dim, float eps) {  \
    orin_vlm::add_rms_norm<T>(sum_out, out, x, delta, weight, dim, eps);                                       \
  }

ORIN_RMS_NORM_KERNELS(f32, float)
ORIN_RMS_NORM_KERNELS(f16, __half)
ORIN_RMS_NORM_KERNELS(bf16, __nv_bfloat16)
