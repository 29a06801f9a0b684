// y = x @ w.T on the CPU, weights fp32, bf16, int8 or int4 (widened in registers), activations and sums fp32.
// Two kernels: few rows (1..8, a decode step: the weight read once for all rows, dot products along k) and
// many rows (a prefill: the weight packed into k-major panels, activations broadcast, the classic GEMM
// micro-kernel). Both read the weight through a view (Dense, Int4 below), so quantized weights are widened
// in registers as bf16 ones are and never exist as a float copy in memory.
//
// Few rows. A decode step multiplies a few activation rows (one per sequence of the batch) by large weight matrices,
// so it is bound by reading the weights. BLAS small-M GEMMs read the weight once per row on some CPUs
// (four rows cost four times one), which makes batching several requests worthless; here every block of
// NR weight rows is loaded once into registers and multiplied by MR activation rows, so four rows cost
// about 1.3 times one on a 2B-shape projection (docs/architecture.md, bench/README.md).
//
// Batch invariance: every output element is summed in the same order whatever the row count, the tile or
// the thread split (8-lane fused multiply-add partial sums over K in steps of 8, a fixed pairwise reduction
// of the lanes, then the K tail), so a sequence's logits are bit-identical alone and in a batch.
//
// Int4 in few rows. A weight is q * scale + offset of its group of k, so a row's sum over a group is
// scale * sum(x * q) + offset * sum(x): the tile only widens the 4-bit values (one load that zero-extends 8
// bytes, a mask and a shift for the low and high nibbles, two conversions: 16 values) and applies the group's
// two factors once per row, where widening each value to q * scale + offset took twice the instructions and
// made int4 slower than int8 (2B gate+up, one AVX2 core: 4.7 ms against 6.3 before). The low nibbles are the
// even k and the high ones the odd k, so the activations are reordered once per call to match, and their sums
// over each group are made then too (not in every tile, where they also took registers: 4 rows 7.8 ms, was 9.1).
//
// Many rows. A prefill has tens to thousands of rows, so it is bound by arithmetic, not by the weight: the
// dot-product tiles above sustain about 40 GFLOP/s on one AVX2 core (their accumulators, weights and
// activation vectors fill the 16 registers, and the activation rows come from L2 for every weight block),
// and torch's GEMM on the same CPU 50..70 after it has packed (and, for bf16, widened) every weight block.
// Here each panel of 16 weight rows x 512 k is widened and transposed once into an L1-resident buffer
// (k-major: one k is two 8-float vectors of outputs) and multiplied by the activations in groups of 6 rows
// (packed once per call, k-major too): per k, two panel loads, six broadcasts and twelve fused
// multiply-adds into twelve accumulator registers, which keeps both FMA pipes busy (80+ GFLOP/s; 2B-shape
// gate+up in bf16, one thread: 24 rows 19 ms against 34 ms through the few-rows tiles or torch's blocks).
// Every output is a chain of fused multiply-adds over each panel's 512 k, the panels' sums added in k order
// (as BLAS kernels do: shorter chains, smaller rounding error than one over all of k), so a row's result
// does not depend on the row count, its group or the thread split either; its order differs from the
// few-rows kernel's, so decode steps always take the few-rows kernel (model/cpu_linear.py).
//
// Compiled on the machine that runs it (node startup, cached) with GCC/Clang vector extensions: 8-float
// vectors become AVX/AVX2 registers on x86-64 and pairs of NEON registers on a Jetson's Arm cores.
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <vector>
#if defined(__AVX2__) || defined(__FMA__)
#include <immintrin.h>
#endif

namespace {

constexpr int kMaxRows = 8;  // the row counts `rows` has tiles for

typedef float v8 __attribute__((vector_size(32)));
typedef uint16_t u16x8 __attribute__((vector_size(16)));
typedef uint32_t u32x8 __attribute__((vector_size(32)));
typedef int32_t i32x8 __attribute__((vector_size(32)));
typedef int64_t i64x4 __attribute__((vector_size(32)));

// bfloat16 is the upper half of a float32: weights in bf16 are stored as their 16 bits.
struct bf16 {
  uint16_t bits;
};

// An int8 weight; its row's scale is applied by the caller to the sums, where it factors out.
struct i8 {
  int8_t value;
};

inline v8 load8(const float *p) {
  v8 v;
  std::memcpy(&v, p, sizeof v);  // unaligned load
  return v;
}

// 8 consecutive 8- or 16-bit integers, each zero- or sign-extended into a 32-bit lane. With AVX2 each is one
// instruction that loads and widens (vpmovzxbd, vpmovsxbd, vpmovzxwd); GCC spells the same vector-extension
// conversions as several (16-bit values a 128-bit half at a time, bytes one by one through general registers),
// which cost the bf16, int8 and int4 tiles a third to a half of their speed on one AVX2 core.
#if defined(__AVX2__)
inline i32x8 widen_u8(const uint8_t *p) { return (i32x8)_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p)); }
inline i32x8 widen_s8(const int8_t *p) { return (i32x8)_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)); }
inline u32x8 widen_u16(const uint16_t *p) {
  return (u32x8)_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p));
}
#else
// Each 32-bit lane takes the word holding its byte, shifted so that the byte is on top, then shifted back with
// or without sign.
inline i32x8 byte_on_top(const void *p) {
  int64_t eight;
  std::memcpy(&eight, p, sizeof eight);
  const i64x4 both = {eight, eight, eight, eight};  // as 32-bit lanes: low, high, low, high, ...
  const i32x8 words = __builtin_shufflevector((i32x8)both, (i32x8)both, 0, 2, 4, 6, 1, 3, 5, 7);
  const i32x8 up = {24, 16, 8, 0, 24, 16, 8, 0};
  return words << up;
}
inline i32x8 widen_u8(const uint8_t *p) { return (i32x8)((u32x8)byte_on_top(p) >> 24); }
inline i32x8 widen_s8(const int8_t *p) { return byte_on_top(p) >> 24; }
inline u32x8 widen_u16(const uint16_t *p) {
  u16x8 h;
  std::memcpy(&h, p, sizeof h);
  return __builtin_convertvector(h, u32x8);
}
#endif

inline v8 load8(const bf16 *p) {  // 8 bf16 widened exactly to fp32
  const u32x8 wide = widen_u16(&p->bits) << 16;
  v8 v;
  std::memcpy(&v, &wide, sizeof v);
  return v;
}

inline v8 load8(const i8 *p) { return __builtin_convertvector(widen_s8(&p->value), v8); }  // exactly

inline float widen(float v) { return v; }

inline float widen(bf16 v) {
  const uint32_t wide = uint32_t(v.bits) << 16;
  float f;
  std::memcpy(&f, &wide, sizeof f);
  return f;
}

inline float widen(i8 v) { return float(v.value); }

// IEEE half (the int4 scales and offsets) to float, exactly, from its bits (zero and subnormals included).
inline float half_to_float(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000u) << 16, exponent = (h >> 10) & 0x1fu, mantissa = h & 0x3ffu;
  uint32_t bits;
  if (exponent == 0) {  // zero or subnormal: mantissa * 2^-24, exact in fp32
    const float magnitude = float(mantissa) * 5.9604644775390625e-8f;
    std::memcpy(&bits, &magnitude, sizeof bits);
    bits |= sign;
  } else if (exponent == 31) {  // infinity or NaN
    bits = sign | 0x7f800000u | (mantissa << 13);
  } else {
    bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
  }
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// ---- Weights as the kernels read them -----------------------------------------------------------------
// A view of an (n, k) weight: load8(row, j) gives the 8 values at k = j..j+7 (j a multiple of 8) widened to
// fp32, at(row, j) one value. The kernels take any view; for_rows(n0, n1) is the view a thread multiplies rows
// n0..n1-1 of the weight by (where a format prepares something per call, it does it there).

// Stored element by element: fp32, bf16 or int8.
template <typename T>
struct Dense {
  const T *w;
  int k;
  Dense for_rows(int, int) const { return *this; }
  v8 load8(int row, int j) const { return ::load8(w + (size_t)row * k + j); }
  float at(int row, int j) const { return widen(w[(size_t)row * k + j]); }
};

// The activations as the int4 few-rows tile reads them (int4_activations below): x (m, k) with each row's k in
// blocks of 16, the 8 even k then the 8 odd k (the order of a byte's low and high nibbles); and per row and
// group of k (the whole blocks of 16 only) the sum of x in 8 lanes, (m, groups, 8), which every weight row
// multiplies by its offset: summed once per call instead of once per tile, which also frees the registers the
// tile held them in.
struct Int4Activations {
  std::vector<float> x, sums;
  int groups;
  const float *sum(int row, int g) const { return sums.data() + ((size_t)row * groups + g) * 8; }
};

// Rows n0.. of an int4 weight (below) with their groups' scales and offsets widened to fp32 (interleaved,
// (rows, groups, 2)) once per call: about 1% of the call's work at groups of 128, where widening the fp16
// pair for every 8 values took a quarter of it. load8 gives weights as the panels of many rows take them;
// the few-rows tile takes the unscaled values (unpack16) and the factors apart.
struct Int4Rows {
  const uint8_t *q;
  std::vector<float> factors;
  int n0, group_shift, bytes, groups;  // group = 1 << group_shift
  const Int4Activations *x;  // the few-rows tile's activations and their group sums; null for many rows
  v8 load8(int row, int j) const {
    int32_t word;
    std::memcpy(&word, q + (size_t)row * bytes + j / 2, sizeof word);
    const i32x8 wide = {word, word, word, word, word, word, word, word};
    const i32x8 shifts = {0, 4, 8, 12, 16, 20, 24, 28};
    const v8 values = __builtin_convertvector((wide >> shifts) & 15, v8);
    const float *f = factor(row, j);
    const v8 scale = {f[0], f[0], f[0], f[0], f[0], f[0], f[0], f[0]};
    const v8 offset = {f[1], f[1], f[1], f[1], f[1], f[1], f[1], f[1]};
    return values * scale + offset;
  }
  // The 16 values at k = j..j+15 (j a multiple of 16), unscaled: the even k (low nibbles) and the odd k (high
  // nibbles) of 8 bytes, 8 fp32 lanes each.
  void unpack16(int row, int j, v8 &even, v8 &odd) const {
    const i32x8 v = widen_u8(q + (size_t)row * bytes + (unsigned)j / 2);
    even = __builtin_convertvector(v & 15, v8);
    odd = __builtin_convertvector(v >> 4, v8);
  }
  float at(int row, int j) const {
    const uint8_t byte = q[(size_t)row * bytes + j / 2];
    const float *f = factor(row, j);
    return float(j % 2 ? byte >> 4 : byte & 15) * f[0] + f[1];
  }
  const float *factor(int row, int j) const {
    return factors.data() + ((size_t)(row - n0) * groups + (j >> group_shift)) * 2;
  }
};

// Two 4-bit values a byte along k (even k in the low nibble, rows of ceil(k / 2) bytes) and, per group of
// `group` consecutive k (a power of two >= 16, so the 16 values a tile reads at once share a group), an fp16
// scale and offset: w = q * scale + offset. Many rows widen each weight so, a product and a sum each rounded
// to fp32, as the torch path widens it (the same values bit for bit, only the order of the sums differs);
// few rows sum over a group first and scale once (the tile below), another rounding of the same sum.
struct Int4 {
  const uint8_t *q;
  const uint16_t *scales, *offsets;  // (n, groups) fp16 bits
  int k, group;
  const Int4Activations *x = nullptr;
  Int4Rows for_rows(int n0, int n1) const {
    const int groups = (k + group - 1) / group;
    const size_t factors = (size_t)(n1 - n0) * groups * 2;
    Int4Rows view{q, std::vector<float>(factors), n0, __builtin_ctz(group), (k + 1) / 2, groups, x};
    for (size_t i = 0; i < (size_t)(n1 - n0) * groups; ++i) {
      view.factors[2 * i] = half_to_float(scales[(size_t)n0 * groups + i]);
      view.factors[2 * i + 1] = half_to_float(offsets[(size_t)n0 * groups + i]);
    }
    return view;
  }
};

// c + a * b rounded once, spelled out: compilers contract a * b + c into an FMA in some loops and not in
// others (GCC leaves a lone accumulator as multiply + add), which would make a row's sum depend on the tile,
// so the library is built with -ffp-contract=off and every product goes through here.
inline v8 fma8(v8 a, v8 b, v8 c) {
#if defined(__FMA__)
  return (v8)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
#elif defined(__aarch64__)
  v8 r;
#pragma GCC unroll 8
  for (int i = 0; i < 8; ++i) r[i] = __builtin_fmaf(a[i], b[i], c[i]);
  return r;
#else  // no fused multiply-add in hardware (x86 before Haswell): a libm call per lane would crawl
  return a * b + c;
#endif
}

inline float lane_sum(v8 v) { return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7])); }

// MR activation rows x NR weight rows from row0: y[m][r] = sum_k x[m][k] * w[row0 + r][k]. x rows are k apart,
// y rows n apart.
template <int MR, int NR, typename W>
inline void tile(const float *x, const W &w, int row0, float *y, int k, int n) {
  v8 acc[MR][NR] = {};
  int kk = 0;
  for (; kk + 8 <= k; kk += 8) {
    v8 wv[NR];
#pragma GCC unroll 8
    for (int r = 0; r < NR; ++r) wv[r] = w.load8(row0 + r, kk);
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
      for (int j = kk; j < k; ++j) s += x[(size_t)m * k + j] * w.at(row0 + r, j);
      y[(size_t)m * n + r] = s;
    }
  }
}

// The same for int4 weights (few rows, see the top of the file), x from w.x (Int4Activations): per group,
// acc = sum(x * q) in 8 lanes, then total += acc * scale + xsum * offset with the group's lane sums of x; the
// k past the last whole block of 16 one by one at the end. Every row's sums run in this order whatever MR, NR
// or the thread split, so batch invariance holds as for the other formats.
template <int MR, int NR>
inline void tile(const float *x, const Int4Rows &w, int row0, float *y, int k, int n) {
  v8 total[MR][NR] = {};
  const int k16 = k / 16 * 16, group = 1 << w.group_shift;
  const int m0 = int((x - w.x->x.data()) / k);  // the first of this tile's activation rows
  for (int g0 = 0; g0 < k16; g0 += group) {
    const int g1 = g0 + group < k16 ? g0 + group : k16;
    v8 acc[MR][NR] = {};
    for (int j = g0; j < g1; j += 16) {
#pragma GCC unroll 8
      for (int r = 0; r < NR; ++r) {
        v8 even, odd;
        w.unpack16(row0 + r, j, even, odd);
#pragma GCC unroll 8
        for (int m = 0; m < MR; ++m) {
          const float *xm = x + (size_t)m * k + j;
          acc[m][r] = fma8(odd, load8(xm + 8), fma8(even, load8(xm), acc[m][r]));
        }
      }
    }
#pragma GCC unroll 8
    for (int r = 0; r < NR; ++r) {
      const float *f = w.factor(row0 + r, g0);
      const v8 scale = {f[0], f[0], f[0], f[0], f[0], f[0], f[0], f[0]};
      const v8 offset = {f[1], f[1], f[1], f[1], f[1], f[1], f[1], f[1]};
#pragma GCC unroll 8
      for (int m = 0; m < MR; ++m) {
        const v8 xsum = load8(w.x->sum(m0 + m, g0 >> w.group_shift));
        total[m][r] = fma8(xsum, offset, fma8(acc[m][r], scale, total[m][r]));
      }
    }
  }
  for (int m = 0; m < MR; ++m) {
    for (int r = 0; r < NR; ++r) {
      float s = lane_sum(total[m][r]);
      for (int j = k16; j < k; ++j) s += x[(size_t)m * k + j] * w.at(row0 + r, j);
      y[(size_t)m * n + r] = s;
    }
  }
}

// Weight rows [n0, n1) in blocks of NR (the rest one by one); the activation rows in groups G... (each
// group one tile, so the accumulators of a group fit the 16 vector registers).
template <int NR, int... G, typename W>
void weight_rows(const float *x, const W &w, float *y, int n, int k, int n0, int n1) {
  for (; n0 + NR <= n1; n0 += NR) {
    int m0 = 0;
    ((tile<G, NR>(x + (size_t)m0 * k, w, n0, y + (size_t)m0 * n + n0, k, n), m0 += G), ...);
  }
  for (; n0 < n1; ++n0) {
    int m0 = 0;
    ((tile<G, 1>(x + (size_t)m0 * k, w, n0, y + (size_t)m0 * n + n0, k, n), m0 += G), ...);
  }
}

// The tiles per row count, the fastest measured on 2B-shape projections (AVX2, one thread).
template <typename W>
void rows(const float *x, const W &w, float *y, int m, int n, int k, int n0, int n1) {
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

// Weight rows [0, n) in `threads` contiguous chunks (multiples of `align`), one per OpenMP thread, each
// running body(n0, n1). The library is linked with -fopenmp against libgomp.so.1, which resolves to the
// runtime torch already loaded, so the chunks run on torch's own worker threads: a thread of our own would
// compete with those workers, which spin for a while after every torch op (two threads were slower than
// one between torch ops).
template <typename Body>
void split_weight_rows(int n, int threads, int align, Body body) {
  if (threads < 1) threads = 1;
  const int chunk = ((n + threads - 1) / threads + align - 1) / align * align;
  const int chunks = (n + chunk - 1) / chunk;
#pragma omp parallel for num_threads(chunks) schedule(static, 1) if (chunks > 1)
  for (int c = 0; c < chunks; ++c) {
    const int n0 = c * chunk;
    body(n0, n0 + chunk < n ? n0 + chunk : n);
  }
}

// x (m, k) fp32, w an (n, k) view, y (m, n) fp32, all contiguous; the weight rows split over `threads` in
// multiples of 120 (a multiple of every tile's NR).
template <typename W>
int gemm(const float *x, const W &w, float *y, int m, int n, int k, int threads) {
  if (m < 1 || m > kMaxRows) return -1;
  split_weight_rows(n, threads, 120, [&](int n0, int n1) { rows(x, w.for_rows(n0, n1), y, m, n, k, n0, n1); });
  return 0;
}

// ---- Many rows ---------------------------------------------------------------------------------------

constexpr int kPanelCols = 16;    // weight rows per panel: the two 8-float output vectors of one k
constexpr int kPanelDepth = 512;  // k per panel: 16 x 512 fp32 = 32 KB (256 and 1024 measured slower)
constexpr int kGroupRows = 6;     // activation rows per micro-kernel: 12 accumulators + 2 weights + 1 broadcast
constexpr int kBlockRows = 192;   // activation rows per pass over the weight (a multiple of kGroupRows)

inline void store8(float *p, v8 v) { std::memcpy(p, &v, sizeof v); }

// r[i][j] -> r[j][i] for an 8 x 8 block of floats (unpack pairs, then quads, then 128-bit halves).
inline void transpose8(v8 *r) {
  v8 t[8], s[8];
  for (int i = 0; i < 8; i += 2) {
    t[i] = __builtin_shufflevector(r[i], r[i + 1], 0, 8, 1, 9, 4, 12, 5, 13);
    t[i + 1] = __builtin_shufflevector(r[i], r[i + 1], 2, 10, 3, 11, 6, 14, 7, 15);
  }
  for (int i = 0; i < 8; i += 4) {
    for (int j = 0; j < 2; ++j) {
      s[i + 2 * j] = __builtin_shufflevector(t[i + j], t[i + j + 2], 0, 1, 8, 9, 4, 5, 12, 13);
      s[i + 2 * j + 1] = __builtin_shufflevector(t[i + j], t[i + j + 2], 2, 3, 10, 11, 6, 7, 14, 15);
    }
  }
  for (int i = 0; i < 4; ++i) {
    r[i] = __builtin_shufflevector(s[i], s[i + 4], 0, 1, 2, 3, 8, 9, 10, 11);
    r[i + 4] = __builtin_shufflevector(s[i], s[i + 4], 4, 5, 6, 7, 12, 13, 14, 15);
  }
}

// panel[j][c] = w[row0 + c][k0 + j] for the `cols` weight rows and j < depth; columns past `cols` are zero.
// Full panels go 8 rows at a time over the whole depth: 16 rows k * 2 or 4 bytes apart share an L1 set
// (strides of 4 KB), and walking all 16 along k together evicted each line before its next use.
template <typename W>
void pack_panel(const W &w, int row0, int k0, int cols, int depth, float *panel) {
  int j = 0;
  if (cols == kPanelCols) {
    for (int half = 0; half < kPanelCols; half += 8) {
      for (j = 0; j + 8 <= depth; j += 8) {
        v8 r[8];
        for (int i = 0; i < 8; ++i) r[i] = w.load8(row0 + half + i, k0 + j);
        transpose8(r);
        for (int i = 0; i < 8; ++i) store8(panel + (size_t)(j + i) * kPanelCols + half, r[i]);
      }
    }
  }
  for (; j < depth; ++j) {
    for (int c = 0; c < kPanelCols; ++c) panel[(size_t)j * kPanelCols + c] = c < cols ? w.at(row0 + c, k0 + j) : 0.f;
  }
}

// y[m][c] (+)= sum_j xg[j][m] * panel[j][c] for MR rows and j < depth: `first` stores the sums, else adds
// them to y (the previous panels of k). Only the first `cols` columns of y are touched.
template <int MR>
void micro(const float *panel, const float *xg, float *y, int n, int cols, int depth, bool first) {
  v8 acc[MR][2] = {};
  for (int j = 0; j < depth; ++j) {
    const v8 w0 = load8(panel + (size_t)j * kPanelCols), w1 = load8(panel + (size_t)j * kPanelCols + 8);
#pragma GCC unroll 8
    for (int m = 0; m < MR; ++m) {
      const float s = xg[(size_t)j * MR + m];
      const v8 b = {s, s, s, s, s, s, s, s};
      acc[m][0] = fma8(w0, b, acc[m][0]);
      acc[m][1] = fma8(w1, b, acc[m][1]);
    }
  }
  for (int m = 0; m < MR; ++m) {
    float sums[kPanelCols];
    store8(sums, acc[m][0]);
    store8(sums + 8, acc[m][1]);
    float *row = y + (size_t)m * n;
    for (int c = 0; c < cols; ++c) row[c] = first ? sums[c] : row[c] + sums[c];
  }
}

template <int... G>
void micro_rows(int rows, const float *panel, const float *xg, float *y, int n, int cols, int depth, bool first) {
  ((rows == G ? micro<G>(panel, xg, y, n, cols, depth, first) : void()), ...);
}

// x (m, k) -> xp: groups of kGroupRows rows (the last smaller), each group (k, rows) k-major.
void pack_rows(const float *x, int m, int k, float *xp) {
  for (int m0 = 0; m0 < m; m0 += kGroupRows) {
    const int rows = m - m0 < kGroupRows ? m - m0 : kGroupRows;
    float *group = xp + (size_t)m0 * k;
    for (int j = 0; j < k; ++j)
      for (int i = 0; i < rows; ++i) group[(size_t)j * rows + i] = x[(size_t)(m0 + i) * k + j];
  }
}

// Weight rows [n0, n1) for blocks of 192 activation rows (their packed slices of one panel depth stay in L2:
// with all 1024 rows of a 2B down projection, 6144 deep, one pass was 40% slower): one panel of 16 weight
// rows x 512 k at a time, every row group of the block through it.
template <typename W>
void panel_rows(const float *xp, const W &w, float *y, int m, int n, int k, int n0, int n1) {
  alignas(64) float panel[kPanelCols * kPanelDepth];
  for (int b0 = 0; b0 < m; b0 += kBlockRows) {
    const int b1 = m - b0 < kBlockRows ? m : b0 + kBlockRows;
    for (int c0 = n0; c0 < n1; c0 += kPanelCols) {
      const int cols = n1 - c0 < kPanelCols ? n1 - c0 : kPanelCols;
      for (int k0 = 0; k0 < k; k0 += kPanelDepth) {
        const int depth = k - k0 < kPanelDepth ? k - k0 : kPanelDepth;
        pack_panel(w, c0, k0, cols, depth, panel);
        for (int m0 = b0; m0 < b1; m0 += kGroupRows) {
          const int rows = m - m0 < kGroupRows ? m - m0 : kGroupRows;
          const float *xg = xp + (size_t)m0 * k + (size_t)k0 * rows;
          micro_rows<1, 2, 3, 4, 5, 6>(rows, panel, xg, y + (size_t)m0 * n + c0, n, cols, depth, k0 == 0);
        }
      }
    }
  }
}

// x (m, k) fp32, w an (n, k) view, y (m, n) fp32, xp (m * k) fp32 scratch, all contiguous; the weight rows
// split over `threads` in multiples of a panel.
template <typename W>
int panel_gemm(const float *x, const W &w, float *y, float *xp, int m, int n, int k, int threads) {
  if (m < 1) return -1;
  pack_rows(x, m, k, xp);
  split_weight_rows(n, threads, kPanelCols,
                    [&](int n0, int n1) { panel_rows(xp, w.for_rows(n0, n1), y, m, n, k, n0, n1); });
  return 0;
}

// x (m, k) reordered for the int4 tile and its group sums (Int4Activations); the k past the last whole block
// of 16 as they are. A group's lane sums add each block's two vectors, then that to the sum, in k order.
Int4Activations int4_activations(const float *x, int m, int k, int group) {
  const int k16 = k / 16 * 16;
  Int4Activations a{std::vector<float>(x, x + (size_t)m * k), {}, (k16 + group - 1) / group};
  a.sums.assign((size_t)m * a.groups * 8, 0.0f);
  for (int i = 0; i < m; ++i) {
    float *row = a.x.data() + (size_t)i * k;
    const float *from = x + (size_t)i * k;
    for (int j = 0; j < k16; j += 16) {
      for (int t = 0; t < 8; ++t) {
        row[j + t] = from[j + 2 * t];
        row[j + 8 + t] = from[j + 2 * t + 1];
      }
      float *sum = a.sums.data() + ((size_t)i * a.groups + j / group) * 8;
      const v8 block = load8(row + j) + load8(row + j + 8);
      const v8 total = load8(sum) + block;
      std::memcpy(sum, &total, sizeof total);
    }
  }
  return a;
}

// The int4 view, or a group the kernels do not take (not a power of two >= 16): group 0.
Int4 int4_view(const uint8_t *q, const uint16_t *scales, const uint16_t *offsets, int k, int group) {
  const bool fits = group >= 16 && (group & (group - 1)) == 0;
  return Int4{q, scales, offsets, k, fits ? group : 0};
}

}  // namespace

extern "C" {

// Every function returns 0, or -1 when its arguments are outside what it takes (nothing written): few rows
// take m in 1..few_rows_gemm_max_rows(), many rows any m >= 1 with xp scratch of m * k floats; int4 takes
// groups that are a power of two >= 16.
int few_rows_gemm_max_rows() { return kMaxRows; }

int few_rows_gemm_f32(const float *x, float *y, int m, int n, int k, int threads, const float *w) {
  return gemm(x, Dense<float>{w, k}, y, m, n, k, threads);
}

int few_rows_gemm_bf16(const float *x, float *y, int m, int n, int k, int threads, const bf16 *w) {
  return gemm(x, Dense<bf16>{w, k}, y, m, n, k, threads);
}

int few_rows_gemm_int8(const float *x, float *y, int m, int n, int k, int threads, const i8 *w) {
  return gemm(x, Dense<i8>{w, k}, y, m, n, k, threads);
}

int few_rows_gemm_int4(const float *x, float *y, int m, int n, int k, int threads, const uint8_t *q,
                       const uint16_t *scales, const uint16_t *offsets, int group) {
  Int4 w = int4_view(q, scales, offsets, k, group);
  if (!w.group || m < 1 || m > kMaxRows) return -1;
  const Int4Activations a = int4_activations(x, m, k, group);
  w.x = &a;
  return gemm(a.x.data(), w, y, m, n, k, threads);
}

int many_rows_gemm_f32(const float *x, float *y, float *xp, int m, int n, int k, int threads, const float *w) {
  return panel_gemm(x, Dense<float>{w, k}, y, xp, m, n, k, threads);
}

int many_rows_gemm_bf16(const float *x, float *y, float *xp, int m, int n, int k, int threads, const bf16 *w) {
  return panel_gemm(x, Dense<bf16>{w, k}, y, xp, m, n, k, threads);
}

int many_rows_gemm_int8(const float *x, float *y, float *xp, int m, int n, int k, int threads, const i8 *w) {
  return panel_gemm(x, Dense<i8>{w, k}, y, xp, m, n, k, threads);
}

int many_rows_gemm_int4(const float *x, float *y, float *xp, int m, int n, int k, int threads, const uint8_t *q,
                        const uint16_t *scales, const uint16_t *offsets, int group) {
  const Int4 w = int4_view(q, scales, offsets, k, group);
  return w.group ? panel_gemm(x, w, y, xp, m, n, k, threads) : -1;
}

}  // extern "C"
