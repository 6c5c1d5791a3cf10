// Decode attention: one new token per row over its slot of the KV cache, the query heads that read one KV head
// together.
//
// A (row, KV head) task reads the head's keys and values once for all of its query heads (up to MAX_GROUP at a
// time): each key vector loaded serves every head of the group, and the heads' independent chains (scores, the max,
// the softmax sum, the value sums) interleave, where one head at a time had waited on each chain's latency. Every
// head's arithmetic is the one-head-at-a-time kernel's, in the same order: a score is eight lanes of FMAs over hd then
// the lanes added in order (lane_sums8), the softmax sum is scalar in key order, a value column is one FMA chain over
// the keys skipping zero weights. So a head's output does not depend on its group or on the rows beside it.
// Each thread asks the cache for its KV lines a fixed distance ahead of the ones it reads (KvAhead): the start of
// every task's keys and values had waited on memory. At a 16-row step of the bundled model, contexts 64-128, the
// attention took 2.9-3.0 ms; 2.1-2.3 ms with the hint (1.4 ms when run a second time on cached data).
#pragma once
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "attend.h"

namespace shardlm {

constexpr int MAX_GROUP = 4;  // query heads attended together (larger groups run in chunks)
constexpr int64_t CACHED_KV = 512 * 1024;  // a task's keys and values up to this many bytes stay cached for the next

// A thread's KV reads as one stream: its tasks' keys then values, in order (a task that rereads the one before it
// left out, attend_parts). The loops report the lines they have read (advance); the stream asks the cache for the
// lines up to `lead` past that point.
struct KvAhead {
  std::vector<std::pair<const char*, int64_t>> regions;  // (start, lines) in the order they are read
  size_t region = 0;
  int64_t line = 0;       // the next line to ask for: line `line` of regions[region]
  int64_t read = 0, asked = 0;
  static constexpr int64_t lead = 384;  // 24 KB ahead (128 and 768 did no better, measured)

  __attribute__((always_inline)) inline void advance(int64_t lines) {
    read += lines;
    while (asked < read + lead && region < regions.size()) {
      __builtin_prefetch(regions[region].first + line * 64, 0, 2);
      ++asked;
      if (++line == regions[region].second) line = 0, ++region;
    }
  }
};

// Keys per block of the score loop: G heads x K keys of eight-lane accumulators, the K key vectors and a query
// vector stay in registers (32 with AVX-512, 16 with AVX2).
template <int G>
constexpr int score_keys() {
#if defined(__AVX512F__)
  return G <= 2 ? 8 : G == 3 ? 6 : 5;
#else
  return G == 1 ? 8 : G == 2 ? 4 : G == 3 ? 3 : 2;
#endif
}

// p[g * ld + s] = K[s] . q[g] for t keys (hd values, `hd` apart) and G heads.
template <typename W, int G>
inline void group_scores(const W* keys, const float* const* q, float* p, int64_t ld, int64_t t, int64_t hd,
                         KvAhead& ahead) {
  constexpr int K = score_keys<G>();
  const int64_t hh = hd - hd % 8;
  int64_t s0 = 0;
  for (; s0 + K <= t; s0 += K) {
    v8f acc[G][K];
    for (int g = 0; g < G; ++g)
      for (int r = 0; r < K; ++r) acc[g][r] = v8f{};
    for (int64_t i = 0; i < hh; i += 8) {
      v8f kv[K];
      for (int r = 0; r < K; ++r) kv[r] = load8<W>(keys + (s0 + r) * hd + i);
      for (int g = 0; g < G; ++g) {
        const v8f qv = load8<float>(q[g] + i);
        for (int r = 0; r < K; ++r) acc[g][r] = fma8(kv[r], qv, acc[g][r]);
      }
    }
    for (int g = 0; g < G; ++g) lane_sums8(acc[g], K, p + g * ld + s0);
    ahead.advance(K * hd * static_cast<int64_t>(sizeof(W)) / 64);
  }
  for (; s0 < t; ++s0)  // the last few keys, one at a time, alike
    for (int g = 0; g < G; ++g) {
      v8f acc = v8f{};
      for (int64_t i = 0; i < hh; i += 8) acc = fma8(load8<W>(keys + s0 * hd + i), load8<float>(q[g] + i), acc);
      lane_sums8(&acc, 1, p + g * ld + s0);
    }
  if (hh < hd)
    for (int g = 0; g < G; ++g)
      for (int64_t s = 0; s < t; ++s)
        for (int64_t i = hh; i < hd; ++i) p[g * ld + s] += load<W>(keys, s * hd + i) * q[g][i];
}

// Each head's scores scaled, then softmax weights (masked keys 0) normalised: the max over allowed keys (exact in
// any order), e^(p - max) lane by lane (softmax_weights' exp), the sum scalar in key order, then the division.
template <int G>
inline void group_softmax(float* p, int64_t ld, const bool* allowed, int64_t t, float scale) {
  float top[G], total[G];
  for (int g = 0; g < G; ++g) top[g] = -std::numeric_limits<float>::infinity(), total[g] = 0.f;
  for (int64_t s = 0; s < t; ++s)
    for (int g = 0; g < G; ++g) {
      float& v = p[g * ld + s];
      v = v * scale;
      if (allowed[s]) top[g] = std::max(top[g], v);
    }
  for (int g = 0; g < G; ++g) exp_shifted(p + g * ld, top[g], t);
  for (int64_t s = 0; s < t; ++s)
    for (int g = 0; g < G; ++g) {
      float& v = p[g * ld + s];
      v = allowed[s] ? v : 0.f;
      total[g] += v;
    }
  for (int g = 0; g < G; ++g) {
    const float inv = 1.f / total[g];
    for (int64_t s = 0; s < t; ++s) p[g * ld + s] = p[g * ld + s] * inv;
  }
}

// o[g][c0 .. c0 + 8 NV) = sum_s w[g * ld + s] V[s, same columns] over t values, skipping zero weights: one FMA chain
// per column over s in order (8 NV columns in NV eight-lane registers per head).
template <typename W, int G, int NV>
inline void group_values8(const W* vals, const float* w, float* const* o, int64_t ld, int64_t t, int64_t hd,
                          int64_t c0, KvAhead* ahead) {
  v8f acc[G][NV];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < NV; ++c) acc[g][c] = v8f{};
  for (int64_t s = 0; s < t; ++s) {
    if (ahead != nullptr && (s & 7) == 7) ahead->advance(8 * hd * static_cast<int64_t>(sizeof(W)) / 64);
    v8f v[NV];
    for (int c = 0; c < NV; ++c) v[c] = load8<W>(vals + s * hd + c0 + 8 * c);
    for (int g = 0; g < G; ++g) {
      const float ws = w[g * ld + s];
      if (ws == 0.f) continue;
      const v8f b = v8f{} + ws;
      for (int c = 0; c < NV; ++c) acc[g][c] = fma8(v[c], b, acc[g][c]);
    }
  }
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < NV; ++c) std::memcpy(o[g] + c0 + 8 * c, &acc[g][c], sizeof(v8f));
}

#if defined(__AVX512F__)
template <typename W>
inline __m512 load16w(const W* p);
template <>
inline __m512 load16w<float>(const float* p) { return _mm512_loadu_ps(p); }
template <>
inline __m512 load16w<uint16_t>(const uint16_t* p) {  // bfloat16: the high half of a float32
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}

// group_values8 for 64 columns in four 512-bit registers per head: each lane is the same FMA chain.
template <typename W, int G>
inline void group_values64(const W* vals, const float* w, float* const* o, int64_t ld, int64_t t, int64_t hd,
                           int64_t c0, KvAhead* ahead) {
  __m512 acc[G][4];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < 4; ++c) acc[g][c] = _mm512_setzero_ps();
  for (int64_t s = 0; s < t; ++s) {
    if (ahead != nullptr && (s & 7) == 7) ahead->advance(8 * hd * static_cast<int64_t>(sizeof(W)) / 64);
    __m512 v[4];
    for (int c = 0; c < 4; ++c) v[c] = load16w<W>(vals + s * hd + c0 + 16 * c);
    for (int g = 0; g < G; ++g) {
      const float ws = w[g * ld + s];
      if (ws == 0.f) continue;
      const __m512 b = _mm512_set1_ps(ws);
      for (int c = 0; c < 4; ++c) acc[g][c] = _mm512_fmadd_ps(v[c], b, acc[g][c]);
    }
  }
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < 4; ++c) _mm512_storeu_ps(o[g] + c0 + 16 * c, acc[g][c]);
}
#endif

// o[g] = sum_s w[g * ld + s] V[s] over t values of hd: blocks of 64 columns (AVX-512) or 32, then of eight, then
// the last hd % 8 columns one at a time (product, then sum, as the eight-lane chains' scalar tail always did). The
// first block's pass advances `ahead`.
template <typename W, int G>
inline void group_values(const W* vals, const float* w, float* const* o, int64_t ld, int64_t t, int64_t hd,
                         KvAhead& ahead) {
  int64_t i = 0;
#if defined(__AVX512F__)
  for (; i + 64 <= hd; i += 64) group_values64<W, G>(vals, w, o, ld, t, hd, i, i == 0 ? &ahead : nullptr);
#endif
  constexpr int NV = G <= 3 ? 4 : 2;  // AVX2: G x NV accumulators + NV values of 16 registers
  for (; i + 8 * NV <= hd; i += 8 * NV) group_values8<W, G, NV>(vals, w, o, ld, t, hd, i, i == 0 ? &ahead : nullptr);
  for (; i + 8 <= hd; i += 8) group_values8<W, G, 1>(vals, w, o, ld, t, hd, i, i == 0 ? &ahead : nullptr);
  for (; i < hd; ++i)
    for (int g = 0; g < G; ++g) {
      float acc = 0.f;
      for (int64_t s = 0; s < t; ++s)
        if (w[g * ld + s] != 0.f) acc += w[g * ld + s] * load<W>(vals, s * hd + i);
      o[g][i] = acc;
    }
}

// One task: query heads heads[0..G) of row j, all reading the keys and values at `keys`/`vals` (t positions).
template <typename W, int G>
inline void attend_group(const W* keys, const W* vals, const float* const* q, float* const* o, const bool* allowed,
                         int64_t t, int64_t hd, float scale, float* p, KvAhead& ahead) {
  group_scores<W, G>(keys, q, p, t, t, hd, ahead);
  group_softmax<G>(p, t, allowed, t, scale);
  group_values<W, G>(vals, p, o, t, t, hd, ahead);
}

// A (row, KV head) task: up to MAX_GROUP query heads of one row reading one KV head.
struct AttnTask {
  int64_t row, kv, lo, n, first;  // cache row, KV head, first allowed position, positions, index into heads
  int nh;
};

// The tasks of a step: for each row j and KV head, its query heads (map[h] == KV head) in chunks of `group`, over
// the row's allowed span; `heads` gets each task's query heads as indices j * hq + h.
inline std::vector<AttnTask> group_tasks(const int64_t* row_of, const int64_t* map, const bool* mask, int64_t b,
                                         int64_t hq, int64_t hkv, int64_t t, int64_t group, std::vector<int64_t>& heads) {
  std::vector<AttnTask> tasks;
  for (int64_t j = 0; j < b; ++j) {
    const auto [lo, hi] = allowed_span(mask + j * t, t);
    for (int64_t kv = 0; kv < hkv; ++kv) {
      const int64_t start = static_cast<int64_t>(heads.size());
      for (int64_t h = 0; h < hq; ++h)
        if (map[h] == kv) heads.push_back(j * hq + h);
      const int64_t end = static_cast<int64_t>(heads.size());
      for (int64_t f = start; f < end; f += group)
        tasks.push_back({row_of[j], kv, lo, hi - lo, f, static_cast<int>(std::min<int64_t>(group, end - f))});
    }
  }
  return tasks;
}

// A step's attention work: its tasks (group_tasks) and their split into `parts` runs of about equal cost (a task
// costs its span plus a fixed part, times its heads). The same for every layer of a step with the same KV map.
struct AttnPlan {
  std::vector<AttnTask> tasks;
  std::vector<int64_t> heads, runs;
  int64_t parts = 0;
};

inline AttnPlan plan_attention(const int64_t* row_of, const int64_t* map, const bool* mask, int64_t b, int64_t hq,
                               int64_t hkv, int64_t t, int64_t threads) {
  AttnPlan plan;
  // Few rows: a task a head, so the threads split the work evenly (one row's three KV heads split two to one).
  const int64_t group = b * hkv >= 4 * threads ? MAX_GROUP : 1;
  plan.tasks = group_tasks(row_of, map, mask, b, hq, hkv, t, group, plan.heads);
  const int64_t n_tasks = static_cast<int64_t>(plan.tasks.size());
  plan.parts = std::min<int64_t>(threads, n_tasks);
  if (plan.parts > 0)
    plan.runs = cost_runs(n_tasks, plan.parts, [&](int64_t i) {
      return static_cast<double>((plan.tasks[i].n + 8) * plan.tasks[i].nh);  // + 8: the per-head setup
    });
  return plan;
}

// The tasks of parts [first, last) of `plan`, on the calling thread; p: MAX_GROUP * max(t, 1) floats of scratch.
template <typename W>
void attend_parts(const AttnPlan& plan, int64_t first, int64_t last, const float* q, const W* keys, const W* vals,
                  const bool* mask, float* out, int64_t hq, int64_t hkv, int64_t hd, int64_t max_len, int64_t t,
                  float* p) {
  const float scale = 1.f / std::sqrt(static_cast<float>(hd));
  auto base_of = [&](const AttnTask& a) { return ((a.row * hkv + a.kv) * max_len + a.lo) * hd; };
  auto lines_of = [&](const AttnTask& a) { return (a.n * hd * static_cast<int64_t>(sizeof(W)) + 63) / 64; };
  // A task that reads the keys and values of the task before it (the row's other query heads of one KV head, at few
  // rows a task a head) finds them in the caches and asks for none, where they fit in CACHED_KV (half of this VM's
  // 1 MB L2: 1024 positions at hd 64 in float32). Asking for them again had cost the bundled model's batch-1 int8
  // step 40-70 us a token in prefetch loops (each thread's attention 230-260 -> 190 us a token, timed per phase; the
  // whole step 0.96-1.03x the time over four in-process A/B runs of paired rounds: within this VM's noise).
  auto again = [&](int64_t i) {
    if (i == plan.runs[first]) return false;
    const AttnTask &a = plan.tasks[i], &b = plan.tasks[i - 1];
    return a.row == b.row && a.kv == b.kv && a.lo == b.lo && a.n == b.n && 2 * lines_of(a) * 64 <= CACHED_KV;
  };
  KvAhead ahead, none;  // `none` asks for nothing
  for (int64_t i = plan.runs[first]; i < plan.runs[last]; ++i)
    if (lines_of(plan.tasks[i]) > 0 && !again(i)) {
      ahead.regions.push_back({reinterpret_cast<const char*>(keys + base_of(plan.tasks[i])), lines_of(plan.tasks[i])});
      ahead.regions.push_back({reinterpret_cast<const char*>(vals + base_of(plan.tasks[i])), lines_of(plan.tasks[i])});
    }
  ahead.advance(0);
  int64_t prefix = 0;  // lines of this thread's tasks before task i (rereading tasks left out)
  for (int64_t i = plan.runs[first]; i < plan.runs[last]; ++i) {
    const AttnTask& a = plan.tasks[i];
    const bool cached = again(i);
    if (!cached) {
      ahead.read = prefix;  // resynchronise (the loops' counts leave out tails)
      prefix += 2 * lines_of(a);
    }
    KvAhead& stream = cached ? none : ahead;
    const float* qs[MAX_GROUP];
    float* os[MAX_GROUP];
    for (int g = 0; g < a.nh; ++g) qs[g] = q + plan.heads[a.first + g] * hd, os[g] = out + plan.heads[a.first + g] * hd;
    const int64_t base = base_of(a);
    const bool* allowed = mask + (plan.heads[a.first] / hq) * t + a.lo;
    switch (a.nh) {
      case 1: attend_group<W, 1>(keys + base, vals + base, qs, os, allowed, a.n, hd, scale, p, stream); break;
      case 2: attend_group<W, 2>(keys + base, vals + base, qs, os, allowed, a.n, hd, scale, p, stream); break;
      case 3: attend_group<W, 3>(keys + base, vals + base, qs, os, allowed, a.n, hd, scale, p, stream); break;
      default: attend_group<W, 4>(keys + base, vals + base, qs, os, allowed, a.n, hd, scale, p, stream);
    }
  }
}

// Attention of one token per row j over the cache: for each query head h, softmax(K q_h / sqrt(hd)) V, with K and
// V the rows of KV head map[h] of slot row_of[j], positions allowed by mask (b, t), each row over its own allowed
// span (allowed_span).
//   q (b, hq, hd) float32; keys/vals: the cache (slots, hkv, max_len, hd) in W; out (b, hq, hd) float32.
// The threads take the runs of plan_attention.
template <typename W>
void attend_heads(const float* q, const W* keys, const W* vals, const int64_t* row_of, const int64_t* map,
                  const bool* mask, float* out, int64_t b, int64_t hq, int64_t hkv, int64_t hd, int64_t max_len,
                  int64_t t) {
  const AttnPlan plan = plan_attention(row_of, map, mask, b, hq, hkv, t, at::get_num_threads());
  if (plan.parts == 0) return;
  at::parallel_for(0, plan.parts, 1, [&](int64_t first, int64_t last) {
    std::vector<float> p(static_cast<size_t>(MAX_GROUP * std::max<int64_t>(t, 1)));
    attend_parts<W>(plan, first, last, q, keys, vals, mask, out, hq, hkv, hd, max_len, t, p.data());
  });
}

}  // namespace shardlm
