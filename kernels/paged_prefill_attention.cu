// Paged PREFILL attention: a chunk of new tokens attending causally to the cached prefix and to
// themselves. K/V are read from the paged pool after this chunk's K/V were written there, so the
// prefix and the chunk take one code path.
//
// Sequences are packed (varlen): sequence b owns query rows cu_q_lens[b] .. cu_q_lens[b+1]-1 and holds
// seq_lens[b] cached tokens including its chunk, so query i of the chunk sits at slot
// seq_lens[b] - q_len + i and attends to slots 0 .. that slot.
//
// One thread block serves one tile of BLOCK_Q query rows of one head of one sequence. K and then V of a
// tile of kPrefillBlockK tokens pass through one shared buffer (vectorized 16-byte loads, widened to
// fp32): first the scores of every row against the K tile (a lane per key, online softmax per row, the
// probabilities kept in shared memory), then the V tile is loaded over the K tile and accumulated (a lane
// per head dimension, strided by 32). Sharing the buffer keeps head_dim 256 within the 48 KiB every
// GPU grants without opt-in. Shared memory is fixed by HEAD_DIM, independent of context length. Tiles
// past the last row's causal limit are skipped.
#include "attention_common.cuh"

namespace orin_vlm {

constexpr int kPrefillWarps = 4;
constexpr int kPrefillBlockK = 32;  // one key per lane

// Query rows per block: 16, or 8 at head_dim 256 so the tiles fit in 48 KiB.
template <int HEAD_DIM>
struct PrefillTile {
  static constexpr int kBlockQ = HEAD_DIM > 128 ? 8 : 16;
  static constexpr int kRowsPerWarp = kBlockQ / kPrefillWarps;
};

// Grid: (ceil(max_q_len / BLOCK_Q), num_heads, batch); block: kPrefillWarps*32 threads;
// dynamic shared memory (floats): BLOCK_Q*D + BlockK*(D+1) + BLOCK_Q*BlockK + BlockK.
template <typename T, int HEAD_DIM>
__device__ __forceinline__ void paged_prefill_attention(
    T* __restrict__ out,                   // [num_tokens, num_heads, HEAD_DIM]
    const T* __restrict__ q,               // [num_tokens, num_heads, HEAD_DIM]
    const T* __restrict__ k_pool,          // [num_blocks, page_size, num_kv_heads, HEAD_DIM]
    const T* __restrict__ v_pool,          // same layout as k_pool
    const int* __restrict__ block_tables,  // [batch, max_blocks_per_seq], -1 = unallocated
    const int* __restrict__ seq_lens,      // [batch] tokens cached including the chunk
    const int* __restrict__ cu_q_lens,     // [batch + 1] prefix sums of the chunk lengths
    int num_heads, int num_kv_heads, int page_size, int max_blocks_per_seq, float scale) {
  constexpr int VEC = Vec<T>::kElems;
  constexpr int CHUNKS = HEAD_DIM / VEC;  // vectors per head row
  constexpr int BLOCK_Q = PrefillTile<HEAD_DIM>::kBlockQ;
  constexpr int ROWS = PrefillTile<HEAD_DIM>::kRowsPerWarp;
  constexpr int DPL = HEAD_DIM / kWarpSize;  // output dims per lane
  constexpr int STRIDE = HEAD_DIM + 1;       // padded: lanes read different keys at the same d
  static_assert(HEAD_DIM % kWarpSize == 0, "head_dim must be a multiple of 32");
  if (blockDim.x != kPrefillWarps * kWarpSize) KERNEL_TRAP();

  const int tile = blockIdx.x;
  const int h = blockIdx.y;
  const int b = blockIdx.z;
  const int q_begin = __ldg(cu_q_lens + b);
  const int q_len = __ldg(cu_q_lens + b + 1) - q_begin;
  const int row0 = tile * BLOCK_Q;
  if (row0 >= q_len) return;  // block-uniform: this sequence's chunk is shorter than the grid
  const int kv_len = __ldg(seq_lens + b);
  const int ctx = kv_len - q_len;  // slots cached before the chunk
  const int kvh = h / (num_heads / num_kv_heads);
  const int rows_here = min(BLOCK_Q, q_len - row0);
  const int kv_hi = min(kv_len, ctx + row0 + rows_here);  // keys any row of this tile may see

  const int tid = threadIdx.x;
  const int warp = tid / kWarpSize;
  const int lane = tid % kWarpSize;

  DYNAMIC_SHARED(float, smem);
  float* q_s = smem;                           // [BLOCK_Q][D], log2-domain scaled
  float* kv_s = q_s + BLOCK_Q * HEAD_DIM;      // [BlockK][D + 1]: the K tile, then the V tile
  float* p_s = kv_s + kPrefillBlockK * STRIDE;  // [BLOCK_Q][BlockK] probabilities of each row
  float* ok_s = p_s + BLOCK_Q * kPrefillBlockK;  // [BlockK] 1 = key backed by an allocated block

  const float qscale = scale * kLog2e;
  for (int c = tid; c < BLOCK_Q * CHUNKS; c += blockDim.x) {
    const int r = c / CHUNKS;
    const int d0 = (c % CHUNKS) * VEC;
    float x[VEC];
    if (r < rows_here) {
      load_vec(q + (static_cast<size_t>(q_begin + row0 + r) * num_heads + h) * HEAD_DIM + d0, x);
    } else {
#pragma unroll
      for (int i = 0; i < VEC; ++i) x[i] = 0.0f;
    }
#pragma unroll
    for (int i = 0; i < VEC; ++i) q_s[r * HEAD_DIM + d0 + i] = x[i] * qscale;
  }

  float m[ROWS];
  float l[ROWS];
  float alpha[ROWS];
  bool seen[ROWS];  // warp-uniform: some key of the current tile is visible to the row
  float acc[ROWS][DPL];
#pragma unroll
  for (int i = 0; i < ROWS; ++i) {
    m[i] = -INFINITY;
    l[i] = 0.0f;
#pragma unroll
    for (int c = 0; c < DPL; ++c) acc[i][c] = 0.0f;
  }

  const int* table_row = block_tables + static_cast<size_t>(b) * max_blocks_per_seq;
  const size_t token_stride = static_cast<size_t>(num_kv_heads) * HEAD_DIM;
  const size_t head_offset = static_cast<size_t>(kvh) * HEAD_DIM;

  for (int kt = 0; kt < kv_hi; kt += kPrefillBlockK) {
    // -- K tile -> scores and probabilities of every row.
    __syncthreads();  // the previous V tile is consumed (and q_s is complete before the first tile)
    for (int c = tid; c < kPrefillBlockK * CHUNKS; c += blockDim.x) {
      const int j = c / CHUNKS;
      const int d0 = (c % CHUNKS) * VEC;
      const int t = kt + j;
      const int blk = t < kv_hi ? physical_block(table_row, t, page_size, max_blocks_per_seq) : -1;
      float x[VEC];
      if (blk >= 0) {
        load_vec(k_pool + (static_cast<size_t>(blk) * page_size + t % page_size) * token_stride + head_offset + d0, x);
      } else {
#pragma unroll
        for (int i = 0; i < VEC; ++i) x[i] = 0.0f;
      }
#pragma unroll
      for (int i = 0; i < VEC; ++i) kv_s[j * STRIDE + d0 + i] = x[i];
      if (d0 == 0) ok_s[j] = blk >= 0 ? 1.0f : 0.0f;
    }
    __syncthreads();

#pragma unroll
    for (int i = 0; i < ROWS; ++i) {
      const int r = warp * ROWS + i;
      seen[i] = false;
      alpha[i] = 1.0f;
      if (r < rows_here) {  // warp-uniform
        const int q_slot = ctx + row0 + r;
        const int j = kt + lane;
        const bool valid = ok_s[lane] != 0.0f && j <= q_slot;
        float s = -INFINITY;
        if (valid) {
          float dot = 0.0f;
          for (int d = 0; d < HEAD_DIM; ++d) dot += q_s[r * HEAD_DIM + d] * kv_s[lane * STRIDE + d];
          s = dot;
        }
        const float tile_max = warp_max(s);
        if (tile_max != -INFINITY) {  // warp-uniform: some key of this tile is visible to row r
          const float m_new = fmaxf(m[i], tile_max);
          alpha[i] = exp2_diff(m[i], m_new);
          const float p = valid ? exp2f(s - m_new) : 0.0f;
          l[i] = l[i] * alpha[i] + warp_sum(p);
          m[i] = m_new;
          p_s[r * kPrefillBlockK + lane] = p;
          seen[i] = true;
        }
      }
    }

    // -- V tile (over the K tile) -> output accumulators.
    __syncthreads();  // every warp is done with the K tile
    for (int c = tid; c < kPrefillBlockK * CHUNKS; c += blockDim.x) {
      const int j = c / CHUNKS;
      const int d0 = (c % CHUNKS) * VEC;
      float x[VEC];
      if (ok_s[j] != 0.0f) {
        const int t = kt + j;
        const int blk = physical_block(table_row, t, page_size, max_blocks_per_seq);
        load_vec(v_pool + (static_cast<size_t>(blk) * page_size + t % page_size) * token_stride + head_offset + d0, x);
      } else {
#pragma unroll
        for (int i = 0; i < VEC; ++i) x[i] = 0.0f;
      }
#pragma unroll
      for (int i = 0; i < VEC; ++i) kv_s[j * STRIDE + d0 + i] = x[i];
    }
    __syncthreads();

#pragma unroll
    for (int i = 0; i < ROWS; ++i) {
      if (seen[i]) {  // warp-uniform
        const int r = warp * ROWS + i;
#pragma unroll
        for (int c = 0; c < DPL; ++c) acc[i][c] *= alpha[i];
        for (int kk = 0; kk < kPrefillBlockK; ++kk) {
          const float pk = p_s[r * kPrefillBlockK + kk];
#pragma unroll
          for (int c = 0; c < DPL; ++c) acc[i][c] += pk * kv_s[kk * STRIDE + lane + c * kWarpSize];
        }
      }
    }
  }

#pragma unroll
  for (int i = 0; i < ROWS; ++i) {
    const int r = warp * ROWS + i;
    if (r < rows_here) {
      const float inv = l[i] > 0.0f ? 1.0f / l[i] : 0.0f;
      T* dst = out + (static_cast<size_t>(q_begin + row0 + r) * num_heads + h) * HEAD_DIM;
#pragma unroll
      for (int c = 0; c < DPL; ++c) dst[lane + c * kWarpSize] = from_float<T>(acc[i][c] * inv);
    }
  }
}

}  // namespace orin_vlm

// ---- extern "C" instantiations: paged_prefill_attention_<dtype>_d<head_dim> ----
#define ORIN_PREFILL_KERNEL(DT, T, D)                                                                           \
  extern "C" __global__ void __launch_bounds__(orin_vlm::kPrefillWarps * 32) paged_prefill_attention_##DT##_d##D( \
      T* out, const T* q, const T* k_pool, const T* v_pool, const int* block_tables, const int* seq_lens,     \
      const int* cu_q_lens, int num_heads, int num_kv_heads, int page_size, int max_blocks_per_seq,            \
      float scale) {                                                                                           \
    KERNEL_PROLOGUE();                                                                                         \
    orin_vlm::paged_prefill_attention<T, D>(out, q, k_pool, v_pool, block_tables, seq_lens, cu_q_lens,         \
                                            num_heads, num_kv_heads, page_size, max_blocks_per_seq, scale);    \
  }

#define ORIN_PREFILL_FOR_HEAD_DIM(D)                   \
  ORIN_WITH_f32(ORIN_PREFILL_KERNEL(f32, float, D))    \
  ORIN_WITH_f16(ORIN_PREFILL_KERNEL(f16, __half, D))   \
  ORIN_WITH_bf16(ORIN_PREFILL_KERNEL(bf16, __nv_bfloat16, D))

ORIN_FOR_EACH_HEAD_DIM(ORIN_PREFILL_FOR_HEAD_DIM)
