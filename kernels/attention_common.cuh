// Helpers shared by the kernels (attention, GEMV, elementwise): 16-byte vector loads/stores, warp reductions,
// block-table address translation. Header-only (templates / forceinline) so every .cu is one module.
#pragma once

#include "compat.cuh"

namespace orin_vlm {

constexpr int kWarpSize = 32;
constexpr unsigned kFullMask = 0xffffffffu;
// log2(e): scores are pre-multiplied by it so the online softmax can use exp2f.
constexpr float kLog2e = 1.4426950408889634f;

// Elements of T in one 16-byte vector (fp32: 4, fp16/bf16: 8).
template <typename T>
struct Vec {
  static constexpr int kElems = 16 / static_cast<int>(sizeof(T));
};

// 16 bytes of T as stored, through the read-only path; `p` must be 16-byte aligned. Four registers whatever
// T is: a half-precision vector held this way until it is used takes half the registers of its widening.
template <typename T>
__device__ __forceinline__ uint4 load_raw(const T* __restrict__ p) {
  return __ldg(reinterpret_cast<const uint4*>(p));
}

// A global load through the read-only cache, or with L2 (data an earlier block of the same launch may have
// written: the chain kernels, gemv.cuh) through L2 only.
template <bool L2, typename V>
__device__ __forceinline__ V load_ro_or_l2(const V* p) {
  if constexpr (L2) return __ldcg(p);
  else return __ldg(p);
}

// Element i of a vector as load_raw returned it, widened to fp32.
template <typename T>
__device__ __forceinline__ float raw_elem(const uint4& raw, int i) {
  return to_float(reinterpret_cast<const T*>(&raw)[i]);
}

// Load 16 bytes (read-only path) and widen to fp32 into out[0 .. Vec<T>::kElems). `p` must be 16-byte aligned.
template <typename T>
__device__ __forceinline__ void load_vec(const T* __restrict__ p, float* __restrict__ out) {
  const uint4 raw = load_raw(p);
#pragma unroll
  for (int i = 0; i < Vec<T>::kElems; ++i) out[i] = raw_elem<T>(raw, i);
}

// Copy one 16-byte vector (KV writes keep the storage type; no conversion).
template <typename T>
__device__ __forceinline__ void copy_vec(T* __restrict__ dst, const T* __restrict__ src) {
  *reinterpret_cast<uint4*>(dst) = __ldg(reinterpret_cast<const uint4*>(src));
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int off = kWarpSize / 2; off > 0; off >>= 1) v = fmaxf(v, __shfl_xor_sync(kFullMask, v, off));
  return v;
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int off = kWarpSize / 2; off > 0; off >>= 1) v += __shfl_xor_sync(kFullMask, v, off);
  return v;
}

// SwiGLU of one element, torch's arithmetic on the storage type T: silu(gate) in fp32 as g / (1 + exp(-g)),
// rounded to T, times up in fp32 (gate and up given as T values widened). The caller rounds the result to T.
template <typename T>
__device__ __forceinline__ float swiglu_value(float gate, float up) {
  return to_float(from_float<T>(gate / (1.0f + expf(-gate)))) * up;
}

// Whether this block is the last of `count` blocks that share `*counter` to get here (every thread calls it
// after its stores). The last block's threads then see every store the others made before the call; they
// read them with __ldcg (not through the read-only cache). The counter is back to 0 for the next launch (a
// CUDA graph replays with the same buffer). One launch uses a counter at a time: launches on one stream.
__device__ __forceinline__ bool last_to_finish(unsigned* counter, int count) {
  __shared__ bool last;
  __threadfence();  // this thread's stores are visible device-wide before the block is counted
  __syncthreads();
  if (threadIdx.x == 0) {
    last = atomicAdd(counter, 1u) == static_cast<unsigned>(count - 1);
    if (last) {
      __threadfence();  // the others' stores, counted before this, are seen by the reads that follow
      *counter = 0u;
    }
  }
  __syncthreads();
  return last;
}

// Tickets and counts of a chained launch (gemv.cuh's chain kernels): one launch computes several products in turn,
// and the blocks of a product may only start once every block of the product before it is done. A block's
// blockIdx says nothing about when it runs (a GPU starts blocks in no promised order), so each block takes a
// ticket as it starts (take_ticket: the order in which blocks started) and the tickets, not blockIdx, say
// which product and which part of it a block computes: the earlier products get the lower tickets. A block
// that waits for a product's count (wait_for_count) waits only for blocks with lower tickets, which have all
// started and hold their place on the GPU, so the count is always reached, however few blocks fit at once.

// This block's ticket: 0, 1, 2 ... in the order the launch's blocks get here (the counter back at 0 after the
// launch: the caller's last block resets it).
__device__ __forceinline__ int take_ticket(unsigned* counter) {
  __shared__ int ticket;
  if (threadIdx.x == 0) ticket = static_cast<int>(atomicAdd(counter, 1u));
  __syncthreads();
  return ticket;
}

// Counts this block done on `counter` once every thread's stores are visible device-wide (every thread calls it
// after its stores).
__device__ __forceinline__ void count_done(unsigned* counter) {
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) atomicAdd(counter, 1u);
}

// Waits until `count` blocks have counted themselves done on `counter` (every thread calls it). The block's
// threads then see the stores those blocks made before counting; they read them with __ldcg (not through the
// read-only cache, nor an L1 line an earlier read of the launch left).
__device__ __forceinline__ void wait_for_count(const unsigned* counter, int count) {
  if (threadIdx.x == 0) {
    poll_at_least(counter, static_cast<unsigned>(count));
    __threadfence();
  }
  __syncthreads();
}

// exp2(a - b) that is 0 (not NaN) when a is -inf, including -inf - -inf.
__device__ __forceinline__ float exp2_diff(float a, float b) { return a == -INFINITY ? 0.0f : exp2f(a - b); }

// Physical block of logical token `t` of a sequence, or -1 when the table entry is unallocated (-1) or
// the token lies past the table row. Callers use the result as an address only when it is >= 0.
__device__ __forceinline__ int physical_block(const int* __restrict__ table_row, int t, int page_size,
                                              int max_blocks_per_seq) {
  const int logical = t / page_size;
  return logical < max_blocks_per_seq ? __ldg(table_row + logical) : -1;
}

}  // namespace orin_vlm

// The head sizes every attention kernel is instantiated for (Qwen3-VL uses 128; 32, 64 and 256 cover
// the embedded default model and other decoders). Mirrored by SUPPORTED_HEAD_DIMS in
// orin_vlm_node/cuda/launch.py: M(D) expands to the kernels of one head size.
#define ORIN_FOR_EACH_HEAD_DIM(M) M(32) M(64) M(128) M(256)
