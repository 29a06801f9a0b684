// The residual add before an RMSNorm and the norm, one row by one block of kNormThreads threads: the
// add_rms_norm kernel's row (rms_norm.cu, a row a block).
//
// sum = x + delta rounded to the storage type (torch's add), written to sum_out; out = weight * cast(sum *
// rsqrt(mean(sum^2) + eps)), the product with the weight after the cast back and rounded again (Qwen3's
// RMSNorm), the mean as sum * (1 / dim). delta is read with __ldcg (through L2, not the read-only cache).
#pragma once

#include "attention_common.cuh"

namespace orin_vlm {

constexpr int kNormThreads = 128;

// 1 / sqrt(mean of squares + eps) of a row whose squares each thread of the block summed in part. Every
// thread of the block calls it; the shared buffer is free again when it returns.
__device__ __forceinline__ float rms_scale(float squares, int dim, float eps) {
  __shared__ float warp_sums[kNormThreads / kWarpSize];
  squares = warp_sum(squares);
  if (threadIdx.x % kWarpSize == 0) warp_sums[threadIdx.x / kWarpSize] = squares;
  __syncthreads();
  float total = 0.0f;
#pragma unroll
  for (int i = 0; i < kNormThreads / kWarpSize; ++i) total += warp_sums[i];
  __syncthreads();
  return rsqrtf(total * (1.0f / static_cast<float>(dim)) + eps);
}

// 16-byte vectors of a row each thread of the vector path holds: the whole row stays in registers, rows of
// up to kNormThreads * kNormVecs * Vec<T>::kElems elements (4096 in fp16/bf16, 2048 in fp32).
constexpr int kNormVecs = 4;

__device__ __forceinline__ bool aligned16(const void* p) { return reinterpret_cast<size_t>(p) % 16 == 0; }

// One row (pointers at the row) that fits the registers: every load of x, delta and the weight is issued
// before the first is used, so a row costs one memory round trip, not one per loop step (at batch 1 the
// kernel is a single block, and its latency is the whole cost).
template <typename T>
__device__ __forceinline__ void add_rms_norm_vec(T* __restrict__ sum_out, T* __restrict__ out, const T* __restrict__ x,
                                                 const T* __restrict__ delta, const T* __restrict__ weight, int dim,
                                                 float eps) {
  constexpr int kElems = Vec<T>::kElems;
  uint4 xr[kNormVecs], dr[kNormVecs], wr[kNormVecs];
#pragma unroll
  for (int v = 0; v < kNormVecs; ++v) {
    const int d = (v * kNormThreads + static_cast<int>(threadIdx.x)) * kElems;
    const bool in = d < dim;
    xr[v] = in ? __ldg(reinterpret_cast<const uint4*>(x + d)) : make_uint4(0, 0, 0, 0);
    dr[v] = in ? __ldcg(reinterpret_cast<const uint4*>(delta + d)) : make_uint4(0, 0, 0, 0);
    wr[v] = in ? __ldg(reinterpret_cast<const uint4*>(weight + d)) : make_uint4(0, 0, 0, 0);
  }
  uint4 sums[kNormVecs];  // the sums as stored (T): half the registers of their widening in fp16 / bf16
  float squares = 0.0f;
#pragma unroll
  for (int v = 0; v < kNormVecs; ++v) {
    const int d = (v * kNormThreads + static_cast<int>(threadIdx.x)) * kElems;
    const T* xe = reinterpret_cast<const T*>(&xr[v]);
    const T* de = reinterpret_cast<const T*>(&dr[v]);
    T* pe = reinterpret_cast<T*>(&sums[v]);
#pragma unroll
    for (int i = 0; i < kElems; ++i) {
      pe[i] = from_float<T>(__fadd_rn(to_float(xe[i]), to_float(de[i])));
      const float sum = to_float(pe[i]);
      squares += sum * sum;  // 0 past the row's end
    }
    if (d < dim) *reinterpret_cast<uint4*>(sum_out + d) = sums[v];
  }
  const float inv = rms_scale(squares, dim, eps);
#pragma unroll
  for (int v = 0; v < kNormVecs; ++v) {
    const int d = (v * kNormThreads + static_cast<int>(threadIdx.x)) * kElems;
    const T* we = reinterpret_cast<const T*>(&wr[v]);
    uint4 packed;
    T* pe = reinterpret_cast<T*>(&packed);
#pragma unroll
    for (int i = 0; i < kElems; ++i) {
      const float normed = to_float(from_float<T>(raw_elem<T>(sums[v], i) * inv));
      pe[i] = from_float<T>(to_float(we[i]) * normed);
    }
    if (d < dim) *reinterpret_cast<uint4*>(out + d) = packed;
  }
}

// One row of `dim` elements (pointers at the row), by every thread of a block of kNormThreads. A row that
// fits the registers in 16-byte vectors takes add_rms_norm_vec; any other (longer, or not 16-byte aligned)
// the loop below, where each thread reads back only the sums it wrote itself.
template <typename T>
__device__ __forceinline__ void add_rms_norm_row(T* __restrict__ sum_out, T* __restrict__ out, const T* __restrict__ x,
                                                 const T* __restrict__ delta, const T* __restrict__ weight, int dim,
                                                 float eps) {
  constexpr int kElems = Vec<T>::kElems;
  if (dim % kElems == 0 && dim <= kNormThreads * kNormVecs * kElems && aligned16(x) && aligned16(delta) &&
      aligned16(weight) && aligned16(sum_out) && aligned16(out)) {
    add_rms_norm_vec<T>(sum_out, out, x, delta, weight, dim, eps);
    return;
  }
  float squares = 0.0f;
  for (int d = threadIdx.x; d < dim; d += kNormThreads) {
    const T sum = from_float<T>(__fadd_rn(to_float(__ldg(x + d)), to_float(__ldcg(delta + d))));
    sum_out[d] = sum;
    const float v = to_float(sum);
    squares += v * v;
  }
  const float inv = rms_scale(squares, dim, eps);
  for (int d = threadIdx.x; d < dim; d += kNormThreads) {
    const float normed = to_float(from_float<T>(to_float(sum_out[d]) * inv));
    out[d] = from_float<T>(to_float(__ldg(weight + d)) * normed);
  }
}

}  // namespace orin_vlm
