// SILU AND MUL: the SwiGLU activation of the fused gate/up projection, silu(gate) * up, in one kernel where
// torch runs two (and, with the halves of one product, reads them through strided views).
//
// silu_mul_<dtype>: gate_up [rows, 2 * inter] (gate columns first, then up, as the fused projection stores
// them) -> out [rows, inter]. torch's arithmetic (attention_common.cuh: swiglu_value): silu in fp32 as
// x / (1 + exp(-x)) rounded to the storage type, then the product with up in fp32 rounded again. A decode
// step's few rows take the GEMV kernel's SwiGLU launch instead (gemv.cuh); this kernel serves the rest.
#include "attention_common.cuh"

namespace orin_vlm {

constexpr int kSiluThreads = 256;

// Grid: (ceil(rows * inter / kSiluThreads)); block: kSiluThreads threads; one output element per thread.
template <typename T>
__device__ __forceinline__ void silu_mul(T* __restrict__ out, const T* __restrict__ gate_up, int rows, int inter) {
  if (blockDim.x != kSiluThreads) KERNEL_TRAP();
  const long long i = static_cast<long long>(blockIdx.x) * kSiluThreads + threadIdx.x;
  if (i >= static_cast<long long>(rows) * inter) return;
  const long long r = i / inter;
  const long long c = i % inter;
  const T* row = gate_up + r * 2 * inter;
  out[i] = from_float<T>(swiglu_value<T>(to_float(__ldg(row + c)), to_float(__ldg(row + inter + c))));
}

}  // namespace orin_vlm

#define ORIN_SILU_MUL_KERNEL(DT, T)                                                                    \
  extern "C" __global__ void __launch_bounds__(orin_vlm::kSiluThreads)                                \
      silu_mul_##DT(T* out, const T* gate_up, int rows, int inter) {                                   \
    KERNEL_PROLOGUE();                                                                                 \
    orin_vlm::silu_mul<T>(out, gate_up, rows, inter);                                                  \
  }

ORIN_WITH_f32(ORIN_SILU_MUL_KERNEL(f32, float))
ORIN_WITH_f16(ORIN_SILU_MUL_KERNEL(f16, __half))
ORIN_WITH_bf16(ORIN_SILU_MUL_KERNEL(bf16, __nv_bfloat16))
