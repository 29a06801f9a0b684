// Portability layer: the same kernel sources compile with nvcc (real CUDA) and with g++ inside the CPU
// harness (test/cuda_harness/cuda_emu.h), which runs every thread of a block as a fiber.
//
// Kernels use only plain CUDA spellings (threadIdx, __shared__, __syncthreads, __shfl_xor_sync, __ldg,
// __half, __nv_bfloat16, ...) plus the two macros defined here:
//   DYNAMIC_SHARED(type, name)  declares `type* name` pointing at the block's dynamic shared memory.
//   KERNEL_TRAP()               aborts the launch (a launch-configuration bug), like __trap().
//   dynamic_shared_bytes()      the dynamic shared memory the launch gave the block (a kernel that needs more
//                               traps instead of writing past it).
//   async_copy16 / async_commit / async_wait<N>   global -> shared copies in flight while a thread computes.
//   KERNEL_PROLOGUE()           the first statement of every kernel (programmatic dependent launch, below;
//                               its two halves, and prefetch_l2 between them, for the GEMV).
//   ORIN_WITH_f32/f16/bf16(...) the kernels of one storage type, or nothing in a build for another (below).
#pragma once

// Every module instantiates its kernels for three storage and activation types (f32, f16, bf16), each type's
// extern "C" kernels wrapped in its ORIN_WITH_<tag>(...). A build that defines ORIN_ONLY_DTYPE_<tag> keeps that
// type's kernels only: the node builds each module for its model's dtype (build.py), a third of the code for
// nvcc to compile at a cold start and for the GPU to hold; without the define (the CPU harness, the strict
// nvcc test, the diagnostics of every type) all three.
#if defined(ORIN_ONLY_DTYPE_f32) + defined(ORIN_ONLY_DTYPE_f16) + defined(ORIN_ONLY_DTYPE_bf16) > 1
#error "define at most one ORIN_ONLY_DTYPE_<tag>"
#endif
#if defined(ORIN_ONLY_DTYPE_f16) || defined(ORIN_ONLY_DTYPE_bf16)
#define ORIN_WITH_f32(...)
#else
#define ORIN_WITH_f32(...) __VA_ARGS__
#endif
#if defined(ORIN_ONLY_DTYPE_f32) || defined(ORIN_ONLY_DTYPE_bf16)
#define ORIN_WITH_f16(...)
#else
#define ORIN_WITH_f16(...) __VA_ARGS__
#endif
#if defined(ORIN_ONLY_DTYPE_f32) || defined(ORIN_ONLY_DTYPE_f16)
#define ORIN_WITH_bf16(...)
#else
#define ORIN_WITH_bf16(...) __VA_ARGS__
#endif

#ifdef __CUDACC__
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

#define DYNAMIC_SHARED(type, name)                              \
  extern __shared__ __align__(16) unsigned char name##_raw_[]; \
  type* name = reinterpret_cast<type*>(name##_raw_)
#define KERNEL_TRAP() __trap()
__device__ __forceinline__ unsigned dynamic_shared_bytes() {
  unsigned bytes;
  asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(bytes));
  return bytes;
}

#else  // CPU harness build (g++)
#include "cuda_emu.h"
inline unsigned dynamic_shared_bytes() { return static_cast<unsigned>(::cuemu::dynamic_smem_bytes()); }
#endif

// Programmatic dependent launch (sm_90 and later). The runtime launches kernels with the attribute that lets
// a kernel start while the one before it on the stream is still running, so its blocks are resident and past
// their launch when that one ends (about a microsecond a kernel, 8 a decode layer). Every kernel therefore
// begins with KERNEL_PROLOGUE: it lets the next kernel be launched (KERNEL_ALLOW_DEPENDENTS:
// griddepcontrol.launch_dependents), then waits until the kernel before it has finished and its stores are
// visible (KERNEL_WAIT_PREDECESSOR: griddepcontrol.wait), before it reads or writes global memory. Since
// that kernel waited for its own predecessor the same way, every earlier kernel has finished too. Between
// the two a kernel may only ask for L2 prefetches of data no kernel writes (prefetch_l2: the GEMV's weights,
// so they stream in while the previous kernel finishes). Launched without the attribute the wait returns at
// once; before sm_90 (an Orin is sm_87) and in the CPU harness all of it is empty.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define KERNEL_ALLOW_DEPENDENTS() asm volatile("griddepcontrol.launch_dependents;" ::: "memory")
#define KERNEL_WAIT_PREDECESSOR() asm volatile("griddepcontrol.wait;" ::: "memory")
__device__ __forceinline__ void prefetch_l2(const void* p) { asm volatile("prefetch.global.L2 [%0];" ::"l"(p)); }
#else
#define KERNEL_ALLOW_DEPENDENTS() \
  do {                            \
  } while (0)
#define KERNEL_WAIT_PREDECESSOR() \
  do {                            \
  } while (0)
__device__ __forceinline__ void prefetch_l2(const void*) {}
#endif
#define KERNEL_PROLOGUE()    \
  KERNEL_ALLOW_DEPENDENTS(); \
  KERNEL_WAIT_PREDECESSOR()

// Asynchronous 16-byte copies from global into shared memory (sm_80 and later: cp.async, through L2 only),
// so a thread has the next step's loads in flight while it computes on the current step's data without
// holding them in registers. A thread reads back only what it copied itself, after async_wait<N>(): the copies
// it committed before its N most recent groups (async_commit) have landed. An invalid copy writes 16 zero bytes
// and reads nothing (its `src` must still be an address of the buffer). Before sm_80 and in the CPU harness
// the copy is an ordinary load and store, done when it returns, and commit / wait have nothing to do.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
__device__ __forceinline__ void async_copy16(void* dst, const void* src, bool valid) {
  const unsigned at = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(at), "l"(src), "r"(valid ? 16 : 0) : "memory");
}
__device__ __forceinline__ void async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void async_wait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}
#else
__device__ __forceinline__ void async_copy16(void* dst, const void* src, bool valid) {
  *reinterpret_cast<uint4*>(dst) = valid ? __ldg(reinterpret_cast<const uint4*>(src)) : make_uint4(0u, 0u, 0u, 0u);
}
__device__ __forceinline__ void async_commit() {}
template <int N>
__device__ __forceinline__ void async_wait() {}
#endif

// Conversions used by every kernel: storage type <-> fp32 compute type.
__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ float from_float<float>(float x) {
  return x;
}
template <>
__device__ __forceinline__ __half from_float<__half>(float x) {
  return __float2half_rn(x);
}
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}
