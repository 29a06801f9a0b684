// RMS NORM of rows, the weight applied, optionally followed by the rotary embedding: one kernel where torch
// runs about eight (cast, square, mean, add eps, rsqrt, scale, cast back, weight product) and four more for
// RoPE (x * cos, swap halves, * sin, add); at batch 1 a decode step is made of such small kernels.
//
// add_rms_norm_<dtype>: the residual add before a norm too: sum = x + delta (rounded to the storage type, as
// torch's add) is written to sum_out and normalised into out, one row per token ([rows, dim], contiguous).
// The row's arithmetic is add_rms_norm.cuh's, which the GEMV's norm epilogue shares (the product and the add
// + norm after it in one launch, where the product is one of our kernels).
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
//
// KV sink (rms_norm_rope with k_pool not null; a static decode step): the step's new keys and values go
// straight into the paged pools, so the step needs no KV-write launch and no copy of the strided heads. Each
// rotated k head (head >= split, heads - split = kv heads) is also stored at its token's slot of k_pool, and
// the grid has tokens * kv_heads more blocks, which copy the v heads (v + t * v_token_stride + h * dim) to the
// slot of v_pool. Pool layout [blocks, page_size, kv_heads, dim]: a token's row at slot * kv_heads * dim. A
// negative slot (a padding row of a batch) stores nothing. k_pool null: grid (rows) and no stores.
#include "add_rms_norm.cuh"

namespace orin_vlm {

constexpr int kMaxRopeDim = 256;

// Grid: (rows); block: kNormThreads threads. The rotated rows (head rows of at most kMaxRopeDim, so at most
// kRopeSlots elements a thread) load x, the weight and both tables at once before the first use: at batch 1
// the launch is a few dozen blocks, and its memory round trips are its cost.
constexpr int kRopeSlots = kMaxRopeDim / kNormThreads;

// Where the rotated k heads and the v heads of a static decode step go (see the top of the file).
template <typename T>
struct KVSink {
  T* k_pool;                   // null: no sink
  T* v_pool;
  const T* v;                  // the step's v heads, [tokens, kv_heads, dim] rows at v_token_stride
  const long long* slots;      // [tokens]
  int v_token_stride;
};

// Block `row` past the norm rows of a sink launch: v head h of token t copied to its slot of v_pool.
template <typename T>
__device__ __forceinline__ void store_v_head(const KVSink<T>& sink, int row, int kv_heads, int dim) {
  const int token = row / kv_heads;
  const int head = row % kv_heads;
  const long long slot = __ldg(sink.slots + token);
  if (slot < 0) return;
  const T* src = sink.v + static_cast<size_t>(token) * sink.v_token_stride + static_cast<size_t>(head) * dim;
  T* dst = sink.v_pool + (static_cast<size_t>(slot) * kv_heads + head) * dim;
  for (int d = threadIdx.x; d < dim; d += kNormThreads) dst[d] = __ldg(src + d);
}

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
    if (dim > kMaxRopeDim || dim % 2 != 0) KERNEL_TRAP();
    const T* c = cos + static_cast<size_t>(token) * dim;
    const T* s = sin_signed + static_cast<size_t>(token) * dim;
    float xv[kRopeSlots], wv[kRopeSlots], cv[kRopeSlots], sv[kRopeSlots];
    float squares = 0.0f;
#pragma unroll
    for (int i = 0; i < kRopeSlots; ++i) {
      const int d = static_cast<int>(threadIdx.x) + i * kNormThreads;
      const bool in = d < dim;
      xv[i] = in ? to_float(__ldg(xr + d)) : 0.0f;
      wv[i] = in ? to_float(__ldg(w + d)) : 0.0f;
      cv[i] = in ? to_float(__ldg(c + d)) : 0.0f;
      sv[i] = in ? to_float(__ldg(s + d)) : 0.0f;
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
    // The k head's row of its token's slot in the pool, when this launch stores the keys (null: it does not).
    T* k_row = nullptr;
    if (sink.k_pool != nullptr && head >= split) {
      const long long slot = __ldg(sink.slots + token);
      if (slot >= 0) k_row = sink.k_pool + (static_cast<size_t>(slot) * kv_heads + (head - split)) * dim;
    }
    const int half = dim / 2;
#pragma unroll
    for (int i = 0; i < kRopeSlots; ++i) {
      const int d = static_cast<int>(threadIdx.x) + i * kNormThreads;
      if (d >= dim) continue;
      const float a = to_float(from_float<T>(__fmul_rn(normed_row[d], cv[i])));
      const float b = to_float(from_float<T>(__fmul_rn(normed_row[d < half ? d + half : d - half], sv[i])));
      const T rotated = from_float<T>(__fadd_rn(a, b));
      o[d] = rotated;
      if (k_row != nullptr) k_row[d] = rotated;
    }
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
  }

ORIN_RMS_NORM_KERNELS(f32, float)
ORIN_RMS_NORM_KERNELS(f16, __half)
ORIN_RMS_NORM_KERNELS(bf16, __nv_bfloat16)
