// Fiber scheduler behind cuda_emu.h. Fibers are created with makecontext; switches use _setjmp/_longjmp
// (no signal-mask system call per switch, which would make barrier-heavy kernels slow).
#include "cuda_emu.h"

#include <setjmp.h>
#include <stdio.h>
#include <stdlib.h>
#include <ucontext.h>

#include <mutex>
#include <string>
#include <vector>

namespace cuemu {
namespace {

enum class State { Ready, WaitBlock, WaitWarp, Done };

struct Fiber {
  ucontext_t uctx;
  jmp_buf jb;
  bool started;
  State state;
  uint3 tid;
  int linear;
  int xchg_parity;
};

constexpr size_t kStackBytes = 128 * 1024;
constexpr size_t kMaxDynamicSmem = 48 * 1024;  // the default per-block limit on every GPU we target

struct Emu {
  std::vector<Fiber> fibers;
  char* stacks = nullptr;
  size_t stacks_for = 0;
  Fiber* cur = nullptr;
  jmp_buf sched;
  uint3 block_idx{0, 0, 0};
  dim3 block_dim;
  dim3 grid_dim;
  unsigned char* smem = nullptr;
  size_t smem_bytes = 0;
  void (*body)(void*) = nullptr;
  void* ctx = nullptr;
  bool failed = false;
  std::string error;
  // Shuffle mailboxes: [warp][parity][lane] 8 bytes each; double-buffered so one barrier per shuffle.
  std::vector<uint64_t> xchg;
  // Live lanes of each warp when its last warp barrier was released (a lane may finish right after).
  std::vector<unsigned> warp_live;
  std::vector<uint64_t> read_starts, read_sizes;
};

Emu g;
std::mutex g_launch_mutex;

void fail(const std::string& why) {
  if (!g.failed) {
    g.failed = true;
    char where[160];
    snprintf(where, sizeof(where), " [block (%u,%u,%u), thread (%u,%u,%u)]", g.block_idx.x, g.block_idx.y,
             g.block_idx.z, g.cur ? g.cur->tid.x : 0u, g.cur ? g.cur->tid.y : 0u, g.cur ? g.cur->tid.z : 0u);
    g.error = why + where;
  }
}

void fiber_main() {
  g.body(g.ctx);
  g.cur->state = State::Done;
  _longjmp(g.sched, 1);
}

void run_fiber(Fiber& f) {
  g.cur = &f;
  if (_setjmp(g.sched) == 0) {
    if (!f.started) {
      f.started = true;
      setcontext(&f.uctx);
    } else {
      _longjmp(f.jb, 1);
    }
  }
  g.cur = nullptr;
}

void yield(State s) {
  Fiber* f = g.cur;
  f->state = s;
  if (_setjmp(f->jb) == 0) _longjmp(g.sched, 1);
}

unsigned live_lanes_of_warp(int warp) {
  unsigned live = 0;
  const int n = static_cast<int>(g.fibers.size());
  for (int lane = 0; lane < 32; ++lane) {
    const int i = warp * 32 + lane;
    if (i < n && g.fibers[i].state != State::Done) live |= 1u << lane;
  }
  return live;
}

void check_mask(unsigned mask, const char* what) {
  const unsigned live = live_lanes_of_warp(g.cur->linear / 32);
  if ((mask & live) != live) {
    char buf[128];
    snprintf(buf, sizeof(buf), "%s with mask 0x%08x leaves out live lanes 0x%08x", what, mask, live);
    trap(buf);
  }
}

// Runs one block to completion. Returns false on failure (error set).
bool run_block() {
  const int n = static_cast<int>(g.fibers.size());
  for (int i = 0; i < n; ++i) {
    Fiber& f = g.fibers[i];
    getcontext(&f.uctx);
    f.uctx.uc_stack.ss_sp = g.stacks + static_cast<size_t>(i) * kStackBytes;
    f.uctx.uc_stack.ss_size = kStackBytes;
    f.uctx.uc_link = nullptr;
    makecontext(&f.uctx, fiber_main, 0);
    f.started = false;
    f.state = State::Ready;
    f.linear = i;
    f.xchg_parity = 0;
    f.tid = uint3{i % g.block_dim.x, (i / g.block_dim.x) % g.block_dim.y, i / (g.block_dim.x * g.block_dim.y)};
  }
  if (g.smem_bytes) memset(g.smem, 0xff, g.smem_bytes);  // NaN pattern: unwritten shared data is visible
  const int warps = (n + 31) / 32;
  for (;;) {
    for (int i = 0; i < n; ++i) {
      if (g.fibers[i].state == State::Ready) {
        run_fiber(g.fibers[i]);
        if (g.failed) return false;
      }
    }
    int live = 0, at_block = 0;
    for (const Fiber& f : g.fibers) {
      if (f.state != State::Done) ++live;
      if (f.state == State::WaitBlock) ++at_block;
    }
    if (live == 0) return true;
    bool released = false;
    if (at_block == live) {
      for (Fiber& f : g.fibers)
        if (f.state == State::WaitBlock) f.state = State::Ready;
      released = true;
    } else {
      for (int w = 0; w < warps; ++w) {
        int lv = 0, waiting = 0;
        for (int i = w * 32; i < n && i < w * 32 + 32; ++i) {
          if (g.fibers[i].state != State::Done) ++lv;
          if (g.fibers[i].state == State::WaitWarp) ++waiting;
        }
        if (lv > 0 && waiting == lv) {
          g.warp_live[w] = live_lanes_of_warp(w);
          for (int i = w * 32; i < n && i < w * 32 + 32; ++i) g.fibers[i].state = State::Ready;
          released = true;
        }
      }
    }
    if (!released) {
      g.cur = nullptr;
      fail("deadlock: threads of one warp wait at different barriers (__syncthreads vs warp shuffle/__syncwarp)");
      return false;
    }
  }
}

}  // namespace

const uint3& thread_idx() { return g.cur->tid; }
const uint3& block_idx() { return g.block_idx; }
const dim3& block_dim() { return g.block_dim; }
const dim3& grid_dim() { return g.grid_dim; }
void* dynamic_smem() { return g.smem; }
size_t dynamic_smem_bytes() { return g.smem_bytes; }
int lane_id() { return g.cur->linear % 32; }

void syncthreads() { yield(State::WaitBlock); }

void syncwarp(unsigned mask) {
  check_mask(mask, "__syncwarp");
  yield(State::WaitWarp);
}

void trap(const char* why) {
  fail(why);
  _longjmp(g.sched, 1);
}

void check_read(const void* p, size_t bytes) {
  if (g.read_starts.empty()) return;
  const uint64_t a = reinterpret_cast<uint64_t>(p);
  for (size_t i = 0; i < g.read_starts.size(); ++i) {
    if (a >= g.read_starts[i] && a + bytes <= g.read_starts[i] + g.read_sizes[i]) return;
  }
  char buf[96];
  snprintf(buf, sizeof(buf), "out-of-bounds global read of %zu bytes at %p", bytes, p);
  trap(buf);
}

void warp_exchange(const void* value, void* result, size_t bytes, unsigned mask, int src_lane) {
  check_mask(mask, "warp shuffle");
  Fiber* f = g.cur;
  const int warp = f->linear / 32;
  const int lane = f->linear % 32;
  const int parity = f->xchg_parity;
  f->xchg_parity ^= 1;
  uint64_t* box = &g.xchg[(static_cast<size_t>(warp) * 2 + parity) * 32];
  memcpy(&box[lane], value, bytes);
  yield(State::WaitWarp);
  const unsigned live = g.warp_live[warp];
  if (src_lane < 0 || src_lane >= 32 || !(live & (1u << src_lane))) trap("warp shuffle reads an inactive lane");
  memcpy(result, &box[src_lane], bytes);
}

const char* last_error() { return g.error.c_str(); }

void set_read_ranges(const uint64_t* starts, const uint64_t* sizes, int n) {
  g.read_starts.assign(starts, starts + n);
  g.read_sizes.assign(sizes, sizes + n);
}

int launch(const LaunchConfig& cfg, void (*body)(void*), void* ctx) {
  std::lock_guard<std::mutex> lock(g_launch_mutex);
  g.failed = false;
  g.error.clear();
  g.cur = nullptr;
  const size_t threads = static_cast<size_t>(cfg.block.x) * cfg.block.y * cfg.block.z;
  if (threads == 0 || threads > 1024 || cfg.grid.x == 0 || cfg.grid.y == 0 || cfg.grid.z == 0 ||
      cfg.grid.y > 65535 || cfg.grid.z > 65535) {
    g.error = "invalid launch configuration (grid or block dimensions)";
    return -1;
  }
  if (cfg.dynamic_smem_bytes > kMaxDynamicSmem) {
    g.error = "dynamic shared memory above the 48 KiB default limit";
    return -1;
  }
  if (g.stacks_for < threads) {
    free(g.stacks);
    g.stacks = static_cast<char*>(aligned_alloc(64, threads * kStackBytes));
    g.stacks_for = threads;
  }
  g.fibers.assign(threads, Fiber{});
  g.xchg.assign(((threads + 31) / 32) * 2 * 32, 0);
  g.warp_live.assign((threads + 31) / 32, 0);
  free(g.smem);
  g.smem_bytes = cfg.dynamic_smem_bytes;
  g.smem = static_cast<unsigned char*>(aligned_alloc(16, (g.smem_bytes + 15) / 16 * 16 + 16));
  g.block_dim = cfg.block;
  g.grid_dim = cfg.grid;
  g.body = body;
  g.ctx = ctx;
  // The blocks run in a scrambled order: i -> i * step mod n, a fixed permutation of the grid (step coprime
  // with n), since a GPU runs them in no particular order; a kernel that depends on the order (e.g. that
  // takes the last block by index for the last to finish) fails here instead of on the GPU.
  const uint64_t nx = cfg.grid.x, nxy = nx * cfg.grid.y, n = nxy * cfg.grid.z;
  uint64_t step = 7919;  // a prime: coprime with n unless n is a multiple of it
  if (n % step == 0) step = 1;
  for (uint64_t i = 0; i < n; ++i) {
    const uint64_t b = i * step % n;
    g.block_idx = uint3{static_cast<unsigned>(b % nx), static_cast<unsigned>(b % nxy / nx), static_cast<unsigned>(b / nxy)};
    if (!run_block()) return -1;
  }
  return 0;
}

}  // namespace cuemu

extern "C" {
const char* cuemu_last_error() { return cuemu::last_error(); }
void cuemu_set_read_ranges(const uint64_t* starts, const uint64_t* sizes, int n) {
  cuemu::set_read_ranges(starts, sizes, n);
}
}
