// Paged KV WRITE: store new K/V rows into the paged pools.
//
// paged_kv_write_<dtype>: a batch of tokens, token i to physical slot slot_mapping[i] (int64; negative =
//   padding, skipped). Used by prefill and by eager decode.
// A captured CUDA-graph decode step uses the same kernel: its slot mapping is a fixed device buffer the host
// refills before every replay.
//
// A pool row (one token, all kv heads) is row_elems = num_kv_heads*head_dim contiguous elements, at
// pool + slot*row_elems (pool layout [num_blocks, page_size, num_kv_heads, head_dim]). Rows are copied in
// 16-byte vectors without conversion (k/v must already have the pool dtype).
#include "attention_common.cuh"

namespace orin_vlm {

template <typename T>
__device__ __forceinline__ void copy_row(T* __restrict__ k_pool, T* __restrict__ v_pool, const T* __restrict__ k,
                                         const T* __restrict__ v, long long slot, size_t src_row, int row_elems) {
  constexpr int VEC = Vec<T>::kElems;
  if (row_elems % VEC != 0) KERNEL_TRAP();
  const size_t dst = static_cast<size_t>(slot) * row_elems;
  const size_t src = src_row * row_elems;
  for (int c = threadIdx.x * VEC; c < row_elems; c += blockDim.x * VEC) {
    copy_vec(k_pool + dst + c, k + src + c);
    copy_vec(v_pool + dst + c, v + src + c);
  }
}

// Grid: (num_tokens); block: any multiple of 32 (launch.py picks it).
template <typename T>
__device__ __forceinline__ void paged_kv_write(T* __restrict__ k_pool, T* __restrict__ v_pool,
                                               const T* __restrict__ k,  // [num_tokens, num_kv_heads, D]
                                               const T* __restrict__ v,
                                               const long long* __restrict__ slot_mapping,  // [num_tokens]
                                               int row_elems) {
  const long long slot = __ldg(slot_mapping + blockIdx.x);
  if (slot < 0) return;
  copy_row(k_pool, v_pool, k, v, slot, blockIdx.x, row_elems);
}

}  // namespace orin_vlm

#define ORIN_KV_WRITE_KERNELS(DT, T)                                                                           \
  extern "C" __global__ void paged_kv_write_##DT(T* k_pool, T* v_pool, const T* k, const T* v,                 \
                                                 const long long* slot_mapping, int row_elems) {               \
    KERNEL_PROLOGUE();                                                                                         \
    orin_vlm::paged_kv_write<T>(k_pool, v_pool, k, v, slot_mapping, row_elems);                                \
  }

ORIN_WITH_f32(ORIN_KV_WRITE_KERNELS(f32, float))
ORIN_WITH_f16(ORIN_KV_WRITE_KERNELS(f16, __half))
ORIN_WITH_bf16(ORIN_KV_WRITE_KERNELS(bf16, __nv_bfloat16))
