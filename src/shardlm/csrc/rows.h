// Row-streaming helpers shared by the decode kernels: dot products over contiguous float rows.
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <new>
#include <vector>
#if defined(__FMA__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace shardlm {

inline float bf16_to_float(uint16_t v) {
  uint32_t bits = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

template <typename W>
inline float load(const W* p, int64_t i);
template <>
inline float load<float>(const float* p, int64_t i) { return p[i]; }
template <>
inline float load<uint16_t>(const uint16_t* p, int64_t i) { return bf16_to_float(p[i]); }
template <>
inline float load<int8_t>(const int8_t* p, int64_t i) { return static_cast<float>(p[i]); }

// An allocator from 64-byte boundaries (cache lines): a row's activation codes (kp a multiple of 32 int16) and its
// chunk scale vectors then start on a line, and each 512-bit load reads one line, not two. From malloc's 16-byte
// boundaries a batch-1 int8 pass over one layer from L2 ran about 10 % slower (scratch C++, 2026-11-29).
template <typename T>
struct LineAligned {
  using value_type = T;
  LineAligned() = default;
  template <typename U>
  LineAligned(const LineAligned<U>&) {}
  T* allocate(size_t n) { return static_cast<T*>(::operator new(n * sizeof(T), std::align_val_t(64))); }
  void deallocate(T* p, size_t) { ::operator delete(p, std::align_val_t(64)); }
  template <typename U>
  bool operator==(const LineAligned<U>&) const { return true; }
  template <typename U>
  bool operator!=(const LineAligned<U>&) const { return false; }
};

// grown(buf, n): buf's data with room for n values, grown but never shrunk nor cleared, for a buffer a kernel keeps
// per thread and overwrites whole each call (fresh ones of a prefill's sizes came from malloc at 16 bytes past a
// line and were zeroed each call).
template <typename T>
inline T* grown(std::vector<T, LineAligned<T>>& buf, int64_t n) {
  if (static_cast<int64_t>(buf.size()) < n) buf.resize(static_cast<size_t>(n));
  return buf.data();
}

// Eight lanes of float32 (GCC/Clang vector extension: one AVX register, or half of an AVX-512 one).
typedef float v8f __attribute__((vector_size(32)));
typedef uint16_t v8u16 __attribute__((vector_size(16)));
typedef uint32_t v8u32 __attribute__((vector_size(32)));

// a * b + c, fused where the CPU has FMA. The build turns implicit contraction off (-ffp-contract=off) so
// that every copy of a loop rounds the same way; the hot loops ask for FMA here, explicitly.
inline v8f fma8(v8f a, v8f b, v8f c) {
#if defined(__FMA__)
  return reinterpret_cast<v8f>(_mm256_fmadd_ps(reinterpret_cast<__m256>(a), reinterpret_cast<__m256>(b),
                                               reinterpret_cast<__m256>(c)));
#else
  return a * b + c;
#endif
}

template <typename W>
inline v8f load8(const W* p);
template <>
inline v8f load8<float>(const float* p) {
  v8f v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
template <>
inline v8f load8<uint16_t>(const uint16_t* p) {  // bfloat16: the high half of a float32
#if defined(__AVX2__)
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return reinterpret_cast<v8f>(_mm256_castsi256_ps(_mm256_slli_epi32(wide, 16)));
#endif
  v8u16 h;
  std::memcpy(&h, p, sizeof(h));
  const v8u32 bits = __builtin_convertvector(h, v8u32) << 16;
  v8f v;
  std::memcpy(&v, &bits, sizeof(v));
  return v;
}

// At column i of a tile of R rows from r0, where i starts a cache line: ask for that line of each of the next R
// rows (the next tile's). An address, not a pointer: the hint may pass the weight's end and never faults.
template <typename W, int R>
__attribute__((always_inline)) inline void prefetch_next_tile(const W* w, int64_t ldw, int64_t r0, int64_t i) {
  constexpr int64_t line = 64 / sizeof(W);  // weights per cache line
  if ((i & (line - 1)) != 0) return;
  const uintptr_t base = reinterpret_cast<uintptr_t>(w);
  for (int r = 0; r < R; ++r)
    __builtin_prefetch(reinterpret_cast<const void*>(base + ((r0 + R + r) * ldw + i) * sizeof(W)), 0, 3);
}

// out[o] = a[o][0] + a[o][1] + ... + a[o][7], added in that order from zero (as `s = 0; s += lane` does), for n
// accumulators; from `from[o]` instead of zero where `from` is given (a sum that goes on into more lanes). With
// AVX2, eight at a time: an 8 x 8 transpose puts lane l of the eight in register l, so eight vector adds do what 64
// scalar ones did, in the same order.
__attribute__((always_inline)) inline void lane_sums8(const v8f* a, int n, float* out, const float* from = nullptr) {
  int o = 0;
#if defined(__AVX2__)
  for (; o + 8 <= n; o += 8) {
    __m256 r[8], t[8];
    for (int q = 0; q < 8; ++q) r[q] = reinterpret_cast<__m256>(a[o + q]);
    for (int q = 0; q < 8; q += 2) {  // t[q]: lanes 0,1 / 4,5 of rows q, q+1 interleaved; t[q+1]: lanes 2,3 / 6,7
      t[q] = _mm256_unpacklo_ps(r[q], r[q + 1]);
      t[q + 1] = _mm256_unpackhi_ps(r[q], r[q + 1]);
    }
    for (int q = 0; q < 8; q += 4) {  // r[q + m]: lane m (and m + 4 in the high half) of rows q..q+3
      r[q] = _mm256_shuffle_ps(t[q], t[q + 2], 0x44);
      r[q + 1] = _mm256_shuffle_ps(t[q], t[q + 2], 0xEE);
      r[q + 2] = _mm256_shuffle_ps(t[q + 1], t[q + 3], 0x44);
      r[q + 3] = _mm256_shuffle_ps(t[q + 1], t[q + 3], 0xEE);
    }
    __m256 s = from ? _mm256_loadu_ps(from + o) : _mm256_setzero_ps();
    for (int m = 0; m < 4; ++m) s = _mm256_add_ps(s, _mm256_permute2f128_ps(r[m], r[m + 4], 0x20));  // lane m
    for (int m = 0; m < 4; ++m) s = _mm256_add_ps(s, _mm256_permute2f128_ps(r[m], r[m + 4], 0x31));  // lane m+4
    _mm256_storeu_ps(out + o, s);
  }
#endif
  for (; o < n; ++o) {
    float s = from ? from[o] : 0.f;
    for (int l = 0; l < 8; ++l) s += a[o][l];
    out[o] = s;
  }
}

// y[j, r] for R weight rows from r0 and J rows of x from j0. Each (r, j) pair keeps its own eight-lane
// accumulator over k in steps of 8, then adds the lanes in order and the tail: the same arithmetic
// whatever R, J or the tile's place, so a row's result does not depend on the batch around it. R x J
// independent accumulators keep the FMA units busy (one accumulator waits on its own latency), and
// each weight vector loaded serves all J rows of x.
// Weight rows are `ldw` apart (>= k: an int8 weight's rows carry zero padding past its k columns).
// While it streams its rows, the first tile of a pass asks the cache for the next R rows (prefetch_next_tile, one
// tile ahead: about a microsecond before they are read, longer than a memory access). The hardware prefetcher
// alone left bfloat16 rows at batch 1 (when they ran through this tile; bf16rows.h's tiles ask alike) and float32
// rows at batch 8 waiting on memory: +10-15 % and +40 % tokens/s with the hint, measured A/B on an AVX-512 host
// (float32 batch 1 unchanged). It changes no arithmetic. At batch 1 the rows go one at a time (`rows`), each
// streaming on from the last, where a hint to the next row only competed with it; there a tile of one row and one x
// row asks, on Intel builds only (SHARDLM_L1_AHEAD, set by kernels/build.py), for the line STREAM_AHEAD bytes on in
// its own stream, into L1, once per line. Ice Lake, the bundled model's float32 weights on huge pages, two threads: a
// row-by-row pass 22.3 ms without, 20.3 with it, 21.7 into L2 (scratch C++); a decode step 0.90x the time (in-process
// A/B, RESULTS.md stop 67). On a Zen 4 host the same hint into L2 had made a step 1.06x slower (2026-11-29), and into
// L1 an int8 stream was no faster (qrows.h): AMD builds ask for nothing.
// stream_prefetch is the one hint of every such stream (these rows; qrows.h's int8 rows, STREAM_AHEAD or a multiple
// on): into L1 (prefetcht0) on Intel builds, into L2 (prefetcht1) elsewhere.
#if defined(SHARDLM_L1_AHEAD)
constexpr bool L1_STREAM = true;
#else
constexpr bool L1_STREAM = false;
#endif
constexpr int64_t STREAM_AHEAD = 4096;
__attribute__((always_inline)) inline void stream_prefetch(const void* at) {
  __builtin_prefetch(at, 0, L1_STREAM ? 3 : 2);
}

template <typename W, int R, int J>
inline void tile(const W* w, int64_t ldw, const float* x, float* y, int64_t n, int64_t k, int64_t r0, int64_t j0) {
  v8f acc[R][J];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < J; ++j) acc[r][j] = v8f{};
  int64_t i = 0;
  constexpr int64_t line = 64 / sizeof(W);  // weights per cache line
  for (; i + 8 <= k; i += 8) {
    if (J > 1 && j0 == 0) prefetch_next_tile<W, R>(w, ldw, r0, i);
    if constexpr (L1_STREAM && R == 1 && J == 1)
      if ((i & (line - 1)) == 0)  // an address, not a pointer: the hint may pass the weight's end and never faults
        stream_prefetch(reinterpret_cast<const void*>(reinterpret_cast<uintptr_t>(w + r0 * ldw + i) + STREAM_AHEAD));
    v8f xv[J];
    for (int j = 0; j < J; ++j) xv[j] = load8<float>(x + (j0 + j) * k + i);
    for (int r = 0; r < R; ++r) {
      const v8f wv = load8<W>(w + (r0 + r) * ldw + i);
      for (int j = 0; j < J; ++j) acc[r][j] = fma8(wv, xv[j], acc[r][j]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < J; ++j) {
      float s = 0.f;
      for (int l = 0; l < 8; ++l) s += acc[r][j][l];
      for (int64_t t = i; t < k; ++t) s += load<W>(w, (r0 + r) * ldw + t) * x[(j0 + j) * k + t];
      y[(j0 + j) * n + r0 + r] = s;
    }
}

#if defined(__AVX512F__)
// A 512-bit register's lanes 0-7 and 8-15 as two eight-lane vectors (for lane_sums8).
__attribute__((always_inline)) inline void halves_of(__m512 a, v8f& low, v8f& high) {
  low = reinterpret_cast<v8f>(_mm512_castps512_ps256(a));
  high = reinterpret_cast<v8f>(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1)));
}

// lane_sums8 for sixteen accumulators held two to a 512-bit register, in registers: a[q] for q = r + 4 * pp holds the
// accumulators of weight row r (0-3) with x rows 2 pp (low half) and 2 pp + 1 (high half) of a group of four x rows.
// Each 256-bit half goes through lane_sums8's transpose at once (the in-lane shuffles work per 128 bits), and the last
// step picks the 128-bit quarters so that quarter c of the result holds lane m of weight rows 0-3 with x row c of the
// group: the same additions in the same order (from zero, lanes 0 to 7), about a third of the instructions, and no
// trip through memory (at the model's widths the per-tile sums had cost about a quarter of a 16-row product).
__attribute__((always_inline)) inline __m512 pair_lane_sums(const __m512* a) {
  __m512 t[8], u[8];
  for (int q = 0; q < 8; q += 2) {
    t[q] = _mm512_unpacklo_ps(a[q], a[q + 1]);
    t[q + 1] = _mm512_unpackhi_ps(a[q], a[q + 1]);
  }
  for (int q = 0; q < 8; q += 4) {  // u[q + m], by 128-bit quarter: x row 0 lane m, row 0 lane m + 4, row 1 ...
    u[q] = _mm512_shuffle_ps(t[q], t[q + 2], 0x44);
    u[q + 1] = _mm512_shuffle_ps(t[q], t[q + 2], 0xEE);
    u[q + 2] = _mm512_shuffle_ps(t[q + 1], t[q + 3], 0x44);
    u[q + 3] = _mm512_shuffle_ps(t[q + 1], t[q + 3], 0xEE);
  }
  __m512 s = _mm512_setzero_ps();
  for (int m = 0; m < 4; ++m) s = _mm512_add_ps(s, _mm512_shuffle_f32x4(u[m], u[m + 4], 0x88));  // lane m
  for (int m = 0; m < 4; ++m) s = _mm512_add_ps(s, _mm512_shuffle_f32x4(u[m], u[m + 4], 0xDD));  // lane m + 4
  return s;
}

// Quarter c of s (weight rows r0..r0 + 3 of x row j + c) to y[j + c, r0..r0 + 3].
__attribute__((always_inline)) inline void store_sums4(__m512 s, float* y, int64_t n, int64_t r0, int64_t j) {
  _mm_storeu_ps(y + j * n + r0, _mm512_extractf32x4_ps(s, 0));
  _mm_storeu_ps(y + (j + 1) * n + r0, _mm512_extractf32x4_ps(s, 1));
  _mm_storeu_ps(y + (j + 2) * n + r0, _mm512_extractf32x4_ps(s, 2));
  _mm_storeu_ps(y + (j + 3) * n + r0, _mm512_extractf32x4_ps(s, 3));
}

// Two rows of x in one 512-bit register (lanes 0-7 row j, lanes 8-15 row j + 1), so one 512-bit FMA advances the
// eight-lane accumulators of two (r, j) pairs: each lane does exactly what `tile` does (same products, same order,
// same lane sums and tail), at twice the work per instruction where the CPU has full-width 512-bit units (the
// 256-bit tiles reached about half of oneDNN's rate at batch 16 on such a host, measured). xp holds x's rows
// interleaved pairwise in chunks of 8 (`pairs_of`): pair q's chunk c is the 16 floats at xp + q * 2 * kk + 16 * c.
// A row tile of many x rows takes several passes over its weight rows (the first from memory, the rest from L1):
// pass `pass` of `passes` asks for its share of the next tile's columns, so the memory keeps streaming through every
// pass instead of only the first (16 rows, the bundled model's 30 layers of products from memory, scratch C++ harness:
// 12.3-13.0 ms -> 10.2-10.9 ms).
template <typename W, int R, int P>
inline void tile_pairs(const W* w, int64_t ldw, const float* x, const float* xp, float* y, int64_t n, int64_t k,
                       int64_t r0, int64_t j0, int pass = 0, int passes = 1) {
  const int64_t kk = k - k % 8;
  // This pass asks for its share of the next tile's columns (from `ahead`), 8 columns every `passes` steps.
  int64_t ahead = pass * (kk / passes / 8 * 8);
  int wait = 0;
  __m512 acc[R][P];
  for (int r = 0; r < R; ++r)
    for (int p = 0; p < P; ++p) acc[r][p] = _mm512_setzero_ps();
  const float* xq = xp + (j0 / 2) * 2 * kk;  // j0 is even
  for (int64_t i = 0; i < kk; i += 8) {
    if (++wait == passes) {
      wait = 0;
      prefetch_next_tile<W, R>(w, ldw, r0, ahead);  // a line start of the next tile's rows, or nothing
      ahead += 8;
    }
    __m512 xv[P];
    for (int p = 0; p < P; ++p) {
      // Loaded once into a register: without the empty asm GCC folds this load into each of the R FMAs below
      // (R loads of the same 64 bytes per pair; the load ports, not the FMA units, then set the pace).
      __m512 v = _mm512_loadu_ps(xq + p * 2 * kk + 2 * i);
      asm("" : "+v"(v));
      xv[p] = v;
    }
    for (int r = 0; r < R; ++r) {
      const __m512 wv = _mm512_broadcast_f32x8(reinterpret_cast<__m256>(load8<W>(w + (r0 + r) * ldw + i)));
      for (int p = 0; p < P; ++p) acc[r][p] = _mm512_fmadd_ps(wv, xv[p], acc[r][p]);
    }
  }
  if constexpr (R == 4 && P % 2 == 0) {
    if (kk == k) {  // the model's widths: no tail columns, so the sums go straight to y
      for (int p = 0; p < P; p += 2) {
        const __m512 group[8] = {acc[0][p], acc[1][p], acc[2][p], acc[3][p],
                                 acc[0][p + 1], acc[1][p + 1], acc[2][p + 1], acc[3][p + 1]};
        store_sums4(pair_lane_sums(group), y, n, r0, j0 + 2 * p);
      }
      return;
    }
  }
  v8f halves[R * P * 2];  // (r, p, h): the eight lanes of pair p's row 2p + h
  for (int r = 0; r < R; ++r)
    for (int p = 0; p < P; ++p) halves_of(acc[r][p], halves[(r * P + p) * 2], halves[(r * P + p) * 2 + 1]);
  float sums[R * P * 2];
  lane_sums8(halves, R * P * 2, sums);
  for (int r = 0; r < R; ++r)
    for (int p = 0; p < P; ++p)
      for (int h = 0; h < 2; ++h) {
        const int64_t j = j0 + 2 * p + h;
        float s = sums[(r * P + p) * 2 + h];
        for (int64_t t = kk; t < k; ++t) s += load<W>(w, (r0 + r) * ldw + t) * x[j * k + t];
        y[j * n + r0 + r] = s;
      }
}

// x's rows interleaved pairwise in chunks of 8 for tile_pairs (b / 2 pairs; an odd last row is left out), in a
// buffer of the calling thread, from a 64-byte boundary: each 512-bit load then reads one cache line, not two (a
// 16-row product on hot weights ran 7 % faster than from malloc's 16-byte alignment, measured). A buffer of each
// thread's own: one laid out once and shared by both threads was slower (6 %, in-process step A/B), the second
// thread reading it from the other core's cache.
inline const float* pairs_of(const float* x, int64_t b, int64_t k) {
  thread_local std::vector<float> buf;
  const int64_t kk = k - k % 8;
  buf.resize(static_cast<size_t>((b / 2) * 2 * kk + 16));
  float* base = buf.data() + ((64 - reinterpret_cast<uintptr_t>(buf.data()) % 64) % 64) / sizeof(float);
  for (int64_t q = 0; q < b / 2; ++q)
    for (int64_t c = 0; c < kk; c += 8) {
      float* to = base + q * 2 * kk + 2 * c;
      std::memcpy(to, x + (2 * q) * k + c, 8 * sizeof(float));
      std::memcpy(to + 8, x + (2 * q + 1) * k + c, 8 * sizeof(float));
    }
  return base;
}
#endif

// Rows [r0, r0 + R) against every row of x: eight, four or two rows of x at a time in 512-bit pairs (xp, AVX-512
// builds), then two at a time, then one.
template <typename W, int R>
inline void tile_rows(const W* w, int64_t ldw, const float* x, const float* xp, float* y, int64_t n, int64_t k,
                      int64_t b, int64_t r0) {
  int64_t j = 0;
#if defined(__AVX512F__)
  const int passes = static_cast<int>(b / 8 + (b % 8 >= 4) + (b % 4 >= 2));
  int pass = 0;
  for (; j + 8 <= b; j += 8) tile_pairs<W, R, 4>(w, ldw, x, xp, y, n, k, r0, j, pass++, passes);
  if (j + 4 <= b) tile_pairs<W, R, 2>(w, ldw, x, xp, y, n, k, r0, j, pass++, passes), j += 4;
  if (j + 2 <= b) tile_pairs<W, R, 1>(w, ldw, x, xp, y, n, k, r0, j, pass++, passes), j += 2;
#endif
  for (; j + 2 <= b; j += 2) tile<W, R, 2>(w, ldw, x, y, n, k, r0, j);
  if (j < b) tile<W, R, 1>(w, ldw, x, y, n, k, r0, j);
}

inline void rows_bf16(const uint16_t* w, const float* x, float* y, int64_t n, int64_t k, int64_t b, int64_t lo,
                      int64_t hi, int64_t ldw);  // bf16rows.h

// y[j, r] = dot(w[r, :], x[j, :]) for rows r in [lo, hi) and the b rows j of x (y has n columns).
// Weight rows are `ldw` apart (default: k). bfloat16 weights take bf16rows.h's tiles (their own chains).
template <typename W>
void rows(const W* w, const float* x, float* y, int64_t n, int64_t k, int64_t b, int64_t lo, int64_t hi,
          int64_t ldw = 0) {
  ldw = ldw ? ldw : k;
  if constexpr (std::is_same_v<W, uint16_t>) {
    rows_bf16(w, x, y, n, k, b, lo, hi, ldw);
  } else {
    int64_t r = lo;
    // One row of x: the weight rows one after another, each its own chain (tile<W, 1, 1>: the arithmetic of every
    // tile), so the weight is read as one address stream and the chains of neighbouring rows overlap in the core.
    // Eight rows side by side (eight streams, each tile asking for the next) had read 0.68-0.87x as fast from memory
    // on a Zen 4 host (the bundled model's 30 layers of float32 products, scratch C++ harness, 2 threads: 29.1-30.3
    // against 33.6-44.5 GB/s, a plain read 32.0-41.2; RESULTS.md stop 54).
    if (b == 1)
      for (; r < hi; ++r) tile<W, 1, 1>(w, ldw, x, y, n, k, r, 0);
    const float* xp = nullptr;
#if defined(__AVX512F__)
    if (b >= 2 && r < hi) xp = pairs_of(x, b, k);
#endif
    for (; r + 4 <= hi; r += 4) tile_rows<W, 4>(w, ldw, x, xp, y, n, k, b, r);
    for (; r < hi; ++r) tile_rows<W, 1>(w, ldw, x, xp, y, n, k, b, r);
  }
}

// x[0]^2 + ... + x[d-1]^2 in eight lanes in order (each square rounded, then added), the lanes added in order
// (lane_sums8), then the last d % 8 squares: the same sum on every build. (An `omp simd` reduction had let each
// build pick its vector width, so an AVX2 build's norms, and so its decode outputs, differed from an AVX-512 build's
// in the last bit.)
inline float sum_of_squares(const float* x, int64_t d) {
  v8f lanes = v8f{};
  int64_t i = 0;
  for (; i + 8 <= d; i += 8) {
    const v8f v = load8<float>(x + i);
    lanes = lanes + v * v;
  }
  float s;
  lane_sums8(&lanes, 1, &s);
  for (; i < d; ++i) s += x[i] * x[i];
  return s;
}

// out[j, :] = weight * (x[j, :] / sqrt(mean(x[j, :]^2) + eps)) for b rows of d elements.
inline void rms_norm_rows(const float* x, const float* weight, float eps, float* out, int64_t b, int64_t d) {
  for (int64_t j = 0; j < b; ++j) {
    const float* xj = x + j * d;
    const float ss = sum_of_squares(xj, d);
    const float r = 1.f / std::sqrt(ss / static_cast<float>(d) + eps);
    float* oj = out + j * d;
    for (int64_t i = 0; i < d; ++i) oj[i] = weight[i] * (xj[i] * r);
  }
}

}  // namespace shardlm

#include "bf16rows.h"  // rows_bf16: after everything it uses
