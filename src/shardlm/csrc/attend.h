// Decode attention over the KV cache and the MLP's activation, vectorised: an exp over eight or sixteen lanes,
// silu(g) * u, and each row's attention for a run of query heads that read one KV head.
#pragma once
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <utility>
#include <vector>
#include "rows.h"

namespace shardlm {

typedef int32_t v8i32 __attribute__((vector_size(32)));

// e^x in each lane, within 2 ulp of the true value (Cephes' expf: x = n ln2 + r, a degree-6 polynomial in r, then
// 2^n through the exponent bits). x is clamped to [-87, 88] (e^-87 = 1.6e-38 stands in for anything smaller, e^88 =
// 1.7e38 for anything larger); a NaN stays NaN. Lane by lane: a value does not depend on its neighbours, so a row's
// result does not depend on the rows batched with it. Every product and sum is rounded on its own (the build turns
// contraction off), so the same x gives the same e^x on every CPU this builds for, and in a vector of any width:
// V is eight lanes (v8f) or, on AVX-512 builds, sixteen (v16f), with VI its int32 vector.
template <typename V, typename VI>
inline V exp_lanes(V x) {
  const V hi = V{} + 88.f, lo = V{} - 87.f;
  x = x > hi ? hi : x;  // a NaN fails both tests and stays
  x = x < lo ? lo : x;
  const V fx = x * 1.44269504088896341f + 0.5f;
  V n = __builtin_convertvector(__builtin_convertvector(fx, VI), V);  // truncation ...
  n = n > fx ? n - 1.f : n;                                           // ... then floor
  x = x - n * 0.693359375f;  // ln 2 in two parts: the first exact in few bits, so n * it is exact
  x = x - n * -2.12194440e-4f;
  V p = V{} + 1.9875691500e-4f;
  p = p * x + 1.3981999507e-3f;
  p = p * x + 8.3334519073e-3f;
  p = p * x + 4.1665795894e-2f;
  p = p * x + 1.6666665459e-1f;
  p = p * x + 5.0000001201e-1f;
  p = p * (x * x) + x + 1.f;
  const VI bits = (__builtin_convertvector(n, VI) + 127) << 23;  // 2^n, n in [-126, 127]
  V scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

inline v8f exp8(v8f x) { return exp_lanes<v8f, v8i32>(x); }

#if defined(__AVX512F__)
// Sixteen lanes: where the CPU has 512-bit units, one pass of the same arithmetic does twice the values (the exp
// was a third of prefill attention's time in eight lanes, `perf`).
typedef float v16f __attribute__((vector_size(64)));
typedef int32_t v16i32 __attribute__((vector_size(64)));
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

// p[s] = e^(p[s] - top) where allowed[s], else 0, over t scores; returns their sum, added in order s = 0, 1, ...
inline float softmax_weights(float* p, const bool* allowed, float top, int64_t t) {
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
  float total = 0.f;
  for (int64_t s = 0; s < t; ++s) {
    p[s] = allowed[s] ? p[s] : 0.f;
    total += p[s];
  }
  return total;
}

// p[s] = K[s] . q for t keys of hd values (keys `hd` apart): eight keys at a time, each key's eight lanes fused over
// hd in order, the lanes added in order (lane_sums8), then the products past the last multiple of 8; a score does
// not depend on t or on the key's place.
template <typename W>
inline void key_scores(const W* keys, const float* q, float* p, int64_t t, int64_t hd) {
  const int64_t hh = hd - hd % 8;
  v8f acc[8];
  float out[8];
  int64_t s0 = 0;
  for (; s0 + 8 <= t; s0 += 8) {
    for (int r = 0; r < 8; ++r) acc[r] = v8f{};
    for (int64_t i = 0; i < hh; i += 8) {
      const v8f qv = load8<float>(q + i);
      for (int r = 0; r < 8; ++r) acc[r] = fma8(load8<W>(keys + (s0 + r) * hd + i), qv, acc[r]);
    }
    lane_sums8(acc, 8, p + s0);
  }
  for (; s0 < t; ++s0) {  // the last few keys, one at a time, alike
    acc[0] = v8f{};
    for (int64_t i = 0; i < hh; i += 8) acc[0] = fma8(load8<W>(keys + s0 * hd + i), load8<float>(q + i), acc[0]);
    lane_sums8(acc, 1, out);
    p[s0] = out[0];
  }
  if (hh < hd)
    for (int64_t s = 0; s < t; ++s)
      for (int64_t i = hh; i < hd; ++i) p[s] += load<W>(keys, s * hd + i) * q[i];
}

// o[0:64] = sum_s w[s] V[s, 0:64] over t values `ld` apart, skipping zero weights: eight accumulators that stay in
// registers while the values stream (indexed only by constants).
template <typename W>
__attribute__((always_inline)) inline void values_block64(const W* vals, int64_t ld, const float* w, float* o,
                                                          int64_t t) {
  v8f acc[8];
  for (int c = 0; c < 8; ++c) acc[c] = v8f{};
  for (int64_t s = 0; s < t; ++s) {
    if (w[s] == 0.f) continue;
    const v8f ws = v8f{} + w[s];
    for (int c = 0; c < 8; ++c) acc[c] = fma8(load8<W>(vals + s * ld + 8 * c), ws, acc[c]);
  }
  for (int c = 0; c < 8; ++c) std::memcpy(o + 8 * c, &acc[c], sizeof(v8f));
}

// o = sum_s w[s] V[s] over t values of hd, skipping zero weights: blocks of 64 columns, then of eight (a column's
// sum is the same chain of FMAs over s in either), then the last hd % 8 columns one at a time.
template <typename W>
inline void weighted_values(const W* vals, const float* w, float* o, int64_t t, int64_t hd) {
  int64_t i = 0;
  for (; i + 64 <= hd; i += 64) values_block64<W>(vals + i, hd, w, o + i, t);
  for (; i + 8 <= hd; i += 8) {
    v8f acc = v8f{};
    for (int64_t s = 0; s < t; ++s)
      if (w[s] != 0.f) acc = fma8(load8<W>(vals + s * hd + i), v8f{} + w[s], acc);
    std::memcpy(o + i, &acc, sizeof(v8f));
  }
  for (; i < hd; ++i) {
    float acc = 0.f;
    for (int64_t s = 0; s < t; ++s)
      if (w[s] != 0.f) acc += w[s] * load<W>(vals, s * hd + i);
    o[i] = acc;
  }
}

// The positions [lo, hi) a row may see: from its first allowed one to its last. Scores outside are dropped by the
// softmax anyway (weight 0, skipped by the value sum; adding 0 to the sum changes nothing), so leaving them out
// changes no value, and a row's cache is read only as far as its own tokens (t is the longest row's).
inline std::pair<int64_t, int64_t> allowed_span(const bool* allowed, int64_t t) {
  int64_t lo = 0, hi = t;
  while (lo < hi && !allowed[lo]) ++lo;
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

// Attention of one token per row j over the cache: for each query head h, softmax(K q_h / sqrt(hd)) V, with K and
// V the rows of KV head map[h] of slot row_of[j], positions allowed by mask (b, t), each row over its own allowed
// span (allowed_span).
//   q (b, hq, hd) float32; keys/vals: the cache (slots, hkv, max_len, hd) in W; out (b, hq, hd) float32.
// Tasks are (row, head) pairs; each one's arithmetic is the same whatever the batch (batch invariance). The threads
// take runs of tasks of about equal cost (a task costs its span plus a fixed part), so a batch of a few long rows
// and many short ones keeps every thread busy: equal counts of tasks left one thread with the long rows.
template <typename W>
void attend_heads(const float* q, const W* keys, const W* vals, const int64_t* row_of, const int64_t* map,
                  const bool* mask, float* out, int64_t b, int64_t hq, int64_t hkv, int64_t hd, int64_t max_len,
                  int64_t t) {
  const float scale = 1.f / std::sqrt(static_cast<float>(hd));
  std::vector<std::pair<int64_t, int64_t>> spans(static_cast<size_t>(b));
  for (int64_t j = 0; j < b; ++j) spans[j] = allowed_span(mask + j * t, t);
  const int64_t parts = std::min<int64_t>(at::get_num_threads(), b * hq);
  const auto runs = cost_runs(b * hq, parts, [&](int64_t task) {
    const auto [lo, hi] = spans[task / hq];
    return static_cast<double>(hi - lo + 8);  // + 8: the per-task setup, in positions' worth
  });
  at::parallel_for(0, parts, 1, [&](int64_t first, int64_t last) {
    std::vector<float> p(static_cast<size_t>(t));
    for (int64_t task = runs[first]; task < runs[last]; ++task) {
      const int64_t j = task / hq, h = task % hq;
      const auto [lo, hi] = spans[j];
      const int64_t base = ((row_of[j] * hkv + map[h]) * max_len + lo) * hd, n = hi - lo;
      const bool* allowed = mask + j * t + lo;
      key_scores<W>(keys + base, q + task * hd, p.data(), n, hd);
      float top = -std::numeric_limits<float>::infinity();
      for (int64_t s = 0; s < n; ++s) {
        p[s] = p[s] * scale;
        if (allowed[s]) top = std::max(top, p[s]);
      }
      const float inv = 1.f / softmax_weights(p.data(), allowed, top, n);
      for (int64_t s = 0; s < n; ++s) p[s] = p[s] * inv;
      weighted_values<W>(vals + base, p.data(), out + task * hd, n, hd);
    }
  });
}

}  // namespace shardlm
