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
