// Paged DECODE attention: one query token per sequence, reading K/V through the block table.
//
// One thread block serves one (kv head, group chunk, sequence, split): up to MAX_GROUP of the query heads
// that share the kv head (GQA) are processed together, so every K/V vector is loaded once per chunk. A
// GQA group larger than MAX_GROUP is served by several chunks (gridDim.x = num_kv_heads * chunks), so any
// group size that divides the head count works. Inside a warp, the lanes are split into sub-groups of
// LANES_PER_TOKEN lanes, each sub-group owning 1, 2 or 4 tokens per step and each lane VPL 16-byte vectors of
// a token's head (one for every head size except fp32 at 256). A step's K and V are copied into shared memory
// asynchronously while the warp computes the step before (so a warp keeps two steps' loads in flight without
// the registers to hold them). Every sub-group keeps its own online-softmax state (running max m, sum l,
// unnormalized output acc); the states are merged across the warp with shuffles and across warps through
// shared memory. Shared memory is fixed by the template parameters, independent of the context length.
//
// Split-K (flash-decoding): with gridDim.z > 1, split s handles tokens
// [s*tokens_per_split, (s+1)*tokens_per_split) and writes a normalized partial output plus its
// log-sum-exp (splits past the sequence end write lse=-inf); the block that finishes last among the splits
// of its (sequence, kv head chunk) then combines them into `out` (a counter per such group in `counters`,
// zero before the launch and zero again after it), so split-K costs no second launch.
//
// The sequence length is read from device memory (seq_lens), so a captured CUDA graph stays valid
// while the length grows. Unallocated block-table entries (-1) are never used as addresses. The queries are
// read in place, a batch row q_token_stride elements from the next (the q heads of the q/k norm's output
// rows, which hold the k heads too: a batch of several rows needs no copy of them first).
#include "attention_common.cuh"

namespace orin_vlm {

constexpr int kDecodeWarps = 4;
constexpr int kDecodeThreads = kDecodeWarps * kWarpSize;

// K/V staging (see the kernel): kDecodeStages steps of up to kStageVecs 16-byte vectors a thread (its tokens'
// K, then their V), laid out [stage][vector][thread] so a warp's accesses are adjacent. Mirrored by
// DECODE_STAGES and DECODE_STAGE_VECS in orin_vlm_node/cuda/launch.py.
constexpr int kDecodeStages = 2;  // the kernel alternates between them (stage ^ 1)
static_assert(kDecodeStages == 2, "the decode loop double-buffers: a step is staged while the one before computes");
constexpr int kStageVecs = 8;

__device__ __forceinline__ uint4* staged_vec(uint4* staged, int stage, int i) {
  return staged + (stage * kStageVecs + i) * kDecodeThreads + threadIdx.x;
}

// Dynamic shared memory of a block: the staging area, which the cross-warp merge (acc [warps][group][head_dim],
// then m and l [warps][group], fp32) reuses once the loop is done.
template <int HEAD_DIM, int MAX_GROUP>
__device__ __forceinline__ constexpr unsigned decode_shared_bytes() {
  constexpr unsigned merge = kDecodeWarps * MAX_GROUP * (HEAD_DIM + 2) * 4;
  constexpr unsigned staging = kDecodeStages * kStageVecs * kDecodeThreads * 16;
  return merge > staging ? merge : staging;
}

// Blocks an SM must hold at once, the register bound given to the compiler: 4 for groups of up to 2 query
// heads (the 2B's), whose 4-token load batches then fit 128 registers without spilling (left alone the
// compiler took 146, 3 blocks an SM: a 4k context's 512 blocks took two waves on 132 SMs); 3 for groups of
// 4 (135 registers, was 174); none for 8, whose queries and accumulators would spill under any bound.
constexpr int decode_min_blocks(int max_group) { return max_group <= 2 ? 4 : max_group <= 4 ? 3 : 1; }

// How one head row of HEAD_DIM elements of T is spread over the lanes of a token sub-group.
template <typename T, int HEAD_DIM>
struct DecodeLayout {
  static constexpr int kVec = Vec<T>::kElems;                  // elements per 16-byte vector
  static constexpr int kVecs = HEAD_DIM / kVec;                // vectors per head row
  static constexpr int kLanes = kVecs < kWarpSize ? kVecs : kWarpSize;  // lanes per token
  static constexpr int kVpl = kVecs / kLanes;                  // vectors per lane
  static constexpr int kTokensPerWarp = kWarpSize / kLanes;
  static_assert(HEAD_DIM % kVec == 0 && kVecs % kLanes == 0 && kWarpSize % kLanes == 0,
                "head_dim must split into whole 16-byte vectors over a power-of-two number of lanes");
  // First element of this lane's j-th vector: the lanes of a token read adjacent vectors (coalesced).
  static __device__ __forceinline__ int dim(int lane_in_token, int j) { return (j * kLanes + lane_in_token) * kVec; }
};

// Splits whose partials a combining thread loads before it uses the first: each batch is one memory round
// trip, and a 4k context has 64 splits.
constexpr int kCombineBatch = 16;

// The block that finished last among the splits of its group writes `out` for the group's `heads` query
// heads (rows head_row0 ..) from their partials: each item, 4 adjacent dims of one head (16-byte loads), is
// shared by `lanes` adjacent threads (as many as the block has for its items, up to a warp), each taking every
// lanes-th split in batches whose loads are all issued before the first is used, merged with a running
// maximum; then the lanes' states are merged by shuffles. With the 2B's two heads of 128 a 4k context's 64
// splits are two batches a thread instead of four (each batch a memory round trip, on the kernel's critical
// path). Read with __ldcg: other blocks of this launch wrote them, so not through the read-only cache.
template <typename T, int HEAD_DIM>
__device__ __forceinline__ void combine_splits(T* __restrict__ out, const float* __restrict__ partial_out,
                                               const float* __restrict__ partial_lse, size_t head_row0, int heads,
                                               int num_splits) {
  constexpr int kQuads = HEAD_DIM / 4;
  const int items = heads * kQuads;
  const int threads = static_cast<int>(blockDim.x);
  int lanes = 1;  // the same for every thread of the block: the loops and shuffles below stay converged
  while (lanes < kWarpSize && 2 * lanes * items <= threads) lanes *= 2;
  const int part = static_cast<int>(threadIdx.x) % lanes;
  for (int first = 0; first < items; first += threads / lanes) {
    const int item = first + static_cast<int>(threadIdx.x) / lanes;
    const bool active = item < items;
    const size_t head_row = head_row0 + (active ? item / kQuads : 0);
    const int d = (item % kQuads) * 4;
    const size_t row0 = head_row * num_splits;
    float m = -INFINITY;
    float w_sum = 0.0f;
    float o[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    for (int s0 = 0; s0 < num_splits; s0 += kCombineBatch * lanes) {
      float lse[kCombineBatch];
      float4 piece[kCombineBatch];
#pragma unroll
      for (int i = 0; i < kCombineBatch; ++i) {
        const int s = s0 + i * lanes + part;
        if (active && s < num_splits) {
          lse[i] = __ldcg(partial_lse + row0 + s);
          piece[i] = __ldcg(reinterpret_cast<const float4*>(partial_out + (row0 + s) * HEAD_DIM + d));
        } else {
          lse[i] = -INFINITY;  // weighs 0: the sums do not move
          piece[i].x = piece[i].y = piece[i].z = piece[i].w = 0.0f;
        }
      }
      float m_new = m;
#pragma unroll
      for (int i = 0; i < kCombineBatch; ++i) m_new = fmaxf(m_new, lse[i]);
      const float rescale = exp2_diff(m, m_new);
      w_sum *= rescale;
#pragma unroll
      for (int k = 0; k < 4; ++k) o[k] *= rescale;
#pragma unroll
      for (int i = 0; i < kCombineBatch; ++i) {
        const float w = exp2_diff(lse[i], m_new);
        w_sum += w;
        o[0] += w * piece[i].x;
        o[1] += w * piece[i].y;
        o[2] += w * piece[i].z;
        o[3] += w * piece[i].w;
      }
      m = m_new;
    }
    for (int off = 1; off < lanes; off <<= 1) {  // the item's lanes are adjacent: merge their states
      const float m_o = __shfl_xor_sync(kFullMask, m, off);
      const float w_o = __shfl_xor_sync(kFullMask, w_sum, off);
      const float m_new = fmaxf(m, m_o);
      const float a = exp2_diff(m, m_new);
      const float c = exp2_diff(m_o, m_new);
      w_sum = w_sum * a + w_o * c;
#pragma unroll
      for (int k = 0; k < 4; ++k) o[k] = o[k] * a + __shfl_xor_sync(kFullMask, o[k], off) * c;
      m = m_new;
    }
    if (active && part == 0) {
#pragma unroll
      for (int k = 0; k < 4; ++k)
        out[head_row * HEAD_DIM + d + k] = from_float<T>(w_sum > 0.0f ? o[k] / w_sum : 0.0f);
    }
  }
}

// The physical block of each of a sub-group's UNROLL tokens in one step (the first `t`, the others STRIDE
// apart); -1 past the table row.
template <int UNROLL, int STRIDE>
__device__ __forceinline__ void step_blocks(int (&blk)[UNROLL], const int* __restrict__ table_row, int t, int page_size,
                                            int max_blocks_per_seq) {
#pragma unroll
  for (int u = 0; u < UNROLL; ++u) blk[u] = physical_block(table_row, t + u * STRIDE, page_size, max_blocks_per_seq);
}

// Grid: (num_kv_heads * group_chunks, batch, num_splits); block: kDecodeWarps*32 threads;
// dynamic shared memory: decode_shared_bytes<HEAD_DIM, MAX_GROUP>().
template <typename T, int HEAD_DIM, int MAX_GROUP>
__device__ __forceinline__ void paged_decode_attention(
    T* __restrict__ out,                   // [batch, num_heads, HEAD_DIM]            (num_splits == 1)
    float* __restrict__ partial_out,       // [batch, num_heads, num_splits, HEAD_DIM] (num_splits > 1), 16-B aligned
    float* __restrict__ partial_lse,       // [batch, num_heads, num_splits], log2 domain
    unsigned* __restrict__ counters,       // [batch, gridDim.x] (num_splits > 1)
    const T* __restrict__ q,               // [batch, num_heads, HEAD_DIM], batch rows q_token_stride apart
    const T* __restrict__ k_pool,          // [num_blocks, page_size, num_kv_heads, HEAD_DIM]
    const T* __restrict__ v_pool,          // same layout as k_pool
    const int* __restrict__ block_tables,  // [batch, max_blocks_per_seq], -1 = unallocated
    const int* __restrict__ seq_lens,      // [batch] tokens cached (including this step's token)
    int num_heads, int num_kv_heads, int page_size, int max_blocks_per_seq, int tokens_per_split,
    int q_token_stride, float scale) {
  using Layout = DecodeLayout<T, HEAD_DIM>;
  constexpr int VEC = Layout::kVec;
  constexpr int VPL = Layout::kVpl;
  constexpr int LANES_PER_TOKEN = Layout::kLanes;
  constexpr int TOKENS_PER_WARP = Layout::kTokensPerWarp;
  constexpr int REGS = VPL * VEC;  // elements of one head row this lane holds
  // Tokens per sub-group in one step: 4 where a lane's queries and accumulators are few (the 2B's two heads of
  // 128 in fp16 among them), else 2 (their scores would spill); fewer where a lane holds two vectors of a row,
  // so that a step's K and V fit the thread's staging vectors.
  constexpr int UNROLL_REGS = MAX_GROUP * REGS <= 16 ? 4 : 2;
  constexpr int UNROLL = UNROLL_REGS / VPL > 0 ? UNROLL_REGS / VPL : 1;
  static_assert(2 * UNROLL * VPL <= kStageVecs, "a step's K and V must fit a thread's staging vectors");
  if (blockDim.x != kDecodeWarps * kWarpSize) KERNEL_TRAP();
  const int group = num_heads / num_kv_heads;
  const int chunks = (group + MAX_GROUP - 1) / MAX_GROUP;
  if (static_cast<int>(gridDim.x) != num_kv_heads * chunks) KERNEL_TRAP();

  const int kvh = blockIdx.x / chunks;
  const int g0 = (blockIdx.x % chunks) * MAX_GROUP;  // first query head of the group this block serves
  const int heads = min(MAX_GROUP, group - g0);      // query heads of this block (<= MAX_GROUP)
  const int head0 = kvh * group + g0;                // global index of the block's first query head
  const int b = blockIdx.y;
  const int split = blockIdx.z;
  const int num_splits = gridDim.z;
  const int warp = threadIdx.x / kWarpSize;
  const int lane = threadIdx.x % kWarpSize;
  const int sub = lane / LANES_PER_TOKEN;  // which token of the warp's step this lane works on
  const int lane_in_token = lane % LANES_PER_TOKEN;

  // The block-table entries of a step depend on its tokens' indices only (physical_block bounds them), not on
  // the sequence length: this warp's first two steps' are read before the length, and each step reads those of
  // the step after the next, so staging a step's K and V waits for no table read of its own.
  constexpr int kWarpTokens = TOKENS_PER_WARP * UNROLL;  // tokens of one warp in one step
  constexpr int kBlockTokens = kDecodeWarps * kWarpTokens;
  const int t_begin = num_splits > 1 ? split * tokens_per_split : 0;
  const int first = t_begin + warp * kWarpTokens;  // this warp's first token of its first step
  const int* table_row = block_tables + static_cast<size_t>(b) * max_blocks_per_seq;
  int blk[UNROLL];       // the first step's entries
  int next_blk[UNROLL];  // the entries of the next step to stage
  step_blocks<UNROLL, TOKENS_PER_WARP>(blk, table_row, first + sub, page_size, max_blocks_per_seq);
  step_blocks<UNROLL, TOKENS_PER_WARP>(next_blk, table_row, first + kBlockTokens + sub, page_size, max_blocks_per_seq);
  const int seq_len = __ldg(seq_lens + b);
  const int t_end = num_splits > 1 ? min(seq_len, t_begin + tokens_per_split) : seq_len;

  // This lane's slice of the block's queries, pre-scaled into the log2 domain.
  const float qscale = scale * kLog2e;
  float qr[MAX_GROUP][REGS];
#pragma unroll
  for (int g = 0; g < MAX_GROUP; ++g) {
#pragma unroll
    for (int j = 0; j < VPL; ++j) {
      float* dst = qr[g] + j * VEC;
      if (g < heads) {
        load_vec(q + static_cast<size_t>(b) * q_token_stride + static_cast<size_t>(head0 + g) * HEAD_DIM +
                     Layout::dim(lane_in_token, j),
                 dst);
#pragma unroll
        for (int i = 0; i < VEC; ++i) dst[i] *= qscale;
      } else {
#pragma unroll
        for (int i = 0; i < VEC; ++i) dst[i] = 0.0f;
      }
    }
  }

  float m[MAX_GROUP];
  float l[MAX_GROUP];
  float acc[MAX_GROUP][REGS];
#pragma unroll
  for (int g = 0; g < MAX_GROUP; ++g) {
    m[g] = -INFINITY;
    l[g] = 0.0f;
#pragma unroll
    for (int i = 0; i < REGS; ++i) acc[g][i] = 0.0f;
  }

  // Each step's K and V are staged in shared memory (async_copy16) one step ahead: while a warp computes a
  // step, the next one's loads are in flight, without holding them in registers. Every thread reads back only
  // its own copies, so the stages need no barrier.
  DYNAMIC_SHARED(uint4, staged);
  if (dynamic_shared_bytes() < decode_shared_bytes<HEAD_DIM, MAX_GROUP>()) KERNEL_TRAP();
  const size_t token_stride = static_cast<size_t>(num_kv_heads) * HEAD_DIM;
  const size_t head_offset = static_cast<size_t>(kvh) * HEAD_DIM;
  const auto stage_step = [&](int stage, int base, const int(&entries)[UNROLL]) {
    unsigned valid = 0;  // bit u: token u of this sub-group is in the split and in an allocated block
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      const int t = base + u * TOKENS_PER_WARP + sub;
      const bool ok = t < t_end && entries[u] >= 0;
      valid |= static_cast<unsigned>(ok) << u;
      const size_t row = ok ? (static_cast<size_t>(entries[u]) * page_size + t % page_size) * token_stride : 0;
#pragma unroll
      for (int j = 0; j < VPL; ++j) {
        const size_t at = row + head_offset + Layout::dim(lane_in_token, j);
        async_copy16(staged_vec(staged, stage, u * VPL + j), k_pool + at, ok);
        async_copy16(staged_vec(staged, stage, (UNROLL + u) * VPL + j), v_pool + at, ok);
      }
    }
    return valid;
  };

  // Warp-uniform loop: every lane of the warp runs the same steps so the shuffles stay converged. A step takes
  // UNROLL tokens per sub-group; a token's V does not depend on its score, so both are staged together.
  unsigned valid = first < t_end ? stage_step(0, first, blk) : 0u;
  async_commit();
  int stage = 0;
  for (int base = first; base < t_end; base += kBlockTokens) {
    const int next = base + kBlockTokens;
    const unsigned next_valid = next < t_end ? stage_step(stage ^ 1, next, next_blk) : 0u;
    async_commit();
    step_blocks<UNROLL, TOKENS_PER_WARP>(next_blk, table_row, next + kBlockTokens + sub, page_size,
                                         max_blocks_per_seq);
    async_wait<1>();  // this step's copies have landed; the next step's stay in flight
    float s[UNROLL][MAX_GROUP];  // each K element is widened once and used for every head of the block
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
#pragma unroll
      for (int g = 0; g < MAX_GROUP; ++g) s[u][g] = 0.0f;
#pragma unroll
      for (int j = 0; j < VPL; ++j) {
        const uint4 kr = *staged_vec(staged, stage, u * VPL + j);
#pragma unroll
        for (int i = 0; i < VEC; ++i) {
          const float k = raw_elem<T>(kr, i);
#pragma unroll
          for (int g = 0; g < MAX_GROUP; ++g) s[u][g] += qr[g][j * VEC + i] * k;
        }
      }
    }
#pragma unroll
    for (int off = LANES_PER_TOKEN / 2; off > 0; off >>= 1) {
#pragma unroll
      for (int u = 0; u < UNROLL; ++u) {
#pragma unroll
        for (int g = 0; g < MAX_GROUP; ++g) {
          if (g < heads) s[u][g] += __shfl_xor_sync(kFullMask, s[u][g], off);
        }
      }
    }
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      if (valid >> u & 1u) {
        float alpha[MAX_GROUP];  // the online softmax's rescale of each head's state, and this token's weight
        float p[MAX_GROUP];
#pragma unroll
        for (int g = 0; g < MAX_GROUP; ++g) {
          const float m_new = fmaxf(m[g], s[u][g]);
          alpha[g] = g < heads ? exp2_diff(m[g], m_new) : 1.0f;
          p[g] = g < heads ? exp2f(s[u][g] - m_new) : 0.0f;
          l[g] = l[g] * alpha[g] + p[g];
          m[g] = g < heads ? m_new : m[g];
        }
#pragma unroll
        for (int j = 0; j < VPL; ++j) {
          const uint4 vr = *staged_vec(staged, stage, (UNROLL + u) * VPL + j);
#pragma unroll
          for (int i = 0; i < VEC; ++i) {
            const float v = raw_elem<T>(vr, i);  // widened once for every head of the block
#pragma unroll
            for (int g = 0; g < MAX_GROUP; ++g) acc[g][j * VEC + i] = acc[g][j * VEC + i] * alpha[g] + p[g] * v;
          }
        }
      }
    }
    valid = next_valid;
    stage ^= 1;
  }
  async_wait<0>();

  // Merge the sub-groups of the warp (lanes with the same dims, different tokens).
#pragma unroll
  for (int off = LANES_PER_TOKEN; off < kWarpSize; off <<= 1) {
#pragma unroll
    for (int g = 0; g < MAX_GROUP; ++g) {
      if (g < heads) {
        const float m_o = __shfl_xor_sync(kFullMask, m[g], off);
        const float l_o = __shfl_xor_sync(kFullMask, l[g], off);
        const float m_new = fmaxf(m[g], m_o);
        const float a = exp2_diff(m[g], m_new);
        const float c = exp2_diff(m_o, m_new);
        l[g] = l[g] * a + l_o * c;
#pragma unroll
        for (int i = 0; i < REGS; ++i) {
          const float acc_o = __shfl_xor_sync(kFullMask, acc[g][i], off);
          acc[g][i] = acc[g][i] * a + acc_o * c;
        }
        m[g] = m_new;
      }
    }
  }

  // Merge the warps through shared memory: acc [warps][MAX_GROUP][HEAD_DIM], then m and l [warps][MAX_GROUP],
  // over the staging area once every warp is done with it.
  __syncthreads();
  float* smem_acc = reinterpret_cast<float*>(staged);
  float* smem_m = smem_acc + kDecodeWarps * MAX_GROUP * HEAD_DIM;
  float* smem_l = smem_m + kDecodeWarps * MAX_GROUP;
  if (sub == 0) {
#pragma unroll
    for (int g = 0; g < MAX_GROUP; ++g) {
      if (g < heads) {
#pragma unroll
        for (int j = 0; j < VPL; ++j) {
#pragma unroll
          for (int i = 0; i < VEC; ++i) {
            smem_acc[(warp * MAX_GROUP + g) * HEAD_DIM + Layout::dim(lane_in_token, j) + i] = acc[g][j * VEC + i];
          }
        }
        if (lane == 0) {
          smem_m[warp * MAX_GROUP + g] = m[g];
          smem_l[warp * MAX_GROUP + g] = l[g];
        }
      }
    }
  }
  __syncthreads();

  for (int idx = threadIdx.x; idx < heads * HEAD_DIM; idx += blockDim.x) {
    const int g = idx / HEAD_DIM;
    const int d = idx % HEAD_DIM;
    float m_all = -INFINITY;
#pragma unroll
    for (int w = 0; w < kDecodeWarps; ++w) m_all = fmaxf(m_all, smem_m[w * MAX_GROUP + g]);
    float l_all = 0.0f;
    float o_all = 0.0f;
#pragma unroll
    for (int w = 0; w < kDecodeWarps; ++w) {
      const float wgt = exp2_diff(smem_m[w * MAX_GROUP + g], m_all);
      l_all += smem_l[w * MAX_GROUP + g] * wgt;
      o_all += smem_acc[(w * MAX_GROUP + g) * HEAD_DIM + d] * wgt;
    }
    const float o = l_all > 0.0f ? o_all / l_all : 0.0f;
    const size_t head_row = static_cast<size_t>(b) * num_heads + head0 + g;
    if (num_splits == 1) {
      out[head_row * HEAD_DIM + d] = from_float<T>(o);
    } else {
      const size_t prow = head_row * num_splits + split;
      partial_out[prow * HEAD_DIM + d] = o;
      if (d == 0) partial_lse[prow] = l_all > 0.0f ? m_all + log2f(l_all) : -INFINITY;
    }
  }
  if (num_splits == 1 || !last_to_finish(counters + static_cast<size_t>(b) * gridDim.x + blockIdx.x, num_splits))
    return;
  combine_splits<T, HEAD_DIM>(out, partial_out, partial_lse, static_cast<size_t>(b) * num_heads + head0, heads,
                              num_splits);
}

}  // namespace orin_vlm

// ---- extern "C" instantiations: paged_decode_attention_<dtype>_d<head_dim>_g<max_group> ----
#define ORIN_DECODE_KERNEL(DT, T, D, G)                                                                         \
  extern "C" __global__ void __launch_bounds__(orin_vlm::kDecodeWarps * 32, orin_vlm::decode_min_blocks(G)) \
      paged_decode_attention_##DT##_d##D##_g##G(                                                              \
          T* out, float* partial_out, float* partial_lse, unsigned* counters, const T* q, const T* k_pool,    \
          const T* v_pool,                                                                                    \
          const int* block_tables, const int* seq_lens, int num_heads, int num_kv_heads, int page_size,       \
          int max_blocks_per_seq, int tokens_per_split, int q_token_stride, float scale) {                    \
    KERNEL_PROLOGUE();                                                                                        \
    orin_vlm::paged_decode_attention<T, D, G>(out, partial_out, partial_lse, counters, q, k_pool, v_pool,     \
                                              block_tables,                                                   \
                                              seq_lens, num_heads, num_kv_heads, page_size,                   \
                                              max_blocks_per_seq, tokens_per_split, q_token_stride, scale);   \
  }

#define ORIN_DECODE_KERNELS_FOR(DT, T, D) \
  ORIN_DECODE_KERNEL(DT, T, D, 1)         \
  ORIN_DECODE_KERNEL(DT, T, D, 2)         \
  ORIN_DECODE_KERNEL(DT, T, D, 4)         \
  ORIN_DECODE_KERNEL(DT, T, D, 8)

// Every storage type for one head size (the list of head sizes is ORIN_FOR_EACH_HEAD_DIM in attention_common.cuh).
#define ORIN_DECODE_FOR_HEAD_DIM(D)                            \
  ORIN_WITH_f32(ORIN_DECODE_KERNELS_FOR(f32, float, D))        \
  ORIN_WITH_f16(ORIN_DECODE_KERNELS_FOR(f16, __half, D))       \
  ORIN_WITH_bf16(ORIN_DECODE_KERNELS_FOR(bf16, __nv_bfloat16, D))

ORIN_FOR_EACH_HEAD_DIM(ORIN_DECODE_FOR_HEAD_DIM)
