// The vector pieces of attention and of the MLP's activation: an exp over eight or sixteen lanes, silu(g) * u, the
// shifted exp of a row of scores, a row's allowed span and cost-balanced runs of tasks (decode attention itself is
// decode_attn.h; prefill's, prefill_attn.h).
#pragma once
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <utility>
#include <vector>
#include "rows.h"
#if defined(__AVX__)
#include <immintrin.h>
#endif

namespace shardlm {

typedef int32_t v8i32 __attribute__((vector_size(32)));

#if defined(__AVX512F__)
typedef float v16f __attribute__((vector_size(64)));
typedef int32_t v16i32 __attribute__((vector_size(64)));
#endif

// floor(v) in each lane, |v| < 2^31: one rounding instruction where the CPU has one, else truncation then a step
// down where it went up. Both give the same value (and e^x below the same bits).
template <typename V, typename VI>
inline V floor_lanes(V v) {
  const V n = __builtin_convertvector(__builtin_convertvector(v, VI), V);
  return n > v ? n - 1.f : n;
}
#if defined(__AVX__)
template <>
inline v8f floor_lanes<v8f, v8i32>(v8f v) {
  return reinterpret_cast<v8f>(_mm256_floor_ps(reinterpret_cast<__m256>(v)));
}
#endif
#if defined(__AVX512F__)
template <>
inline v16f floor_lanes<v16f, v16i32>(v16f v) {
  return reinterpret_cast<v16f>(
      _mm512_roundscale_ps(reinterpret_cast<__m512>(v), _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC));
}
#endif

// p * 2^n in each lane for whole n in [-126, 127]: 2^n built in the exponent bits then one product, or one scalef
// where the CPU has AVX-512 (the same single rounding of the same exact product, so the same bits).
template <typename V, typename VI>
inline V times_pow2(V p, V n) {
  const VI bits = (__builtin_convertvector(n, VI) + 127) << 23;
  V scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}
#if defined(__AVX512F__) && defined(__AVX512VL__)
template <>
inline v8f times_pow2<v8f, v8i32>(v8f p, v8f n) {
  return reinterpret_cast<v8f>(_mm256_scalef_ps(reinterpret_cast<__m256>(p), reinterpret_cast<__m256>(n)));
}
#endif
#if defined(__AVX512F__)
template <>
inline v16f times_pow2<v16f, v16i32>(v16f p, v16f n) {
  return reinterpret_cast<v16f>(_mm512_scalef_ps(reinterpret_cast<__m512>(p), reinterpret_cast<__m512>(n)));
}
#endif

// e^x in each lane, within 2 ulp of the true value (Cephes' expf: x = n ln2 + r, a degree-6 polynomial in r, then
// 2^n through the exponent bits). x is clamped to [-87, 88] (e^-87 = 1.6e-38 stands in for anything smaller, e^88 =
// 1.7e38 for anything larger); a NaN stays NaN. Lane by lane: a value does not depend on its neighbours, so a row's
// result does not depend on the rows batched with it. Every product and sum is rounded on its own (the build turns
// contraction off), so the same x gives the same e^x on every CPU this builds for, and in a vector of any width:
// V is eight lanes (v8f) or, on AVX-512 builds, sixteen (v16f), with VI its int32 vector. (floor_lanes and
// times_pow2 take 2 instructions where the integer round trips took 8: the exp was 30 % of prefill attention.)
template <typename V, typename VI>
inline V exp_lanes(V x) {
  const V hi = V{} + 88.f, lo = V{} - 87.f;
  x = x > hi ? hi : x;  // a NaN fails both tests and stays
  x = x < lo ? lo : x;
  const V n = floor_lanes<V, VI>(x * 1.44269504088896341f + 0.5f);
  x = x - n * 0.693359375f;  // ln 2 in two parts: the first exact in few bits, so n * it is exact
  x = x - n * -2.12194440e-4f;
  V p = V{} + 1.9875691500e-4f;
  p = p * x + 1.3981999507e-3f;
  p = p * x + 8.3334519073e-3f;
  p = p * x + 4.1665795894e-2f;
  p = p * x + 1.6666665459e-1f;
  p = p * x + 5.0000001201e-1f;
  p = p * (x * x) + x + 1.f;
  return times_pow2<V, VI>(p, n);  // n in [-126, 127]
}

inline v8f exp8(v8f x) { return exp_lanes<v8f, v8i32>(x); }

#if defined(__AVX512F__)
// Sixteen lanes: where the CPU has 512-bit units, one pass of the same arithmetic does twice the values (the exp
// was a third of prefill attention's time in eight lanes, `perf`).
inline v16f exp16(v16f x) { return exp_lanes<v16f, v16i32>(x); }
inline v16f load16(const float* p) {
  v16f v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
// The two eight-lane halves of a sixteen-lane vector.
inline v8f low8(v16f v) { return __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7); }
inline v8f high8(v16f v) { return __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15); }
#endif

// a[i] = silu(g[i]) * a[i] = g[i] / (1 + e^-g[i]) * a[i] over n values, sixteen (AVX-512 builds) or eight at a time,
// the last few through the eight-lane code, so every value is computed alike whatever the run it falls in. Whole
// runs are loaded and stored with a constant size (one vector load or store); a copy of a variable size had compiled
// to a byte-copy sequence costing more than the exp (3.7 us of a 1536-value row, about 2.4 ns a value, measured).
template <typename V, typename VI>
inline V silu_mul_lanes(V g, V a) { return a * (g / (1.f + exp_lanes<V, VI>(-g))); }
inline v8f silu_mul8(v8f g, v8f a) { return silu_mul_lanes<v8f, v8i32>(g, a); }

inline void silu_mul(float* a, const float* g, int64_t n) {
  int64_t i = 0;
#if defined(__AVX512F__)
  for (; i + 16 <= n; i += 16) {
    const v16f av = silu_mul_lanes<v16f, v16i32>(load16(g + i), load16(a + i));
    std::memcpy(a + i, &av, sizeof(v16f));
  }
#endif
  for (; i + 8 <= n; i += 8) {
    const v8f av = silu_mul8(load8<float>(g + i), load8<float>(a + i));
    std::memcpy(a + i, &av, sizeof(v8f));
  }
  if (i < n) {
    const int64_t m = n - i;
    v8f gv{}, av{};
    std::memcpy(&gv, g + i, m * sizeof(float));
    std::memcpy(&av, a + i, m * sizeof(float));
    av = silu_mul8(gv, av);
    std::memcpy(a + i, &av, m * sizeof(float));
  }
}

// p[s] = e^(p[s] - top) over t scores, lane by lane (masked keys too: the caller zeroes them).
inline void exp_shifted(float* p, float top, int64_t t) {
  int64_t s = 0;
#if defined(__AVX512F__)
  for (; s + 16 <= t; s += 16) {
    const v16f v = exp16(load16(p + s) - top);
    std::memcpy(p + s, &v, sizeof(v16f));
  }
#endif
  for (; s + 8 <= t; s += 8) {  // whole runs of eight copied with a constant size, as in silu_mul
    const v8f v = exp8(load8<float>(p + s) - top);
    std::memcpy(p + s, &v, sizeof(v8f));
  }
  if (s < t) {
    const int64_t m = t - s;
    v8f v{};
    std::memcpy(&v, p + s, m * sizeof(float));
    v = exp8(v - top);
    std::memcpy(p + s, &v, m * sizeof(float));
  }
}

// The positions [lo, hi) a row may see: from its first allowed one to its last. Scores outside are dropped by the
// softmax anyway (weight 0, skipped by the value sum; adding 0 to the sum changes nothing), so leaving them out
// changes no value, and a row's cache is read only as far as its own tokens (t is the longest row's).
// The scans skip eight masked keys a step (a bool false is a zero byte): a causal prompt's rows end at every key
// of the window, and a byte at a time the backward scans took a tenth of prefill attention's time (`perf`).
inline std::pair<int64_t, int64_t> allowed_span(const bool* allowed, int64_t t) {
  int64_t lo = 0, hi = t;
  const auto none = [&](int64_t at) {  // the eight bools from `at` all false
    uint64_t word;
    std::memcpy(&word, allowed + at, sizeof(word));
    return word == 0;
  };
  while (hi - lo >= 8 && none(lo)) lo += 8;
  while (lo < hi && !allowed[lo]) ++lo;
  while (hi - lo >= 8 && none(hi - 8)) hi -= 8;
  while (hi > lo && !allowed[hi - 1]) --hi;
  return {lo, hi};
}

// Tasks [0, n) with costs cost(task) >= 0 cut into `parts` runs of consecutive tasks of about equal total cost:
// run i is [bounds[i], bounds[i + 1]). A run ends after the task whose cost first reaches i + 1 parts' share.
template <typename Cost>
inline std::vector<int64_t> cost_runs(int64_t n, int64_t parts, Cost cost) {
  std::vector<int64_t> bounds(static_cast<size_t>(parts) + 1, n);
  bounds[0] = 0;
  double total = 0;
  for (int64_t i = 0; i < n; ++i) total += cost(i);
  double sum = 0;
  int64_t part = 1;
  for (int64_t i = 0; i < n && part < parts; ++i) {
    sum += cost(i);
    while (part < parts && sum >= total * part / parts) bounds[part++] = i + 1;
  }
  return bounds;
}

}  // namespace shardlm
