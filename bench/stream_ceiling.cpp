// bench/stream_ceiling.py's loops: how fast can this machine's cores stream weights when each byte carries the
// decode kernels' work? Each thread reads its half of a buffer as one address stream, in rows of `cols` bytes:
//   read       plain 512-bit (or 256-bit) loads OR'ed together: no work a byte;
//   int8-float an int8 row widened to int16 and multiply-added with activation codes a block of 32 at a time, each
//              block's int32 lanes converted and multiply-added into float lanes (the float-summed rows: q, k, v,
//              gate, up and the head);
//   int8-int   the same codes multiply-added into int32 lanes only, finished once a row (the exact rows' inner loop);
//   f32        float32 rows, one fused multiply-add a vector (the float rows).
// Every loop asks for the line 4 KB ahead into L2, as the int8 kernels do (qrows.h's stream_prefetch), so that the
// loops differ only in their work.
// Usage: stream_ceiling MB REPEATS VARIANT... ; prints "VARIANT GB/s" per repeat (bytes of the buffer / time).
#include <immintrin.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

namespace {

constexpr int64_t COLS = 576;     // a row: the bundled model's width
constexpr int64_t AHEAD = 4096;   // the int8 kernels' prefetch distance

#if defined(__AVX512BW__)
using V = __m512i;
using F = __m512;
inline V load(const void* p) { return _mm512_loadu_si512(p); }
inline V widen(const int8_t* p) {
  return _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline V madd(V w, const int16_t* x) { return _mm512_madd_epi16(w, _mm512_loadu_si512(x)); }
inline V add(V a, V b) { return _mm512_add_epi32(a, b); }
inline V bor(V a, V b) { return _mm512_or_si512(a, b); }
inline V zero() { return _mm512_setzero_si512(); }
inline F fzero() { return _mm512_setzero_ps(); }
inline F fma_block(V isum, float d, F acc) { return _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_set1_ps(d), acc); }
inline F fma_f32(const float* w, const float* x, F acc) {
  return _mm512_fmadd_ps(_mm512_loadu_ps(w), _mm512_loadu_ps(x), acc);
}
inline float fsum(F a) { return _mm512_reduce_add_ps(a); }
inline int32_t isum(V a) { return _mm512_reduce_add_epi32(a); }
constexpr int64_t VB = 64;    // bytes a vector load reads
constexpr int64_t CODES = 32;  // int8 codes a widened vector holds
#else
using V = __m256i;
using F = __m256;
inline V load(const void* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
inline V widen(const int8_t* p) { return _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline V madd(V w, const int16_t* x) {
  return _mm256_madd_epi16(w, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x)));
}
inline V add(V a, V b) { return _mm256_add_epi32(a, b); }
inline V bor(V a, V b) { return _mm256_or_si256(a, b); }
inline V zero() { return _mm256_setzero_si256(); }
inline F fzero() { return _mm256_setzero_ps(); }
inline F fma_block(V isum, float d, F acc) { return _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_set1_ps(d), acc); }
inline F fma_f32(const float* w, const float* x, F acc) {
  return _mm256_fmadd_ps(_mm256_loadu_ps(w), _mm256_loadu_ps(x), acc);
}
inline float fsum(F a) {
  alignas(32) float l[8];
  _mm256_store_ps(l, a);
  return l[0] + l[1] + l[2] + l[3] + l[4] + l[5] + l[6] + l[7];
}
inline int32_t isum(V a) {
  alignas(32) int32_t l[8];
  _mm256_store_si256(reinterpret_cast<__m256i*>(l), a);
  return l[0] + l[1] + l[2] + l[3] + l[4] + l[5] + l[6] + l[7];
}
constexpr int64_t VB = 32;
constexpr int64_t CODES = 16;
#endif

// One thread's rows [0, rows) of `cols` bytes from w: the variant's work, a value that depends on every byte.
float run(const std::string& variant, const int8_t* w, int64_t bytes, const int16_t* x, const float* xf) {
  float out = 0.f;
  if (variant == "read") {
    V a = zero(), b = zero();
    for (int64_t i = 0; i + 2 * VB <= bytes; i += 2 * VB) {
      if (i % 64 == 0) __builtin_prefetch(w + i + AHEAD, 0, 2);
      a = bor(a, load(w + i)), b = bor(b, load(w + i + VB));
    }
    return static_cast<float>(isum(bor(a, b)));
  }
  if (variant == "f32") {
    const float* p = reinterpret_cast<const float*>(w);
    const int64_t n = bytes / 4 / COLS;
    for (int64_t r = 0; r < n; ++r) {
      F a = fzero(), b = fzero();
      for (int64_t c = 0; c < COLS; c += 2 * VB / 4) {
        if (c % 16 == 0) __builtin_prefetch(p + r * COLS + c + AHEAD / 4, 0, 2);
        a = fma_f32(p + r * COLS + c, xf + c, a);
        b = fma_f32(p + r * COLS + c + VB / 4, xf + c + VB / 4, b);
      }
      out += fsum(a) + fsum(b);
    }
    return out;
  }
  const bool floats = variant == "int8-float";
  const int64_t n = bytes / COLS;
  for (int64_t r = 0; r < n; ++r) {
    const int8_t* row = w + r * COLS;
    F fa = fzero(), fb = fzero();
    V ia = zero(), ib = zero();
    for (int64_t c = 0; c < COLS; c += 2 * CODES) {
      if (c % 64 == 0) __builtin_prefetch(row + c + AHEAD, 0, 2);
      const V pa = madd(widen(row + c), x + c), pb = madd(widen(row + c + CODES), x + c + CODES);
      if (floats) {
        fa = fma_block(pa, xf[c / 32], fa), fb = fma_block(pb, xf[c / 32 + 1], fb);
      } else {
        ia = add(ia, pa), ib = add(ib, pb);
      }
    }
    out += floats ? fsum(fa) + fsum(fb) : static_cast<float>(isum(add(ia, ib))) * xf[0];
  }
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 4) {
    std::fprintf(stderr, "usage: %s MB REPEATS VARIANT... (read, int8-float, int8-int, f32)\n", argv[0]);
    return 2;
  }
  const int64_t threads = std::max(1u, std::thread::hardware_concurrency());
  const int64_t per = (std::atoll(argv[1]) << 20) / threads / (COLS * 4) * (COLS * 4);  // whole rows of every kind
  const int repeats = std::atoi(argv[2]);
  int8_t* buf = static_cast<int8_t*>(std::aligned_alloc(64, per * threads + AHEAD));
  for (int64_t i = 0; i < per * threads + AHEAD; ++i) buf[i] = static_cast<int8_t>((i * 7) & 63);  // small floats too
  std::vector<int16_t> x(COLS);
  std::vector<float> xf(COLS);
  for (int64_t i = 0; i < COLS; ++i) x[i] = static_cast<int16_t>(i * 3), xf[i] = 1.f / (1 + i);
  for (int rep = 0; rep < repeats; ++rep)
    for (int v = 3; v < argc; ++v) {
      std::vector<float> sink(threads);
      const auto t0 = std::chrono::steady_clock::now();
      std::vector<std::thread> team;
      for (int64_t t = 0; t < threads; ++t)
        team.emplace_back([&, t] { sink[t] = run(argv[v], buf + t * per, per, x.data(), xf.data()); });
      for (auto& t : team) t.join();
      const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      float total = 0.f;
      for (float f : sink) total += f;
      std::printf("%s %.2f %s\n", argv[v], per * threads / s / 1e9, total == 1234.5f ? "!" : "");
    }
  std::free(buf);
  return 0;
}
