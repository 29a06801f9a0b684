// The q/k norm of one attention head followed by RoPE, by one block: the rms_norm_rope kernel's head
// (rms_norm.cu, a head a block). Also the step's KV sink: where the rotated keys and the values of a static
// decode step go.
//
// The arithmetic is torch's, rounding where torch's separate ops round: x widened to fp32, mean of squares
// as sum * (1 / dim), x * rsqrt(mean + eps) rounded to the storage type, the weight product rounded (Qwen3's
// RMSNorm multiplies by its weight after casting back), then y = x * cos + swap_halves(x) * sin_signed with
// the token's rows of the two tables (the storage type, sin_signed = [-sin, sin] of the halves), each product
// and the sum rounded on its own and never contracted into a fused multiply-add. The head is read with __ldcg
// (through L2, not the read-only cache).
#pragma once

#include "add_rms_norm.cuh"

namespace orin_vlm {

constexpr int kMaxRopeDim = 256;

// The rotated rows (head rows of at most kMaxRopeDim, so at most kRopeSlots elements a thread) load x, the
// weight and both tables at once before the first use: at batch 1 these are a few dozen blocks, and their
// memory round trips are their cost.
constexpr int kRopeSlots = kMaxRopeDim / kNormThreads;

// Where the rotated k heads and the v heads of a static decode step go: the paged pools, [blocks, page_size,
// kv_heads, dim], a token's row at slot * kv_heads * dim; a negative slot (a padding row of a batch) stores
// nothing.
template <typename T>
struct KVSink {
  T* k_pool;                   // null: no sink
  T* v_pool;
  const T* v;                  // the step's v heads, [tokens, kv_heads, dim] rows at v_token_stride
  const long long* slots;      // [tokens]
  int v_token_stride;
};

// Where kv head `head` of a token at `slot` lies in a pool (see KVSink).
template <typename T>
__device__ __forceinline__ T* pool_row(T* pool, long long slot, int kv_heads, int head, int dim) {
  return pool + (static_cast<size_t>(slot) * kv_heads + head) * dim;
}

// A v head's row `src` (dim elements, read through L2) to `dst`, by every thread of the block.
template <typename T>
__device__ __forceinline__ void copy_head(T* __restrict__ dst, const T* __restrict__ src, int dim) {
  for (int d = threadIdx.x; d < dim; d += kNormThreads) dst[d] = __ldcg(src + d);
}

// One head's row `x` (dim elements, even, <= kMaxRopeDim) normalised with `weight`, rotated with the token's
// rows `cos` and `sin_signed`, into `out` and, when `k_row` is not null (a key stored in its slot), there too.
// Every thread of a block of kNormThreads calls it.
template <typename T>
__device__ __forceinline__ void norm_rope_row(T* __restrict__ out, const T* __restrict__ x, const T* __restrict__ weight,
                                              const T* __restrict__ cos, const T* __restrict__ sin_signed,
                                              T* __restrict__ k_row, int dim, float eps) {
  if (dim > kMaxRopeDim || dim % 2 != 0) KERNEL_TRAP();
  float xv[kRopeSlots], wv[kRopeSlots], cv[kRopeSlots], sv[kRopeSlots];
  float squares = 0.0f;
#pragma unroll
  for (int i = 0; i < kRopeSlots; ++i) {
    const int d = static_cast<int>(threadIdx.x) + i * kNormThreads;
    const bool in = d < dim;
    xv[i] = in ? to_float(__ldcg(x + d)) : 0.0f;
    wv[i] = in ? to_float(__ldg(weight + d)) : 0.0f;
    cv[i] = in ? to_float(__ldg(cos + d)) : 0.0f;
    sv[i] = in ? to_float(__ldg(sin_signed + d)) : 0.0f;
    squares += xv[i] * xv[i];
  }
  const float inv = rms_scale(squares, dim, eps);
  __shared__ float normed_row[kMaxRopeDim];  // the weighted row, as rounded to T: RoPE pairs d with d +- dim/2
#pragma unroll
  for (int i = 0; i < kRopeSlots; ++i) {
    const int d = static_cast<int>(threadIdx.x) + i * kNormThreads;
    if (d < dim) normed_row[d] = to_float(from_float<T>(wv[i] * to_float(from_float<T>(xv[i] * inv))));
  }
  __syncthreads();
  const int half = dim / 2;
#pragma unroll
  for (int i = 0; i < kRopeSlots; ++i) {
    const int d = static_cast<int>(threadIdx.x) + i * kNormThreads;
    if (d >= dim) continue;
    const float a = to_float(from_float<T>(__fmul_rn(normed_row[d], cv[i])));
    const float b = to_float(from_float<T>(__fmul_rn(normed_row[d < half ? d + half : d - half], sv[i])));
    const T rotated = from_float<T>(__fadd_rn(a, b));
    out[d] = rotated;
    if (k_row != nullptr) k_row[d] = rotated;
  }
  __syncthreads();  // normed_row is free again when it returns
}

}  // namespace orin_vlm
