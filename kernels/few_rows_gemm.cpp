// y = x @ w.T for the 1..8 rows of a CPU decode step: the weight is read once for all rows. Weights fp32 or
// bf16 (widened in registers), activations and accumulation fp32.
//
// A decode step multiplies a few activation rows (one per sequence of the batch) by large weight matrices,
// so it is bound by reading the weights. BLAS small-M GEMMs read the weight once per row on some CPUs
// (four rows cost four times one), which makes batching several requests worthless; here every block of
// NR weight rows is loaded once into registers and multiplied by MR activation rows, so four rows cost
// about 1.3 times one on a 2B-shape projection (docs/architecture.md, bench/README.md).
//
// Batch invariance: every output element is summed in the same order whatever the row count, the tile or
// the thread split (8-lane fused multiply-add partial sums over K in steps of 8, a fixed pairwise reduction
// of the lanes, then the K tail), so a sequence's logits are bit-identical alone and in a batch.
//
// Compiled on the machine that runs it (node startup, cached) with GCC/Clang vector extensions: 8-float
// vectors become AVX/AVX2 registers on x86-64 and pairs of NEON registers on a Jetson's Arm cores.
#include <cstddef>
#include <cstdint>
#include <cstring>

namespace {

constexpr int kMaxRows = 8;  // the row counts `rows` has tiles for

typedef float v8 __attribute__((vector_size(32)));
typedef uint16_t u16x8 __attribute__((vector_size(16)));
typedef uint32_t u32x8 __attribute__((vector_size(32)));

// bfloat16 is the upper half of a float32: weights in bf16 are stored as their 16 bits.
struct bf16 {
  uint16_t bits;
};

inline v8 load8(const float *p) {
  v8 v;
  std::memcpy(&v, p, sizeof v);  // unaligned load
  return v;
}

inline v8 load8(const bf16 *p) {  // 8 bf16 widened exactly to fp32
  u16x8 h;
  std::memcpy(&h, p, sizeof h);
  const u32x8 wide = __builtin_convertvector(h, u32x8) << 16;
  v8 v;
  std::memcpy(&v, &wide, sizeof v);
  return v;
}

inline float widen(float v) { return v; }

inline float widen(bf16 v) {
  const uint32_t wide = uint32_t(v.bits) << 16;
  float f;
  std::memcpy(&f, &wide, sizeof f);
  return f;
}

// c + a * b rounded once, spelled out: compilers contract a * b + c into an FMA in some loops and not in
// others (GCC leaves a lone accumulator as multiply + add), which would make a row's sum depend on the tile,
// so the library is built with -ffp-contract=off and every product goes through here.
inline v8 fma8(v8 a, v8 b, v8 c) {
#if defined(__FMA__) || defined(__aarch64__)
  v8 r;
#pragma GCC unroll 8
  for (int i = 0; i < 8; ++i) r[i] = __builtin_fmaf(a[i], b[i], c[i]);
  return r;
#else  // no fused multiply-add in hardware (x86 before Haswell): a libm call per lane would crawl
  return a * b + c;
#endif
}

inline float lane_sum(v8 v) { return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7])); }

// MR activation rows x NR weight rows: y[m][r] = sum_k x[m][k] * w[r][k]. x rows are k apart, y rows n apart.
template <int MR, int NR, typename W>
inline void tile(const float *x, const W *w, float *y, int k, int n) {
  v8 acc[MR][NR] = {};
  int kk = 0;
  for (; kk + 8 <= k; kk += 8) {
    v8 wv[NR];
#pragma GCC unroll 8
    for (int r = 0; r < NR; ++r) wv[r] = load8(w + (size_t)r * k + kk);
#pragma GCC unroll 8
    for (int m = 0; m < MR; ++m) {
      const v8 xv = load8(x + (size_t)m * k + kk);
#pragma GCC unroll 8
      for (int r = 0; r < NR; ++r) acc[m][r] = fma8(wv[r], xv, acc[m][r]);
    }
  }
  for (int m = 0; m < MR; ++m) {
    for (int r = 0; r < NR; ++r) {
      float s = lane_sum(acc[m][r]);
      for (int j = kk; j < k; ++j) s += x[(size_t)m * k + j] * widen(w[(size_t)r * k + j]);
      y[(size_t)m * n + r] = s;
    }
  }
}

// Weight rows [n0, n1) in blocks of NR (the rest one by one); the activation rows in groups G... (each
// group one tile, so the accumulators of a group fit the 16 vector registers).
template <int NR, int... G, typename W>
void weight_rows(const float *x, const W *w, float *y, int n, int k, int n0, int n1) {
  for (; n0 + NR <= n1; n0 += NR) {
    int m0 = 0;
    ((tile<G, NR>(x + (size_t)m0 * k, w + (size_t)n0 * k, y + (size_t)m0 * n + n0, k, n), m0 += G), ...);
  }
  for (; n0 < n1; ++n0) {
    int m0 = 0;
    ((tile<G, 1>(x + (size_t)m0 * k, w + (size_t)n0 * k, y + (size_t)m0 * n + n0, k, n), m0 += G), ...);
  }
}

// The tiles per row count, the fastest measured on 2B-shape projections (AVX2, one thread).
template <typename W>
void rows(const float *x, const W *w, float *y, int m, int n, int k, int n0, int n1) {
  switch (m) {
    case 1: weight_rows<8, 1>(x, w, y, n, k, n0, n1); return;
    case 2: weight_rows<5, 2>(x, w, y, n, k, n0, n1); return;
    case 3: weight_rows<4, 3>(x, w, y, n, k, n0, n1); return;
    case 4: weight_rows<3, 4>(x, w, y, n, k, n0, n1); return;
    case 5: weight_rows<2, 5>(x, w, y, n, k, n0, n1); return;
    case 6: weight_rows<2, 6>(x, w, y, n, k, n0, n1); return;
    case 7: weight_rows<2, 7>(x, w, y, n, k, n0, n1); return;
    case 8: weight_rows<3, 4, 4>(x, w, y, n, k, n0, n1); return;
  }
}

// x (m, k) fp32, w (n, k), y (m, n) fp32, all contiguous. The weight rows are split into `threads`
// contiguous chunks (multiples of 120, a multiple of every tile's NR), one per OpenMP thread. The library
// is linked with -fopenmp against libgomp.so.1, which resolves to the runtime torch already loaded, so the
// chunks run on torch's own worker threads: a thread of our own would compete with those workers, which
// spin for a while after every torch op (two threads were slower than one between torch ops).
template <typename W>
int gemm(const float *x, const W *w, float *y, int m, int n, int k, int threads) {
  if (m < 1 || m > kMaxRows) return -1;
  if (threads < 1) threads = 1;
  const int align = 120;
  const int chunk = ((n + threads - 1) / threads + align - 1) / align * align;
  const int chunks = (n + chunk - 1) / chunk;
#pragma omp parallel for num_threads(chunks) schedule(static, 1) if (chunks > 1)
  for (int c = 0; c < chunks; ++c) {
    const int n0 = c * chunk;
    rows(x, w, y, m, n, k, n0, n0 + chunk < n ? n0 + chunk : n);
  }
  return 0;
}

}  // namespace

extern "C" {

int few_rows_gemm_max_rows() { return kMaxRows; }

// Return 0, or -1 when m is outside 1..few_rows_gemm_max_rows() (nothing written).
int few_rows_gemm_f32(const float *x, const float *w, float *y, int m, int n, int k, int threads) {
  return gemm(x, w, y, m, n, k, threads);
}

int few_rows_gemm_bf16(const float *x, const bf16 *w, float *y, int m, int n, int k, int threads) {
  return gemm(x, w, y, m, n, k, threads);
}

}  // extern "C"
