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
// One warp computes kGemvColumns output columns for every row m (1 for float weights, 2 for int8, 4 for int4
// or 2 with SwiGLU), and with the SwiGLU epilogue the up column of each too: those J weight rows are read in
// one pass.
// The lanes walk the rows in 16-byte vectors (float: 4 or 8 weights, int8: 16, int4: 32 per vector; a warp
// reads 512 contiguous bytes of a row per vector, and each lane issues kGemvInFlight vectors before it uses
// the first, so a row is requested at once), accumulate in fp32 and reduce across the warp. Each piece of
// x is read and widened once for the J rows, and each weight widened once for the R rows of x: on a
// quantized weight the arithmetic per weight, not the bytes, bounds the product (see int4_subnormal). For
// int4 a vector lies inside one group when G is a multiple of 32, so its scale and offset factor out:
// sum_k x q s + x o = s * (x . q) + o * sum(x). The vector path needs K a multiple of 32 (every
// projection of the models we serve); any other shape takes the scalar path (same formulas, element by
// element).
//
// SwiGLU epilogue (the _swiglu kernels): the weight is the MLP's fused gate/up projection, 2N rows (the N
// gate rows, then the N up rows), and y[m, n] = silu(gate[m, n]) * up[m, n] with the rounding of the
// separate kernels (each sum rounded to the activation type as the product's output, then silu_mul.cu's
// arithmetic): one warp computes gate column n and up column n, so the activation costs no launch and the
// 2N-wide product never goes to memory.
//
// gemv_<float|int8|int4>[_swiglu]_<f32|f16|bf16>_r<R>: x, y (and float weights) in the activation type, R =
// the rows bucket (1, 2, 4, 8; rows <= R). Grid: (ceil(N / (kGemvWarps / slices * kGemvColumns))), N the output
// columns, `slices` warps of a block sharing columns on long rows (gemv_slices); block: kGemvWarps warps
// (launch.py: GEMV_WARPS, GEMV_COLUMNS, gemv_slices). Every kernel takes the same arguments (y, x, weight,
// scales, offsets, rows, N, K, group); those a format has no use for are null / 0.
//
// This header holds the kernels; gemv.cu instantiates the plain products and gemv_swiglu.cu the SwiGLU ones:
// two modules, which nvcc compiles in parallel at a cold start (in one module sm_87 took 30 s, split 9.5 and
// 19.6 s; since the SwiGLU kernels read gate and up in one pass, about 11 s each).
#pragma once

#include "attention_common.cuh"

namespace orin_vlm {

constexpr int kGemvWarps = 4;
// Output columns one warp computes. A quantized weight costs more arithmetic per byte than a float one (the
// widening), so there a warp reads several weight rows and widens (and for int4 scales and sums) each piece
// of x once for all of them: int8 two columns; int4, whose bytes hold twice the weights, four rows (four
// columns, or two with their up rows for SwiGLU). Float weights keep one column a warp (more warps in
// flight for the same bytes). launch.py: GEMV_COLUMNS.
template <typename W, bool SWIGLU>
constexpr int kGemvColumns = sizeof(W) >= 2 ? 1 : 2;
template <bool SWIGLU>
constexpr int kGemvColumns<uint8_t, SWIGLU> = SWIGLU ? 2 : 4;  // int4
// 16-byte weight vectors each lane loads before it uses the first, over the J rows it reads: one load in
// flight per lane leaves a GPU with HBM idle most of the time (a warp's row of a 2048-wide projection is
// 2..8 such loads, each waiting out the memory latency in turn). 8 requests a whole 4 KB row of a
// 2048-wide fp16 projection, or two 2 KB int8 rows, at once.
constexpr int kGemvInFlight = 8;
// Weights in one 16-byte vector of a row stored as W (uint8_t: two int4 weights a byte).
template <typename W>
constexpr int kGemvChunk = 16 / static_cast<int>(sizeof(W));
template <>
constexpr int kGemvChunk<uint8_t> = 32;  // int4
// Vectors of each of its J rows a lane loads before it uses the first.
template <int J>
constexpr int kGemvUnroll = kGemvInFlight / J > 0 ? kGemvInFlight / J : 1;

// Warps of a block that share its columns, each summing a slice of K (1, 2 or kGemvWarps): as many as a warp's
// pass over a row takes steps (a step: the vectors a lane has in flight, the kGemvUnroll of each row), up to the
// block's warps. A product with few output columns and long rows (a layer's down product: 2048 columns, 6144
// long; with int4 weights 128 blocks of 4 warps on 132 SMs) would otherwise leave an SM a few warps, each
// waiting out its steps' memory round trips one after another; with slices it has as many more warps, each
// with fewer steps. The slices' sums are added in warp order through shared memory, and the count depends
// on the shape alone, so every rows bucket still sums an output in one order. launch.py: gemv_slices.
template <typename W, bool SWIGLU>
__device__ __forceinline__ int gemv_slices(int K) {
  constexpr int kStep = kWarpSize * kGemvChunk<W> * kGemvUnroll<kGemvColumns<W, SWIGLU> * (SWIGLU ? 2 : 1)>;
  const int steps = (K + kStep - 1) / kStep;
  return steps <= 1 ? 1 : steps == 2 ? 2 : kGemvWarps;
}
// Weights widened at a time (from one or two 32-bit words, or one 16-byte vector of 16-bit weights) and
// matched with the same piece of each row of x; fp32 weights: their vector of 4.
template <typename W>
constexpr int kGemvPiece = sizeof(W) == 4 ? 4 : 8;

// Small integers widened to fp32 exactly without a conversion instruction: on sm_80 and sm_90 an integer ->
// float conversion (I2F) issues at 16 a clock per SM, an eighth of the rate of an add, and one per weight
// bounded the int8 / int4 products far below the memory's rate. Instead a byte permute places a byte
// b (0..255) under the exponent of 2^23, which makes the float 2^23 + b exactly, and an add takes the 2^23
// away: two full-rate instructions, the same value to the last bit.
constexpr uint32_t kExponent2p23 = 0x4B000000u;  // the bits of 2^23 as a float
constexpr float k2p23 = 8388608.0f;

// Byte B of `word` (an unsigned value 0..255) plus 2^23, as a float.
template <int B>
__device__ __forceinline__ float byte_over_2p23(uint32_t word) {
  return __uint_as_float(__byte_perm(word, kExponent2p23, 0x7440 | B));
}

// The four int8 weights of `word` (element i in byte i), exactly, into w[0..3]: flipping each sign bit
// makes byte i q + 128 (two's complement), so the float is 2^23 + 128 + q.
__device__ __forceinline__ void widen_int8x4(uint32_t word, float* __restrict__ w) {
  const uint32_t biased = word ^ 0x80808080u;
  w[0] = byte_over_2p23<0>(biased) - (k2p23 + 128.0f);
  w[1] = byte_over_2p23<1>(biased) - (k2p23 + 128.0f);
  w[2] = byte_over_2p23<2>(biased) - (k2p23 + 128.0f);
  w[3] = byte_over_2p23<3>(biased) - (k2p23 + 128.0f);
}

// Int4 weights take one instruction each: the float whose bits are a small integer b (a subnormal) is
// exactly b * 2^-149, so byte i of `word & 0x0F0F0F0F` alone in a register is weight 2i times 2^-149 and
// byte i of `word & 0xF0F0F0F0` is weight 2i + 1 times 2^-145 (the nibble sits 4 bits up). The x they
// multiply is scaled to match (Int4Rows::prepare_x: even elements by 2^64, odd ones by 2^60), so every
// product is x * q * 2^-85 exactly and a vector's dot product is 2^-85 times the unscaled one, each fused
// multiply-add rounding as it would unscaled; the scale times 2^85 (Int4Rows::vector_scale) takes the factor
// away. Exact while each nonzero |x| lies in [2^-41, 2^64), as every fp16 activation does (2^-24 ..
// 65504); a smaller bf16 or fp32 one makes a subnormal product (an error below 2^-65), a larger one
// overflows.
constexpr float kInt4EvenX = 0x1p64f, kInt4OddX = 0x1p60f, kInt4DotScale = 0x1p85f;

// Weight 2i (EVEN) or 2i + 1 of the int4 `word` (element 2i in the low nibble of byte i, 2i + 1 in the
// high one), as the subnormal float above: `masked` is the word & 0x0F0F0F0F or & 0xF0F0F0F0.
template <int I>
__device__ __forceinline__ float int4_subnormal(uint32_t masked) {
  return __uint_as_float(__byte_perm(masked, 0u, 0x4440 | I));
}

// How weight rows are stored. Every format offers: Elem (the stored element: the activation type, int8_t, or
// uint8_t for two packed int4 weights), kChunk (weights per 16-byte vector), kGrouped (a scale and an
// offset per group of each row), row(n) (the row's first element), row_bytes() (a row's length in bytes),
// at(k) (the element offset of weight k's vector), vector_path(K) (whether the 16-byte vectors cover the
// rows), widen<P>(raw, piece, w) (weights piece * P .. piece * P + P - 1 of a vector, exactly, or for int4
// exactly up to a power of two), prepare_x<P>(xs) (the x those weights multiply, scaled to match: int4 only),
// and scalar(n, k) (one weight, for the scalar path). Int4 rows also offer vector_scale(n, k) (the group's scale for a vector's
// dot product of prepared x with widened weights) and offset(n, k).
template <typename W>
struct DenseRows {
  using Elem = W;
  static constexpr int kChunk = 16 / static_cast<int>(sizeof(W));
  static constexpr bool kGrouped = false;
  const W* w;
  int K;
  __device__ __forceinline__ bool vector_path() const { return K % 32 == 0; }
  __device__ __forceinline__ const W* row(int n) const { return w + static_cast<size_t>(n) * K; }
  __device__ __forceinline__ size_t row_bytes() const { return static_cast<size_t>(K) * sizeof(W); }
  __device__ __forceinline__ static int at(int k) { return k; }
  template <int P>
  __device__ __forceinline__ static void prepare_x(float* __restrict__) {}
  template <int P>
  __device__ __forceinline__ static void widen(const uint4& raw, int piece, float* __restrict__ out) {
    if constexpr (sizeof(W) == 1) {
      const uint32_t* words = reinterpret_cast<const uint32_t*>(&raw);
      widen_int8x4(words[2 * piece], out);
      widen_int8x4(words[2 * piece + 1], out + 4);
    } else {
#pragma unroll
      for (int i = 0; i < P; ++i) out[i] = raw_elem<W>(raw, piece * P + i);
    }
  }
  __device__ __forceinline__ float scalar(int n, int k) const {
    if constexpr (sizeof(W) == 1) return static_cast<float>(__ldg(row(n) + k));
    else return to_float(__ldg(row(n) + k));
  }
};

struct Int4Rows {
  using Elem = uint8_t;
  static constexpr int kChunk = 32;
  static constexpr bool kGrouped = true;
  const uint8_t* q;
  const __half* scales;
  const __half* offsets;
  int K, groups, group_shift;  // group_shift: log2 of the group size (a power of two)
  __device__ __forceinline__ const uint8_t* row(int n) const { return q + static_cast<size_t>(n) * row_bytes(); }
  __device__ __forceinline__ size_t row_bytes() const { return static_cast<size_t>((K + 1) / 2); }
  __device__ __forceinline__ static int at(int k) { return k / 2; }
  // A vector lies inside one group when the group holds whole vectors.
  __device__ __forceinline__ bool vector_path() const { return K % 32 == 0 && group_shift >= 5; }
  // Weights piece * 8 .. piece * 8 + 7 of a vector, as the subnormals of int4_subnormal.
  template <int P>
  __device__ __forceinline__ static void widen(const uint4& raw, int piece, float* __restrict__ out) {
    const uint32_t word = reinterpret_cast<const uint32_t*>(&raw)[piece];
    const uint32_t even = word & 0x0F0F0F0Fu, odd = word & 0xF0F0F0F0u;
    out[0] = int4_subnormal<0>(even);
    out[1] = int4_subnormal<0>(odd);
    out[2] = int4_subnormal<1>(even);
    out[3] = int4_subnormal<1>(odd);
    out[4] = int4_subnormal<2>(even);
    out[5] = int4_subnormal<2>(odd);
    out[6] = int4_subnormal<3>(even);
    out[7] = int4_subnormal<3>(odd);
  }
  // x elements k .. k + P - 1 (k even) scaled as the widened weights they multiply need.
  template <int P>
  __device__ __forceinline__ static void prepare_x(float* __restrict__ xs) {
#pragma unroll
    for (int i = 0; i < P; ++i) xs[i] *= i % 2 ? kInt4OddX : kInt4EvenX;
  }
  __device__ __forceinline__ float scale(int n, int k) const {
    return __half2float(__ldg(scales + static_cast<size_t>(n) * groups + (k >> group_shift)));
  }
  // The scale of weight k's group for a vector's dot product of prepared x with widened weights (2^85 times
  // the scale: see int4_subnormal).
  __device__ __forceinline__ float vector_scale(int n, int k) const { return scale(n, k) * kInt4DotScale; }
  __device__ __forceinline__ float offset(int n, int k) const {
    return __half2float(__ldg(offsets + static_cast<size_t>(n) * groups + (k >> group_shift)));
  }
  __device__ __forceinline__ float scalar(int n, int k) const {
    const uint8_t byte = __ldg(row(n) + k / 2);
    return static_cast<float>(k % 2 ? byte >> 4 : byte & 0xF) * scale(n, k) + offset(n, k);
  }
};

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

// The lane's part of the products of weight rows n[0..J) with each row of x, into acc[j][m]: one pass over
// K for all J rows. Int4 rows sum each vector's products apart (dot), then scale them and add the offset
// times the vector's sum of x; dense rows sum into acc directly (an int8 row's scale is applied by the
// caller, to the total).
template <typename T, typename Rows, int R, int J>
__device__ __forceinline__ void rows_dot(const T* __restrict__ x, const Rows& w, const int* n, int rows, int K,
                                         int lane, int slice, int slices, float (&acc)[J][R]) {
  using W = typename Rows::Elem;
  constexpr bool kGrouped = Rows::kGrouped;
  constexpr int kChunk = Rows::kChunk;
  static_assert(kChunk == kGemvChunk<W>, "gemv_slices counts a row's vectors as the format stores them");
  constexpr int kPiece = kGemvPiece<W>;
  constexpr int kStride = kWarpSize * kChunk;  // weights a warp covers per vector load
  constexpr int kUnroll = kGemvUnroll<J>;
  const int stride = kStride * slices;  // this slice's vectors: every slices-th of the row, from the slice-th
#pragma unroll
  for (int j = 0; j < J; ++j)
#pragma unroll
    for (int m = 0; m < R; ++m) acc[j][m] = 0.0f;
  const W* row[J];
#pragma unroll
  for (int j = 0; j < J; ++j) row[j] = w.row(n[j]);
  const int vec_end = w.vector_path() ? K : 0;
  for (int k0 = lane * kChunk + slice * kStride; k0 < vec_end; k0 += stride * kUnroll) {
    uint4 raw[J][kUnroll];
#pragma unroll
    for (int j = 0; j < J; ++j)
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int k = k0 + u * stride;
        raw[j][u] = k < vec_end ? __ldg(reinterpret_cast<const uint4*>(row[j] + Rows::at(k))) : make_uint4(0, 0, 0, 0);
      }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int k = k0 + u * stride;
      if (k >= vec_end) break;
      float dot[J][R], xsum[R];
#pragma unroll
      for (int m = 0; m < R; ++m) {
        xsum[m] = 0.0f;
#pragma unroll
        for (int j = 0; j < J; ++j) dot[j][m] = 0.0f;
      }
#pragma unroll
      for (int p = 0; p < kChunk / kPiece; ++p) {
        float wf[J][kPiece];
#pragma unroll
        for (int j = 0; j < J; ++j) Rows::template widen<kPiece>(raw[j][u], p, wf[j]);
#pragma unroll
        for (int m = 0; m < R; ++m) {
          if (m >= rows) break;
          float xs[kPiece];
          load_x<T, kPiece>(x, static_cast<size_t>(m) * K + k + p * kPiece, true, xs);
          if constexpr (kGrouped)
#pragma unroll
            for (int i = 0; i < kPiece; ++i) xsum[m] += xs[i];
          Rows::template prepare_x<kPiece>(xs);
#pragma unroll
          for (int i = 0; i < kPiece; ++i) {
#pragma unroll
            for (int j = 0; j < J; ++j) {
              if constexpr (kGrouped) dot[j][m] += xs[i] * wf[j][i];
              else acc[j][m] += xs[i] * wf[j][i];
            }
          }
        }
      }
      if constexpr (kGrouped) {
#pragma unroll
        for (int j = 0; j < J; ++j) {
          const float s = w.vector_scale(n[j], k), o = w.offset(n[j], k);
#pragma unroll
          for (int m = 0; m < R; ++m) acc[j][m] += s * dot[j][m] + o * xsum[m];
        }
      }
    }
  }
  for (int k = vec_end + lane + slice * kWarpSize; k < K; k += kWarpSize * slices) {  // the scalar path
#pragma unroll
    for (int j = 0; j < J; ++j) {
      const float wk = w.scalar(n[j], k);
#pragma unroll
      for (int m = 0; m < R; ++m)
        if (m < rows) acc[j][m] += to_float(__ldg(x + static_cast<size_t>(m) * K + k)) * wk;
    }
  }
}

// The weight rows a warp reads: its columns c (rows n0 + c, the last valid column standing in for those past
// N, whose results are not stored) and, with SwiGLU, their up rows (+ N).
template <int C, bool SWIGLU>
__device__ __forceinline__ void warp_rows(int n0, int N, int* n) {
#pragma unroll
  for (int c = 0; c < C; ++c) {
    n[c] = min(n0 + c, N - 1);
    if constexpr (SWIGLU) n[C + c] = n[c] + N;
  }
}

// The first output column of this warp in block `tile` (the product's blocks a kGemvWarps / slices * C columns
// each); `slices` adjacent warps share their columns (gemv_slices).
template <int C>
__device__ __forceinline__ int warp_first_column(int tile, int slices) {
  return (tile * (kGemvWarps / slices) + static_cast<int>(threadIdx.x) / kWarpSize / slices) * C;
}

// Output columns of a block of kGemvWarps warps, `slices` of them sharing C columns.
template <int C>
__device__ __forceinline__ int block_columns(int slices) {
  return kGemvWarps / slices * C;
}

// Blocks for N output columns (launch.py: gemv_launch's grid).
template <int C>
__device__ __forceinline__ int gemv_tiles(int N, int slices) {
  return (N + block_columns<C>(slices) - 1) / block_columns<C>(slices);
}

// Column n0 + c of row m of y from its sums (with SWIGLU: silu(gate) * up, each sum first rounded to T as the
// product's output).
template <typename T, bool SWIGLU>
__device__ __forceinline__ void store_column(T* __restrict__ y, float gate, float up, int m, int column, int N) {
  float value = gate;
  if constexpr (SWIGLU) value = swiglu_value<T>(to_float(from_float<T>(gate)), to_float(from_float<T>(up)));
  y[static_cast<size_t>(m) * N + column] = from_float<T>(value);
}

// Columns n0 .. n0 + C - 1 of y (those below N) for each row m: the warp's partial sums reduced (and, with
// SWIGLU, those of the up rows). With slices, every warp of the block calls it (it holds a barrier): each
// warp's sums go to shared memory and the first warp of the columns' slices adds them in warp order; a warp
// past N (`active` false) brings zeros.
template <typename T, int R, int C, bool SWIGLU>
__device__ __forceinline__ void store_columns(T* __restrict__ y, const float (&acc)[C * (SWIGLU ? 2 : 1)][R],
                                              int rows, int n0, int N, int slices, bool active) {
  constexpr int J = C * (SWIGLU ? 2 : 1);
  const int lane = static_cast<int>(threadIdx.x) % kWarpSize;
  if (slices == 1) {
    if (!active) return;
#pragma unroll
    for (int c = 0; c < C; ++c)
#pragma unroll
      for (int m = 0; m < R; ++m) {
        const float gate = warp_sum(acc[c][m]);
        const float up = SWIGLU ? warp_sum(acc[J - C + c][m]) : 0.0f;
        if (m < rows && n0 + c < N && lane == 0) store_column<T, SWIGLU>(y, gate, up, m, n0 + c, N);
      }
    return;
  }
  __shared__ float sums[kGemvWarps][J][R];
  const int warp = static_cast<int>(threadIdx.x) / kWarpSize;
#pragma unroll
  for (int j = 0; j < J; ++j)
#pragma unroll
    for (int m = 0; m < R; ++m) {
      const float total = warp_sum(acc[j][m]);
      if (lane == 0) sums[warp][j][m] = total;
    }
  __syncthreads();
  if (!active || warp % slices != 0 || lane != 0) return;
#pragma unroll
  for (int c = 0; c < C; ++c)
#pragma unroll
    for (int m = 0; m < R; ++m) {
      if (m >= rows || n0 + c >= N) continue;
      float gate = sums[warp][c][m], up = SWIGLU ? sums[warp][J - C + c][m] : 0.0f;
      for (int s = 1; s < slices; ++s) {
        gate += sums[warp + s][c][m];
        if constexpr (SWIGLU) up += sums[warp + s][J - C + c][m];
      }
      store_column<T, SWIGLU>(y, gate, up, m, n0 + c, N);
    }
}

// L2 prefetch of this warp's weight rows (its columns' rows, and their up rows for SwiGLU), `row_bytes`
// each, a 128-byte line a lane a step. The kernels issue it between KERNEL_ALLOW_DEPENDENTS and
// KERNEL_WAIT_PREDECESSOR (compat.cuh): the weights, which no kernel writes, stream into L2 while the kernel
// before this one finishes, and the loads after the wait find them there. Empty before sm_90 and in the
// harness.
template <int C, bool SWIGLU>
__device__ __forceinline__ void prefetch_weight_rows(const void* w, size_t row_bytes, int N, int tile, int slices) {
  const int n0 = warp_first_column<C>(tile, slices);
  if (n0 >= N) return;
  constexpr int J = C * (SWIGLU ? 2 : 1);
  int n[J];
  warp_rows<C, SWIGLU>(n0, N, n);
  const char* rows = static_cast<const char*>(w);
  const int lane = static_cast<int>(threadIdx.x % kWarpSize) + static_cast<int>(threadIdx.x) / kWarpSize % slices * kWarpSize;
  for (size_t at = static_cast<size_t>(lane) * 128; at < row_bytes; at += static_cast<size_t>(kWarpSize) * 128 * slices)
#pragma unroll
    for (int j = 0; j < J; ++j) prefetch_l2(rows + static_cast<size_t>(n[j]) * row_bytes + at);
}

// y = x w^T for weight rows stored as `w` says (dense: `scales` null for float weights, one per row for
// int8), or its SwiGLU (weight rows n and n + N); this block computes its columns.
template <typename T, int R, bool SWIGLU, typename Rows>
__device__ __forceinline__ void gemv(T* __restrict__ y, const T* __restrict__ x, const Rows& w,
                                     const __half* __restrict__ row_scales, int rows, int N, int K) {
  constexpr int C = kGemvColumns<typename Rows::Elem, SWIGLU>;
  constexpr int J = C * (SWIGLU ? 2 : 1);
  if (rows < 1 || rows > R || blockDim.x != kGemvWarps * kWarpSize) KERNEL_TRAP();
  const int slices = gemv_slices<typename Rows::Elem, SWIGLU>(K);
  const int n0 = warp_first_column<C>(static_cast<int>(blockIdx.x), slices);
  const bool active = n0 < N;  // a warp past N skips the product as a whole: the reductions stay full-warp
  float acc[J][R];
  if (active) {
    int n[J];
    warp_rows<C, SWIGLU>(n0, N, n);
    const int warp = static_cast<int>(threadIdx.x) / kWarpSize;
    rows_dot<T, Rows, R, J>(x, w, n, rows, K, threadIdx.x % kWarpSize, warp % slices, slices, acc);
    if (row_scales) {
#pragma unroll
      for (int j = 0; j < J; ++j) {
        const float s = __half2float(__ldg(row_scales + n[j]));
#pragma unroll
        for (int m = 0; m < R; ++m) acc[j][m] *= s;
      }
    }
  } else {
#pragma unroll
    for (int j = 0; j < J; ++j)
#pragma unroll
      for (int m = 0; m < R; ++m) acc[j][m] = 0.0f;
  }
  store_columns<T, R, C, SWIGLU>(y, acc, rows, n0, N, slices, active);
  // a grid launch.py sized otherwise: columns missed
  if (static_cast<int>(gridDim.x) != gemv_tiles<C>(N, slices)) KERNEL_TRAP();
}

// log2 of the int4 group size, which must be a power of two (quant.py refuses others).
__device__ __forceinline__ int group_shift(int group) {
  const int shift = __ffs(group) - 1;
  if (group < 1 || group != (1 << shift)) KERNEL_TRAP();
  return shift;
}

}  // namespace orin_vlm

// A GEMV kernel's KERNEL_PROLOGUE, with its weight rows (stored as W, `row_bytes` each, K weights, `columns`
// outputs, and their up rows for SwiGLU) prefetched into L2 between the two halves (prefetch_weight_rows).
#define ORIN_GEMV_PROLOGUE(W, SWIGLU, weights, row_bytes, K, columns)                                          \
  KERNEL_ALLOW_DEPENDENTS();                                                                                  \
  orin_vlm::prefetch_weight_rows<orin_vlm::kGemvColumns<W, SWIGLU>, SWIGLU>(                                  \
      (weights), (row_bytes), (columns), blockIdx.x, orin_vlm::gemv_slices<W, SWIGLU>(K));                    \
  KERNEL_WAIT_PREDECESSOR()

#define ORIN_GEMV_KERNELS_E(DT, T, R, E, SWIGLU)                                                                     \
  extern "C" __global__ void gemv_float##E##_##DT##_r##R(T* y, const T* x, const T* weight, const __half* scales,      \
                                                        const __half* offsets, int rows, int n, int k, int group) {                          \
    ORIN_GEMV_PROLOGUE(T, SWIGLU, weight, static_cast<size_t>(k) * sizeof(T), k, n);              \
    orin_vlm::gemv<T, R, SWIGLU>(y, x, orin_vlm::DenseRows<T>{weight, k}, nullptr, rows, n, k);  \
  }                                                                                                                    \
  extern "C" __global__ void gemv_int8##E##_##DT##_r##R(T* y, const T* x, const int8_t* qweight,                       \
                                                       const __half* scales, const __half* offsets,                    \
                                                       int rows, int n, int k, int group) {                                                    \
    ORIN_GEMV_PROLOGUE(int8_t, SWIGLU, qweight, static_cast<size_t>(k), k, n);                    \
    orin_vlm::gemv<T, R, SWIGLU>(y, x, orin_vlm::DenseRows<int8_t>{qweight, k}, scales, rows, n, k); \
  }                                                                                                                    \
  extern "C" __global__ void gemv_int4##E##_##DT##_r##R(T* y, const T* x, const uint8_t* qweight,                      \
                                                       const __half* scales, const __half* offsets,                    \
                                                       int rows, int n, int k, int group) {                                                    \
    ORIN_GEMV_PROLOGUE(uint8_t, SWIGLU, qweight, static_cast<size_t>(k + 1) / 2, k, n);           \
    const orin_vlm::Int4Rows rows_ = {qweight, scales, offsets, k, (k + group - 1) / group,                       \
                                         orin_vlm::group_shift(group)};                                               \
    orin_vlm::gemv<T, R, SWIGLU>(y, x, rows_, nullptr, rows, n, k);                              \
  }

// The kernels of one epilogue (E: empty or _swiglu) for every rows bucket (ORIN_GEMV_KERNELS_ROWS: of one
// activation type) and activation type.
#define ORIN_GEMV_KERNELS_ROWS(DT, T, E, SWIGLU) \
  ORIN_GEMV_KERNELS_E(DT, T, 1, E, SWIGLU)         \
  ORIN_GEMV_KERNELS_E(DT, T, 2, E, SWIGLU)         \
  ORIN_GEMV_KERNELS_E(DT, T, 4, E, SWIGLU)         \
  ORIN_GEMV_KERNELS_E(DT, T, 8, E, SWIGLU)
#define ORIN_GEMV_KERNELS(E, SWIGLU)                                  \
  ORIN_WITH_f32(ORIN_GEMV_KERNELS_ROWS(f32, float, E, SWIGLU))        \
  ORIN_WITH_f16(ORIN_GEMV_KERNELS_ROWS(f16, __half, E, SWIGLU))       \
  ORIN_WITH_bf16(ORIN_GEMV_KERNELS_ROWS(bf16, __nv_bfloat16, E, SWIGLU))
