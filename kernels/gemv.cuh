// GEMV / skinny GEMM for a decode step: y[m, n] = sum_k x[m, k] * w[n, k] for up to 8 rows of x.
//
// Why: a decode step multiplies one token per sequence (1..8 rows) by every weight matrix once, so its
// speed is the bytes of weights read per second; one kernel per product, summing each output in one fixed
// order whatever the row count (no split-K reduce as a second kernel). Reading INT8 or packed INT4 weights
// and widening them in registers reads 2x or ~3.8x fewer bytes than fp16. The quantized formats are those
// of orin_vlm_node/model/quant.py (QuantizedLinear), which is also the reference the tests hold these to:
//
//   float: weight [N, K] in the activation type (the checkpoint's weights as loaded)
//   int8: qweight [N, K] int8, scales [N] fp16:                 w[n, k] = q[n, k] * s[n]
//   int4: qweight [N, ceil(K/2)] uint8 (even k in the low nibble), scales and offsets [N, ceil(K/G)] fp16:
//         w[n, k] = q[n, k] * s[n, k/G] + o[n, k/G]
//
// One warp computes one output column n for every row m: the lanes walk row n of the weights in 16-byte
// vectors (float: 4 or 8 weights, int8: 16, int4: 32 per vector; a warp reads 512 contiguous bytes per
// vector, and each lane issues kGemvUnroll<W> vectors before it uses the first, so a row is requested at
// once), read the matching x elements (x is small and stays in cache), accumulate in fp32 and reduce across
// the warp. For int4 a vector lies inside one group when G is a multiple of 32, so its scale and offset
// factor out: sum_k x q s + x o = s * (x . q) + o * sum(x). The vector path needs K a multiple of 32 (every
// projection of the models we serve); any other shape takes the scalar path (same formulas, element by
// element).
//
// SwiGLU epilogue (the _swiglu kernels): the weight is the MLP's fused gate/up projection, 2N rows (the N
// gate rows, then the N up rows), and y[m, n] = silu(gate[m, n]) * up[m, n] with the rounding of the
// separate kernels (each sum rounded to the activation type as the product's output, then silu_mul.cu's
// arithmetic): one warp computes the gate column n and the up column n, so the activation costs no launch
// and the 2N-wide product never goes to memory.
//
// gemv_<float|int8|int4>[_swiglu]_<f32|f16|bf16>_r<R>: x, y (and float weights) in the activation type, R =
// the rows bucket (1, 2, 4, 8; rows <= R). Grid: (ceil(N / kGemvWarps)), N the output columns; block:
// kGemvWarps warps (launch.py: GEMV_WARPS). Every kernel takes the same arguments (y, x, weight, scales,
// offsets, rows, N, K, group); those a format has no use for are null / 0.
//
// This header holds the kernels; gemv.cu instantiates the plain products and gemv_swiglu.cu the SwiGLU
// ones: two modules, which nvcc compiles in parallel at a cold start (in one module sm_87 took 30 s, split
// 9.5 and 19.6 s).
#pragma once

#include "attention_common.cuh"

namespace orin_vlm {

constexpr int kGemvWarps = 4;
// 16-byte weight vectors each lane loads before it uses the first: one load in flight per lane leaves a
// GPU with HBM idle most of the time (a warp's row of a 2048-wide projection is 2..8 such loads, each
// waiting out the memory latency in turn). Enough to request the whole row of a 2048-wide projection at
// once: 4 for INT8 (2 KB) and INT4 (1 KB), 8 for 16-bit weights (4 KB; a fast GPU spends most of such a
// small product waiting, so a second round trip costs what the bytes do).
template <typename W>
constexpr int kGemvUnroll = sizeof(W) >= 2 ? 8 : 4;

// Vectors at byte offsets off, off + stride, ... (U of them) of a weight row, those below `end`; all loads
// are issued before any is used.
template <int U, typename W>
__device__ __forceinline__ void load_row_vectors(const W* __restrict__ row, int off, int stride, int end,
                                                 uint4* __restrict__ raw) {
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const int at = off + u * stride;
    raw[u] = at < end ? __ldg(reinterpret_cast<const uint4*>(row + at)) : make_uint4(0, 0, 0, 0);
  }
}

// Elements k0 .. k0+n-1 of row m of x, widened to fp32 (16-byte loads when `vec`, else one by one).
template <typename T, int N>
__device__ __forceinline__ void load_x(const T* __restrict__ x, size_t offset, bool vec, float* __restrict__ out) {
  if (vec) {
#pragma unroll
    for (int i = 0; i < N; i += Vec<T>::kElems) load_vec(x + offset + i, out + i);
  } else {
#pragma unroll
    for (int i = 0; i < N; ++i) out[i] = to_float(__ldg(x + offset + i));
  }
}

// Column n of y for each row m: the warp's partial sums of weight row n reduced (and, with SWIGLU, those of
// up row n + N: silu(gate) * up, each sum first rounded to T as the product's output).
template <typename T, int R, bool SWIGLU>
__device__ __forceinline__ void store_rows(T* __restrict__ y, const float* __restrict__ acc,
                                           const float* __restrict__ up, int rows, int n, int N) {
#pragma unroll
  for (int m = 0; m < R; ++m) {
    const float total = warp_sum(acc[m]);
    float value = total;
    if constexpr (SWIGLU) value = swiglu_value<T>(to_float(from_float<T>(total)), to_float(from_float<T>(warp_sum(up[m]))));
    if (m < rows && threadIdx.x % kWarpSize == 0) y[static_cast<size_t>(m) * N + n] = from_float<T>(value);
  }
}

__device__ __forceinline__ float widen(int8_t v) { return static_cast<float>(v); }
template <typename T>
__device__ __forceinline__ float widen(T v) {
  return to_float(v);
}

// Weights stored one element each (W: the activations' float type T, or int8 with a scale per output column,
// applied to the sum: `scale` 1 for float weights): the lane's part of row `row`'s products with each row of
// x, into acc[m]. Every 16-byte vector of the row is widened to fp32 once, then multiplied with each row of x.
template <typename T, typename W, int R>
__device__ __forceinline__ void dense_dot(const T* __restrict__ x, const W* __restrict__ row, float scale, int rows,
                                          int K, int lane, float* __restrict__ acc) {
#pragma unroll
  for (int m = 0; m < R; ++m) acc[m] = 0.0f;
  constexpr int kChunk = 16 / static_cast<int>(sizeof(W));  // weights per 16-byte vector
  const bool vec = K % 32 == 0;
  const int vec_end = vec ? K : 0;
  constexpr int kStride = kWarpSize * kChunk;  // weights a warp covers per vector load
  constexpr int kUnroll = kGemvUnroll<W>;
  for (int k0 = lane * kChunk; k0 < vec_end; k0 += kStride * kUnroll) {
    uint4 raw[kUnroll];
    load_row_vectors<kUnroll>(row, k0, kStride, vec_end, raw);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int k = k0 + u * kStride;
      if (k >= vec_end) break;
      const W* e = reinterpret_cast<const W*>(&raw[u]);
      float wf[kChunk];
#pragma unroll
      for (int i = 0; i < kChunk; ++i) wf[i] = widen(e[i]);
#pragma unroll
      for (int m = 0; m < R; ++m) {
        if (m >= rows) break;
        float xs[kChunk];
        load_x<T, kChunk>(x, static_cast<size_t>(m) * K + k, true, xs);
        float dot = 0.0f;
#pragma unroll
        for (int i = 0; i < kChunk; ++i) dot += xs[i] * wf[i];
        acc[m] += dot;
      }
    }
  }
  for (int k = vec_end + lane; k < K; k += kWarpSize) {  // the scalar path (K not a multiple of 32)
    const float wk = widen(__ldg(row + k));
#pragma unroll
    for (int m = 0; m < R; ++m)
      if (m < rows) acc[m] += to_float(__ldg(x + static_cast<size_t>(m) * K + k)) * wk;
  }
#pragma unroll
  for (int m = 0; m < R; ++m) acc[m] *= scale;
}

// L2 prefetch of this warp's weight row (and row n + N for SwiGLU), `row_bytes` each, a 128-byte line a lane
// a step. The kernels issue it between KERNEL_ALLOW_DEPENDENTS and KERNEL_WAIT_PREDECESSOR (compat.cuh): the
// weights, which no kernel writes, stream into L2 while the kernel before this one finishes, and the loads
// after the wait find them there. Empty before sm_90 and in the harness.
template <bool SWIGLU>
__device__ __forceinline__ void prefetch_weight_rows(const void* w, size_t row_bytes, int N) {
  const int n = blockIdx.x * kGemvWarps + threadIdx.x / kWarpSize;
  if (n >= N) return;
  const char* rows = static_cast<const char*>(w);
  for (size_t at = static_cast<size_t>(threadIdx.x % kWarpSize) * 128; at < row_bytes; at += kWarpSize * 128) {
    prefetch_l2(rows + static_cast<size_t>(n) * row_bytes + at);
    if constexpr (SWIGLU) prefetch_l2(rows + static_cast<size_t>(n + N) * row_bytes + at);
  }
}

// y = x w^T for dense weights (`scales` null for float weights), or its SwiGLU (weight rows n and n + N).
template <typename T, typename W, int R, bool SWIGLU>
__device__ __forceinline__ void gemv_dense(T* __restrict__ y, const T* __restrict__ x, const W* __restrict__ w,
                                           const __half* __restrict__ scales, int rows, int N, int K) {
  if (rows < 1 || rows > R || blockDim.x != kGemvWarps * kWarpSize) KERNEL_TRAP();
  const int lane = threadIdx.x % kWarpSize;
  const int n = blockIdx.x * kGemvWarps + threadIdx.x / kWarpSize;
  if (n >= N) return;  // a whole warp leaves together: the reductions below stay full-warp
  float acc[R], up[R];
  dense_dot<T, W, R>(x, w + static_cast<size_t>(n) * K, scales ? __half2float(__ldg(scales + n)) : 1.0f, rows, K,
                     lane, acc);
  if constexpr (SWIGLU) {
    const int u = n + N;
    dense_dot<T, W, R>(x, w + static_cast<size_t>(u) * K, scales ? __half2float(__ldg(scales + u)) : 1.0f, rows, K,
                       lane, up);
  }
  store_rows<T, R, SWIGLU>(y, acc, up, rows, n, N);
}

// Packed int4 weights: the lane's part of row n's products with each row of x, into acc[m].
template <typename T, int R>
__device__ __forceinline__ void int4_dot(const T* __restrict__ x, const uint8_t* __restrict__ q,
                                         const __half* __restrict__ scales, const __half* __restrict__ offsets,
                                         int n, int rows, int K, int group, int lane, float* __restrict__ acc) {
#pragma unroll
  for (int m = 0; m < R; ++m) acc[m] = 0.0f;
  const int row_bytes = (K + 1) / 2;
  const int groups = (K + group - 1) / group;
  const uint8_t* row = q + static_cast<size_t>(n) * row_bytes;
  const __half* s_row = scales + static_cast<size_t>(n) * groups;
  const __half* o_row = offsets + static_cast<size_t>(n) * groups;
  constexpr int kChunk = 32;  // int4 weights per 16-byte vector
  const bool vec = K % kChunk == 0 && group % kChunk == 0;
  const int vec_end = vec ? K : 0;
  constexpr int kStride = kWarpSize * kChunk;  // weights a warp covers per vector load
  constexpr int kUnroll = kGemvUnroll<uint8_t>;
  for (int k0 = lane * kChunk; k0 < vec_end; k0 += kStride * kUnroll) {
    uint4 raw[kUnroll];
    load_row_vectors<kUnroll>(row, k0 / 2, kStride / 2, vec_end / 2, raw);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int k = k0 + u * kStride;
      if (k >= vec_end) break;
      const uint8_t* bytes = reinterpret_cast<const uint8_t*>(&raw[u]);
      float w[kChunk];
#pragma unroll
      for (int i = 0; i < kChunk / 2; ++i) {
        w[2 * i] = static_cast<float>(bytes[i] & 0xF);
        w[2 * i + 1] = static_cast<float>(bytes[i] >> 4);
      }
      const float s = __half2float(__ldg(s_row + k / group));
      const float o = __half2float(__ldg(o_row + k / group));
#pragma unroll
      for (int m = 0; m < R; ++m) {
        if (m >= rows) break;
        float xs[kChunk];
        load_x<T, kChunk>(x, static_cast<size_t>(m) * K + k, true, xs);
        float dot = 0.0f, sum = 0.0f;
#pragma unroll
        for (int i = 0; i < kChunk; ++i) {
          dot += xs[i] * w[i];
          sum += xs[i];
        }
        acc[m] += s * dot + o * sum;
      }
    }
  }
  for (int k = vec_end + lane; k < K; k += kWarpSize) {  // the scalar path
    const uint8_t byte = __ldg(row + k / 2);
    const float qk = static_cast<float>(k % 2 ? byte >> 4 : byte & 0xF);
    const float w = qk * __half2float(__ldg(s_row + k / group)) + __half2float(__ldg(o_row + k / group));
#pragma unroll
    for (int m = 0; m < R; ++m)
      if (m < rows) acc[m] += to_float(__ldg(x + static_cast<size_t>(m) * K + k)) * w;
  }
}

// y = x w^T for packed int4 weights, or its SwiGLU (weight rows n and n + N).
template <typename T, int R, bool SWIGLU>
__device__ __forceinline__ void gemv_int4(T* __restrict__ y, const T* __restrict__ x, const uint8_t* __restrict__ q,
                                          const __half* __restrict__ scales, const __half* __restrict__ offsets,
                                          int rows, int N, int K, int group) {
  if (rows < 1 || rows > R || group < 1 || blockDim.x != kGemvWarps * kWarpSize) KERNEL_TRAP();
  const int lane = threadIdx.x % kWarpSize;
  const int n = blockIdx.x * kGemvWarps + threadIdx.x / kWarpSize;
  if (n >= N) return;
  float acc[R], up[R];
  int4_dot<T, R>(x, q, scales, offsets, n, rows, K, group, lane, acc);
  if constexpr (SWIGLU) int4_dot<T, R>(x, q, scales, offsets, n + N, rows, K, group, lane, up);
  store_rows<T, R, SWIGLU>(y, acc, up, rows, n, N);
}

}  // namespace orin_vlm

// A GEMV kernel's KERNEL_PROLOGUE, with its weight rows (`row_bytes` each, `columns` outputs, and their up
// rows for SwiGLU) prefetched into L2 between the two halves (prefetch_weight_rows).
#define ORIN_GEMV_PROLOGUE(SWIGLU, weights, row_bytes, columns)                \
  KERNEL_ALLOW_DEPENDENTS();                                                   \
  orin_vlm::prefetch_weight_rows<SWIGLU>((weights), (row_bytes), (columns));   \
  KERNEL_WAIT_PREDECESSOR()

#define ORIN_GEMV_KERNELS_E(DT, T, R, E, SWIGLU)                                                                     \
  extern "C" __global__ void gemv_float##E##_##DT##_r##R(T* y, const T* x, const T* weight, const __half* scales,      \
                                                        const __half* offsets, int rows, int n, int k, int group) {    \
    ORIN_GEMV_PROLOGUE(SWIGLU, weight, static_cast<size_t>(k) * sizeof(T), n);                                         \
    orin_vlm::gemv_dense<T, T, R, SWIGLU>(y, x, weight, nullptr, rows, n, k);                                          \
  }                                                                                                                    \
  extern "C" __global__ void gemv_int8##E##_##DT##_r##R(T* y, const T* x, const int8_t* qweight,                       \
                                                       const __half* scales, const __half* offsets, int rows, int n,   \
                                                       int k, int group) {                                             \
    ORIN_GEMV_PROLOGUE(SWIGLU, qweight, static_cast<size_t>(k), n);                                                    \
    orin_vlm::gemv_dense<T, int8_t, R, SWIGLU>(y, x, qweight, scales, rows, n, k);                                     \
  }                                                                                                                    \
  extern "C" __global__ void gemv_int4##E##_##DT##_r##R(T* y, const T* x, const uint8_t* qweight,                      \
                                                       const __half* scales, const __half* offsets, int rows, int n,   \
                                                       int k, int group) {                                             \
    ORIN_GEMV_PROLOGUE(SWIGLU, qweight, static_cast<size_t>(k + 1) / 2, n);                                            \
    orin_vlm::gemv_int4<T, R, SWIGLU>(y, x, qweight, scales, offsets, rows, n, k, group);                              \
  }

// The kernels of one epilogue (E: empty or _swiglu) for every rows bucket and activation type.
#define ORIN_GEMV_KERNELS(E, SWIGLU)                  \
  ORIN_GEMV_KERNELS_E(f32, float, 1, E, SWIGLU)        \
  ORIN_GEMV_KERNELS_E(f32, float, 2, E, SWIGLU)        \
  ORIN_GEMV_KERNELS_E(f32, float, 4, E, SWIGLU)        \
  ORIN_GEMV_KERNELS_E(f32, float, 8, E, SWIGLU)        \
  ORIN_GEMV_KERNELS_E(f16, __half, 1, E, SWIGLU)       \
  ORIN_GEMV_KERNELS_E(f16, __half, 2, E, SWIGLU)       \
  ORIN_GEMV_KERNELS_E(f16, __half, 4, E, SWIGLU)       \
  ORIN_GEMV_KERNELS_E(f16, __half, 8, E, SWIGLU)       \
  ORIN_GEMV_KERNELS_E(bf16, __nv_bfloat16, 1, E, SWIGLU) \
  ORIN_GEMV_KERNELS_E(bf16, __nv_bfloat16, 2, E, SWIGLU) \
  ORIN_GEMV_KERNELS_E(bf16, __nv_bfloat16, 4, E, SWIGLU) \
  ORIN_GEMV_KERNELS_E(bf16, __nv_bfloat16, 8, E, SWIGLU)
