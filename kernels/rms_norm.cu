// RMS NORM of rows, the weight applied, optionally followed by the rotary embedding: one kernel where torch
// runs about eight (cast, square, mean, add eps, rsqrt, scale, cast back, weight product) and four more for
// RoPE (x * cos, swap halves, * sin, add); at batch 1 a decode step is made of such small kernels.
//
// add_rms_norm_<dtype>: the residual add before a norm too: sum = x + delta (rounded to the storage type, as
// torch's add) is written to sum_out and normalised into out, one row per token ([rows, dim], contiguous).
// The row's arithmetic is add_rms_norm.cuh's.
//
// rms_norm_<dtype> / rms_norm_rope_<dtype>: row r of `rows = tokens * heads` is head h = r % heads of token
// t = r / heads, read at x + t * x_token_stride + h * dim (the q and k heads of a fused q/k/v projection are
// normalised in place of their token rows; a plain norm has heads = 1 and x_token_stride = dim). Heads below
// `split` take weight_a, the others weight_b (q_norm and k_norm in one launch; weight_b is not read when
// split >= heads). out is contiguous [rows, dim].
//
// The arithmetic is torch's, rounding where torch's separate ops round: x widened to fp32, mean of squares
// as sum * (1 / dim), x * rsqrt(mean + eps) rounded to the storage type, the weight product rounded (Qwen3's
// RMSNorm multiplies by its weight after casting back). RoPE (the _rope kernels; dim even, <= 256): a head's
// row as norm_rope.cuh computes it, with the token's rows of the two
// tables ([tokens, dim], the storage type, sin_signed = [-sin, sin] of the halves).
//
// KV sink (rms_norm_rope with k_pool not null; a static decode step): the step's new keys and values go
// straight into the paged pools, so the step needs no KV-write launch and no copy of the strided heads. Each
// rotated k head (head >= split, heads - split = kv heads) is also stored at its token's slot of k_pool, and
// the grid has tokens * kv_heads more blocks, which copy the v heads (v + t * v_token_stride + h * dim) to the
// slot of v_pool (norm_rope.cuh: KVSink). k_pool null: grid (rows) and no stores.
//
// rope_tables_<dtype>: the tables a step's RoPE reads, from the tokens' 3-D positions, in one launch where
// torch takes about ten (the positions widened, gathered per frequency, multiplied, concatenated, cos, sin,
// both cast, half of sin negated, concatenated): for token t and dim d (frequency j = d mod dim/2, which
// reads position stream streams[j]: the interleaved M-RoPE), angle = float(positions[stream][t]) *
// inv_freq[j] (one fp32 product, torch's), cos[t, d] = cast(cosf(angle)) and sin_signed[t, d] =
// cast(sinf(angle)), negated for d < dim/2. cosf and sinf are the CUDA math library's, which torch's own
// cos and sin kernels call, so on a GPU the tables are torch's to the bit.
#include "norm_rope.cuh"

namespace orin_vlm {

// Block `row` past the norm rows of a sink launch: v head h of token t copied to its slot of v_pool.
template <typename T>
__device__ __forceinline__ void store_v_head(const KVSink<T>& sink, int row, int kv_heads, int dim) {
  const int token = row / kv_heads;
  const int head = row % kv_heads;
  const long long slot = __ldg(sink.slots + token);
  if (slot < 0) return;
  const T* src = sink.v + static_cast<size_t>(token) * sink.v_token_stride + static_cast<size_t>(head) * dim;
  copy_head(pool_row(sink.v_pool, slot, kv_heads, head, dim), src, dim);
}

// Grid: (rows, or rows + tokens * kv_heads with a sink); block: kNormThreads threads.
template <typename T, bool ROPE>
__device__ __forceinline__ void rms_norm(T* __restrict__ out, const T* __restrict__ x, const T* __restrict__ weight_a,
                                         const T* __restrict__ weight_b, const T* __restrict__ cos,
                                         const T* __restrict__ sin_signed, KVSink<T> sink, int heads, int split,
                                         int dim, int x_token_stride, float eps) {
  if (blockDim.x != kNormThreads) KERNEL_TRAP();
  const int kv_heads = heads - split;
  // A sink launch has tokens * (heads + kv_heads) blocks: the norm rows first, then the v heads.
  const int norm_rows =
      sink.k_pool != nullptr ? static_cast<int>(gridDim.x) / (heads + kv_heads) * heads : static_cast<int>(gridDim.x);
  if (sink.k_pool != nullptr && (kv_heads < 1 || static_cast<int>(gridDim.x) % (heads + kv_heads) != 0)) KERNEL_TRAP();
  const int row = blockIdx.x;
  if (row >= norm_rows) {
    store_v_head(sink, row - norm_rows, kv_heads, dim);
    return;
  }
  const int token = row / heads;
  const int head = row % heads;
  const T* xr = x + static_cast<size_t>(token) * x_token_stride + static_cast<size_t>(head) * dim;
  const T* w = head < split ? weight_a : weight_b;
  T* o = out + static_cast<size_t>(row) * dim;
  if constexpr (!ROPE) {
    float squares = 0.0f;
    for (int d = threadIdx.x; d < dim; d += kNormThreads) {
      const float v = to_float(__ldg(xr + d));
      squares += v * v;
    }
    const float inv = rms_scale(squares, dim, eps);
    for (int d = threadIdx.x; d < dim; d += kNormThreads) {
      const float normed = to_float(from_float<T>(to_float(__ldg(xr + d)) * inv));
      o[d] = from_float<T>(to_float(__ldg(w + d)) * normed);
    }
  } else {
    // The k head's row of its token's slot in the pool, when this launch stores the keys (null: it does not).
    T* k_row = nullptr;
    if (sink.k_pool != nullptr && head >= split) {
      const long long slot = __ldg(sink.slots + token);
      if (slot >= 0) k_row = pool_row(sink.k_pool, slot, kv_heads, head - split, dim);
    }
    norm_rope_row<T>(o, xr, w, cos + static_cast<size_t>(token) * dim, sin_signed + static_cast<size_t>(token) * dim,
                     k_row, dim, eps);
  }
}
// Grid: (tokens); block: kNormThreads threads; the tables' row blockIdx.x ([tokens, dim] each; positions
// [3, tokens] at position_stride a stream; inv_freq and streams [dim / 2]).
template <typename T>
__device__ __forceinline__ void rope_tables(T* __restrict__ cos, T* __restrict__ sin_signed,
                                            const long long* __restrict__ positions, const float* __restrict__ inv_freq,
                                            const long long* __restrict__ streams, int position_stride, int dim) {
  if (blockDim.x != kNormThreads || dim % 2 != 0) KERNEL_TRAP();
  const int token = blockIdx.x, half = dim / 2;
  for (int d = threadIdx.x; d < dim; d += kNormThreads) {
    const int j = d < half ? d : d - half;
    const long long position = __ldg(positions + __ldg(streams + j) * position_stride + token);
    const float angle = __fmul_rn(static_cast<float>(position), __ldg(inv_freq + j));
    const size_t at = static_cast<size_t>(token) * dim + d;
    cos[at] = from_float<T>(cosf(angle));
    const float sine = to_float(from_float<T>(sinf(angle)));
    sin_signed[at] = from_float<T>(d < half ? -sine : sine);
  }
}

// Grid: (rows); block: kNormThreads threads; row blockIdx.x of [rows, dim] (add_rms_norm.cuh).
template <typename T>
__device__ __forceinline__ void add_rms_norm(T* __restrict__ sum_out, T* __restrict__ out, const T* __restrict__ x,
                                             const T* __restrict__ delta, const T* __restrict__ weight, int dim,
                                             float eps) {
  if (blockDim.x != kNormThreads) KERNEL_TRAP();
  const size_t row = static_cast<size_t>(blockIdx.x) * dim;
  add_rms_norm_row<T>(sum_out + row, out + row, x + row, delta + row, weight, dim, eps);
}

}  // namespace orin_vlm

#define ORIN_RMS_NORM_KERNELS(DT, T)                                                                            \
  extern "C" __global__ void __launch_bounds__(orin_vlm::kNormThreads)                                         \
      rms_norm_##DT(T* out, const T* x, const T* weight_a, const T* weight_b, int heads, int split, int dim,    \
                    int x_token_stride, float eps) {                                                           \
    KERNEL_PROLOGUE();                                                                                         \
    orin_vlm::rms_norm<T, false>(out, x, weight_a, weight_b, nullptr, nullptr, {nullptr, nullptr, nullptr,     \
                                 nullptr, 0}, heads, split, dim, x_token_stride, eps);                         \
  }                                                                                                            \
  extern "C" __global__ void __launch_bounds__(orin_vlm::kNormThreads)                                         \
      rms_norm_rope_##DT(T* out, const T* x, const T* weight_a, const T* weight_b, const T* cos,               \
                         const T* sin_signed, T* k_pool, T* v_pool, const T* v, const long long* slots,        \
                         int heads, int split, int dim, int x_token_stride, int v_token_stride, float eps) {   \
    KERNEL_PROLOGUE();                                                                                         \
    orin_vlm::rms_norm<T, true>(out, x, weight_a, weight_b, cos, sin_signed,                                   \
                                {k_pool, v_pool, v, slots, v_token_stride}, heads, split, dim, x_token_stride, \
                                eps);                                                                          \
  }                                                                                                            \
  extern "C" __global__ void __launch_bounds__(orin_vlm::kNormThreads)                                         \
      add_rms_norm_##DT(T* sum_out, T* out, const T* x, const T* delta, const T* weight, int dim, float eps) {  \
    KERNEL_PROLOGUE();                                                                                         \
    orin_vlm::add_rms_norm<T>(sum_out, out, x, delta, weight, dim, eps);                                       \
  }                                                                                                            \
  extern "C" __global__ void __launch_bounds__(orin_vlm::kNormThreads)                                         \
      rope_tables_##DT(T* cos, T* sin_signed, const long long* positions, const float* inv_freq,               \
                       const long long* streams, int position_stride, int dim) {                               \
    KERNEL_PROLOGUE();                                                                                         \
    orin_vlm::rope_tables<T>(cos, sin_signed, positions, inv_freq, streams, position_stride, dim);             \
  }

ORIN_WITH_f32(ORIN_RMS_NORM_KERNELS(f32, float))
ORIN_WITH_f16(ORIN_RMS_NORM_KERNELS(f16, __half))
ORIN_WITH_bf16(ORIN_RMS_NORM_KERNELS(bf16, __nv_bfloat16))
