// CPU emulation of the CUDA execution model, just enough to run our kernels unchanged under g++.
//
// Blocks of a grid run one after another, in a scrambled order (a GPU promises none); the threads of a block
// run as fibers (ucontext), switched cooperatively at barriers: __syncthreads() waits for every live thread
// of the block, warp shuffles and __syncwarp() wait for every live lane of the warp. Because only one block is alive at a time,
// `__shared__` can be `static`. Dynamic shared memory is a per-launch buffer, filled with NaN bytes
// before each block so a read of an unwritten element shows up in the results.
// Global loads through __ldg are bounds-checked against the buffers the driver registered.
// Included only through kernels/compat.cuh when __CUDACC__ is not defined.
#pragma once

#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include <type_traits>

// ---- vector and index types ----
struct dim3 {
  unsigned x, y, z;
  constexpr dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};
struct uint3 {
  unsigned x, y, z;
};
struct alignas(16) uint4 {
  unsigned x, y, z, w;
};
inline uint4 make_uint4(unsigned x, unsigned y, unsigned z, unsigned w) { return uint4{x, y, z, w}; }
struct alignas(8) float2 {
  float x, y;
};
struct alignas(16) float4 {
  float x, y, z, w;
};

namespace cuemu {
const uint3& thread_idx();
const uint3& block_idx();
const dim3& block_dim();
const dim3& grid_dim();
void* dynamic_smem();
size_t dynamic_smem_bytes();
void syncthreads();
void syncwarp(unsigned mask);
[[noreturn]] void trap(const char* why);
void check_read(const void* p, size_t bytes);
// Shuffle core: every live lane of the warp publishes `bytes` of `value`; returns the bytes of lane `src`.
void warp_exchange(const void* value, void* result, size_t bytes, unsigned mask, int src_lane);
int lane_id();

template <typename T>
inline T shfl_from(unsigned mask, T v, int src) {
  static_assert(sizeof(T) <= 8 && std::is_trivially_copyable<T>::value, "shuffle of an unsupported type");
  T r;
  warp_exchange(&v, &r, sizeof(T), mask, src);
  return r;
}
}  // namespace cuemu

#define threadIdx (::cuemu::thread_idx())
#define blockIdx (::cuemu::block_idx())
#define blockDim (::cuemu::block_dim())
#define gridDim (::cuemu::grid_dim())
#define warpSize 32

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline __attribute__((always_inline))
#define __shared__ static
#define __align__(n) __attribute__((aligned(n)))
#define __launch_bounds__(...)
#define DYNAMIC_SHARED(type, name) type* name = reinterpret_cast<type*>(::cuemu::dynamic_smem())
#define KERNEL_TRAP() ::cuemu::trap("kernel trap (launch configuration does not match the kernel)")

inline void __syncthreads() { cuemu::syncthreads(); }
inline void __syncwarp(unsigned mask = 0xffffffffu) { cuemu::syncwarp(mask); }
[[noreturn]] inline void __trap() { cuemu::trap("__trap()"); }

template <typename T>
inline T __ldg(const T* p) {
  cuemu::check_read(p, sizeof(T));
  return *p;
}
// A load past the non-coherent cache (of data other blocks of the launch wrote): the same checked read here.
template <typename T>
inline T __ldcg(const T* p) {
  cuemu::check_read(p, sizeof(T));
  return *p;
}
// Blocks run one after another and the threads of a block switch only at barriers: an atomic is a plain
// read-modify-write and a fence has nothing to order.
inline unsigned atomicAdd(unsigned* p, unsigned v) {
  const unsigned old = *p;
  *p = old + v;
  return old;
}
inline void __threadfence() {}

// Warp shuffles with CUDA's out-of-segment rule: a source outside the caller's width-segment yields
// the caller's own value.
template <typename T>
inline T __shfl_sync(unsigned mask, T v, int src, int width = 32) {
  const int lane = cuemu::lane_id();
  const int base = lane & ~(width - 1);
  return cuemu::shfl_from(mask, v, base + (src % width));
}
template <typename T>
inline T __shfl_xor_sync(unsigned mask, T v, int lane_mask, int width = 32) {
  const int lane = cuemu::lane_id();
  const int base = lane & ~(width - 1);
  int src = lane ^ lane_mask;
  if (src < base || src >= base + width) src = lane;
  return cuemu::shfl_from(mask, v, src);
}
template <typename T>
inline T __shfl_down_sync(unsigned mask, T v, unsigned delta, int width = 32) {
  const int lane = cuemu::lane_id();
  const int base = lane & ~(width - 1);
  int src = lane + static_cast<int>(delta);
  if (src >= base + width) src = lane;
  return cuemu::shfl_from(mask, v, src);
}
template <typename T>
inline T __shfl_up_sync(unsigned mask, T v, unsigned delta, int width = 32) {
  const int lane = cuemu::lane_id();
  const int base = lane & ~(width - 1);
  int src = lane - static_cast<int>(delta);
  if (src < base) src = lane;
  return cuemu::shfl_from(mask, v, src);
}

// ---- device math the kernels use ----
inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }
inline float __expf(float x) { return expf(x); }
inline float __fdividef(float a, float b) { return a / b; }
inline float rsqrtf(float x) { return 1.0f / sqrtf(x); }
// Round-to-nearest products and sums, never contracted into a fused multiply-add (torch's separate ops).
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fadd_rn(float a, float b) { return a + b; }

// Bit reinterpretation.
inline float __uint_as_float(unsigned u) {
  float f;
  memcpy(&f, &u, 4);
  return f;
}
inline unsigned __float_as_uint(float f) {
  unsigned u;
  memcpy(&u, &f, 4);
  return u;
}
// Position of the least significant set bit, from 1 (0 when none).
inline int __ffs(int x) { return __builtin_ffs(x); }
// The byte permute (PTX prmt, default mode): byte n of the result is byte s[4n+2:4n] of the eight bytes y:x
// (x bytes 0..3, y bytes 4..7).
inline unsigned __byte_perm(unsigned x, unsigned y, unsigned s) {
  const uint64_t bytes = (static_cast<uint64_t>(y) << 32) | x;
  unsigned r = 0;
  for (int n = 0; n < 4; ++n) r |= static_cast<unsigned>((bytes >> (8 * ((s >> (4 * n)) & 7u))) & 0xFFu) << (8 * n);
  return r;
}

// ---- half precision: 16-bit storage, conversions through _Float16 (IEEE binary16, round to nearest) ----
struct __half {
  unsigned short __x;
};
struct alignas(4) __half2 {
  __half x, y;
};
inline float __half2float(__half h) {
  _Float16 f;
  memcpy(&f, &h.__x, 2);
  return static_cast<float>(f);
}
inline __half __float2half_rn(float x) {
  const _Float16 f = static_cast<_Float16>(x);
  __half h;
  memcpy(&h.__x, &f, 2);
  return h;
}
inline __half __float2half(float x) { return __float2half_rn(x); }
inline float2 __half22float2(__half2 h) { return float2{__half2float(h.x), __half2float(h.y)}; }
inline __half2 __floats2half2_rn(float a, float b) { return __half2{__float2half_rn(a), __float2half_rn(b)}; }

// ---- bfloat16: the high 16 bits of an fp32, round to nearest even (NaN stays NaN) ----
struct __nv_bfloat16 {
  unsigned short __x;
};
struct alignas(4) __nv_bfloat162 {
  __nv_bfloat16 x, y;
};
inline float __bfloat162float(__nv_bfloat16 h) { return __uint_as_float(static_cast<uint32_t>(h.__x) << 16); }
inline __nv_bfloat16 __float2bfloat16_rn(float x) {
  uint32_t u = __float_as_uint(x);
  __nv_bfloat16 h;
  if ((u & 0x7fffffffu) > 0x7f800000u) {
    h.__x = static_cast<unsigned short>((u >> 16) | 0x40u);  // quiet NaN
  } else {
    u += 0x7fffu + ((u >> 16) & 1u);
    h.__x = static_cast<unsigned short>(u >> 16);
  }
  return h;
}
inline __nv_bfloat16 __float2bfloat16(float x) { return __float2bfloat16_rn(x); }
inline float2 __bfloat1622float2(__nv_bfloat162 h) { return float2{__bfloat162float(h.x), __bfloat162float(h.y)}; }

// ---- host side: launching ----
namespace cuemu {
struct LaunchConfig {
  dim3 grid;
  dim3 block;
  size_t dynamic_smem_bytes;
};
// Runs body() once per thread of every block. Returns 0, or -1 with last_error() set (trap, bad read,
// deadlock at a barrier, invalid configuration).
int launch(const LaunchConfig& cfg, void (*body)(void*), void* ctx);
const char* last_error();
void set_read_ranges(const uint64_t* starts, const uint64_t* sizes, int n);
}  // namespace cuemu
