// Generic ctypes-facing launcher: unpacks 8-byte argument slots into a kernel's parameter types
// (pointers, integers, floats) and runs it under the emulator. The Python side generates one
// `extern "C" int emu_launch_<kernel>(...)` per kernel that forwards here.
#pragma once

#include <stdint.h>
#include <string.h>

#include <tuple>
#include <type_traits>
#include <utility>

#include "cuda_emu.h"

namespace cuemu {

template <typename A>
A from_slot(uint64_t s) {
  if constexpr (std::is_pointer<A>::value) {
    return reinterpret_cast<A>(static_cast<uintptr_t>(s));
  } else if constexpr (std::is_same<A, float>::value) {
    const uint32_t bits = static_cast<uint32_t>(s);
    float f;
    memcpy(&f, &bits, 4);
    return f;
  } else {
    static_assert(std::is_integral<A>::value, "kernel parameter type not supported by the harness");
    return static_cast<A>(static_cast<int64_t>(s));
  }
}

template <typename... A>
struct PackedCall {
  void (*fn)(A...);
  std::tuple<A...> args;
};

template <typename... A, size_t... I>
void invoke_packed(PackedCall<A...>* call, std::index_sequence<I...>) {
  call->fn(std::get<I>(call->args)...);
}

template <typename... A>
void packed_body(void* p) {
  invoke_packed(static_cast<PackedCall<A...>*>(p), std::index_sequence_for<A...>{});
}

template <typename... A, size_t... I>
std::tuple<A...> unpack(const uint64_t* slots, std::index_sequence<I...>) {
  return std::tuple<A...>(from_slot<A>(slots[I])...);
}

// cfg6: grid x,y,z, block x,y,z.
template <typename... A>
int launch_packed(void (*fn)(A...), const unsigned* cfg6, uint64_t smem, const uint64_t* slots, int nslots) {
  if (nslots != static_cast<int>(sizeof...(A))) return -2;  // argument count mismatch
  PackedCall<A...> call{fn, unpack<A...>(slots, std::index_sequence_for<A...>{})};
  LaunchConfig cfg{dim3(cfg6[0], cfg6[1], cfg6[2]), dim3(cfg6[3], cfg6[4], cfg6[5]), static_cast<size_t>(smem)};
  return launch(cfg, &packed_body<A...>, &call);
}

}  // namespace cuemu
