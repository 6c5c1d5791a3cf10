// Prefill attention on CPU, blocked: MR query rows of one head at a time (qgemm.h's register tile shape), their
// scores against the keys they may see as an FMA tile over K^T, each row's softmax on its own range, then P V as a
// second FMA tile. Keys no row of a block may see are skipped, so a causal pass does about half the work of a full
// one (SDPA's CPU kernel computes whole key blocks up to 512 wide).
//
// Same arithmetic whatever the batch or the chunk: a score is one FMA chain over the head dimension in order; a
// row's softmax runs over its own allowed keys (max, e^x lane by lane, the sum in eight lanes from its first key);
// an output is one FMA chain over keys in order, and the keys a row may not see add exact zeros. So a position's
// result depends on its query and the keys and values it may see, not on the rows padded or blocked beside it,
// nor on where a chunk of its prompt started. bfloat16 on builds with avx512_bf16 takes both tiles as dot products
// of bfloat16 pairs instead (prefill_dot.h), with the same independence.
#pragma once
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cstring>
#include <type_traits>
#include <vector>
#include "attend.h"
#include "decode.h"
#include "prefill_dot.h"
#include "qgemm.h"

namespace shardlm {

// A block of rows' allowed key range: lo[r], hi[r] for each of its m rows of mask (each row t wide).
inline void key_ranges(const bool* mask, int64_t m, int64_t t, int64_t* lo, int64_t* hi) {
  for (int64_t r = 0; r < m; ++r) {
    const auto [l, h] = allowed_span(mask + r * t, t);  // attend.h
    lo[r] = l, hi[r] = h;
  }
}

// Row p (n = hi - lo scores of its allowed range, scaled in place) -> softmax weights, masked keys 0. The max is
// exact in any order; e^x is lane by lane; the sum runs in eight lanes from the row's first key, then the lanes in
// order (lane_sums8). A range with no masked key inside (causal rows, padding, windows) skips the per-key test.
// (Decode keeps its own sum, scalar in key order (attend.h softmax_weights): moving it to eight lanes changed
// bfloat16 greedy tokens of the bundled model at near ties, measured.)
inline void softmax_row(float* p, const bool* allowed, int64_t n, float scale) {
  // No masked key in the range (a bool false is a zero byte; memchr scans it a vector at a time, where a loop over
  // bools went byte by byte: an eighth of this function's time).
  const bool dense = std::memchr(allowed, 0, static_cast<size_t>(n)) == nullptr;
  float top = -std::numeric_limits<float>::infinity();
  int64_t c = 0;
  if (dense) {  // scale and the max in one pass (the max is exact in any order)
    vpf mv = vpf{} + top;
    for (; c + VL <= n; c += VL) {
      vpf x;
      std::memcpy(&x, p + c, sizeof(x));
      x = x * scale;
      std::memcpy(p + c, &x, sizeof(x));
      mv = x > mv ? x : mv;
    }
    for (int64_t l = 0; l < VL; ++l) top = std::max(top, mv[l]);
  }
  for (; c < n; ++c) p[c] = p[c] * scale;
  if (dense) {
    for (c = n - n % VL; c < n; ++c) top = std::max(top, p[c]);
  } else {
    for (c = 0; c < n; ++c)
      if (allowed[c]) top = std::max(top, p[c]);
  }
  v8f lanes = v8f{};
  c = 0;
#if defined(__AVX512F__)
  for (; c + 16 <= n; c += 16) {  // sixteen values, added to the eight lanes as two runs of eight in order
    v16f x = exp16(load16(p + c) - top);
    if (!dense)
      for (int l = 0; l < 16; ++l) x[l] = allowed[c + l] ? x[l] : 0.f;
    lanes = lanes + low8(x);
    lanes = lanes + high8(x);
    std::memcpy(p + c, &x, sizeof(x));
  }
#endif
  for (; c + 8 <= n; c += 8) {
    v8f x = exp8(load8<float>(p + c) - top);
    if (!dense)
      for (int l = 0; l < 8; ++l) x[l] = allowed[c + l] ? x[l] : 0.f;
    lanes = lanes + x;
    std::memcpy(p + c, &x, sizeof(x));
  }
  if (c < n) {
    const int64_t m = n - c;
    v8f x{};
    std::memcpy(&x, p + c, m * sizeof(float));
    x = exp8(x - top);
    for (int64_t l = 0; l < 8; ++l) x[l] = l < m && allowed[c + l] ? x[l] : 0.f;
    lanes = lanes + x;
    std::memcpy(p + c, &x, m * sizeof(float));
  }
  float total;
  lane_sums8(&lanes, 1, &total);
  const float inv = 1.f / total;
  for (int64_t k = 0; k < n; ++k) p[k] = p[k] * inv;
}

// y[r, 0:2 VL] = sum_i x[r * ldx + i] * b[i * ldb + 0:2 VL] over i in [0, k), for R rows: one FMA chain per output
// in order of i, two vectors of b and R broadcasts of x feeding 2 R FMAs (qgemm.h's panel tile, with b's rows ldb
// apart). Scores are q (R, hd) against K^T, outputs P (R, n) against V.
template <int R>
inline void fma_tile(const float* x, int64_t ldx, const float* b, int64_t ldb, int64_t k, float* y, int64_t ldy) {
  vpf acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = vpf{};
  for (int64_t i = 0; i < k; ++i) {
    const vpf b0 = load_p(b + i * ldb), b1 = load_p(b + i * ldb + VL);
    for (int r = 0; r < R; ++r) {
      const vpf xb = splat_p(x + r * ldx + i);
      acc[r][0] = fma_p(b0, xb, acc[r][0]);
      acc[r][1] = fma_p(b1, xb, acc[r][1]);
    }
  }
  for (int r = 0; r < R; ++r) {
    std::memcpy(y + r * ldy, &acc[r][0], sizeof(vpf));
    std::memcpy(y + r * ldy + VL, &acc[r][1], sizeof(vpf));
  }
}

// One block of R rows of head h of sequence j, the first m real (results of rows past m are dropped). scores(c, y,
// ldy) writes the R rows' scores against keys c .. c + 2 VL at y (rows ldy apart; keys past t score zero);
// values(S, ldS, c0, c1, lo, hi) writes out (R, hdp) from the softmax weights S[r, c - c0] of keys [c0, c1) (zero
// outside each row's keys [lo[r], hi[r]); rows ldS apart); S: scratch.
template <int R, typename Scores, typename Values>
void attend_block(Scores scores, Values values, const bool* mask, int64_t m, int64_t t, int64_t hd,
                  std::vector<float>& S, float* out, int64_t hdp) {
  int64_t lo[R], hi[R];
  key_ranges(mask, m, t, lo, hi);
  int64_t c0 = t, c1 = 0;
  for (int64_t r = 0; r < m; ++r)
    if (lo[r] < hi[r]) c0 = std::min(c0, lo[r]), c1 = std::max(c1, hi[r]);
  if (c0 >= c1) {
    std::fill(out, out + R * hdp, 0.f);
    return;
  }
  const int64_t n = c1 - c0, ldS = n + 2 * VL;
  S.resize(static_cast<size_t>(R * ldS));  // every entry of the R rows is written below
  for (int64_t c = c0; c < c1; c += 2 * VL) scores(c, S.data() + (c - c0), ldS);  // S[r, c - c0 : +2 VL]
  const float scale = 1.f / std::sqrt(static_cast<float>(hd));
  for (int64_t r = 0; r < R; ++r) {  // each row's softmax over its own keys; zero weight elsewhere
    float* row = S.data() + r * ldS;
    if (r >= m || lo[r] >= hi[r]) {
      std::fill(row, row + ldS, 0.f);
      continue;
    }
    const int64_t a = lo[r] - c0, e = hi[r] - c0;
    std::fill(row, row + a, 0.f);
    softmax_row(row + a, mask + r * t + lo[r], e - a, scale);
    std::fill(row + e, row + ldS, 0.f);
  }
  values(S.data(), ldS, c0, c1, lo, hi);
}

// The KV heads of k and v (b, hkv, t, hd) widened for the float tiles: K transposed (hd, ldk) a head, V (t, hdp).
template <typename W>
struct FloatKV {
  std::vector<float> keys, values;
  FloatKV(const W* k, const W* v, int64_t heads, int64_t t, int64_t hd, int64_t ldk, int64_t hdp)
      : keys(static_cast<size_t>(heads * hd * ldk), 0.f), values(static_cast<size_t>(heads * t * hdp), 0.f) {
    at::parallel_for(0, heads, 1, [&](int64_t lo, int64_t hi) {
      for (int64_t g = lo; g < hi; ++g)
        for (int64_t c = 0; c < t; ++c)
          for (int64_t i = 0; i < hd; ++i) {
            keys[(g * hd + i) * ldk + c] = load<W>(k, (g * t + c) * hd + i);
            values[(g * t + c) * hdp + i] = load<W>(v, (g * t + c) * hd + i);
          }
    });
  }
};

// Every block of MR query rows of a query head: fn(j, r0, m, g, first, of) for sequence j, rows r0 .. r0 + m (m <=
// MR real), KV head g (of all b * hkv), q's offset of row r0, and an (MR, hdp) float32 output it fills; the rows
// are then stored into out in q's dtype.
template <typename W, typename Fn>
void for_each_block(const int64_t* map, int64_t b, int64_t hq, int64_t hkv, int64_t s, int64_t hd, int64_t hdp,
                    W* op, Fn fn) {
  const int64_t blocks = (s + MR - 1) / MR;
  at::parallel_for(0, b * hq * blocks, 1, [&](int64_t lo, int64_t hi) {
    std::vector<float> of(static_cast<size_t>(MR * hdp));
    for (int64_t task = lo; task < hi; ++task) {  // task = (j, h, block)
      const int64_t j = task / (hq * blocks), h = (task / blocks) % hq, r0 = (task % blocks) * MR;
      const int64_t m = std::min<int64_t>(MR, s - r0), first = ((j * hq + h) * s + r0) * hd;
      fn(j, r0, m, j * hkv + map[h], first, of.data());
      for (int64_t r = 0; r < m; ++r)
        for (int64_t i = 0; i < hd; ++i) op[first + r * hd + i] = store<W>(of[r * hdp + i]);
    }
  });
}

template <typename W>
torch::Tensor prefill_attention_t(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                  const torch::Tensor& kv_map, const torch::Tensor& mask) {
  const int64_t b = q.size(0), hq = q.size(1), s = q.size(2), hd = q.size(3), hkv = k.size(1), t = k.size(2);
  const int64_t ldk = t + 2 * VL, hdp = (hd + 2 * VL - 1) / (2 * VL) * (2 * VL);
  const W* qp = data<W>(q);
  const int64_t* map = kv_map.data_ptr<int64_t>();
  const bool* mp = mask.data_ptr<bool>();
  for (int64_t h = 0; h < hq; ++h)
    TORCH_CHECK(map[h] >= 0 && map[h] < hkv, "prefill attention: kv_map[", h, "] = ", map[h], " is not a KV head");
  auto out = torch::empty_like(q);
  W* op = mutable_data<W>(out);
#if defined(SHARDLM_BF16_DOT)
  if constexpr (std::is_same_v<W, uint16_t> && VL == 16) {  // bfloat16 through avx512_bf16 (prefill_dot.h)
    const PairKV kv(data<W>(k), data<W>(v), b * hkv, t, hd, ldk, hdp);
    for_each_block(map, b, hq, hkv, s, hd, hdp, op, [&](int64_t j, int64_t r0, int64_t m, int64_t g, int64_t first,
                                                         float* of) {
      thread_local std::vector<float> S;
      thread_local std::vector<uint32_t> qw, pw;
      query_pairs(qp + first, m, hd, MR, qw);
      auto scores = [&](int64_t c, float* y, int64_t ldy) { kv.scores<MR>(qw.data(), g, c, y, ldy); };
      auto values = [&](const float* Sd, int64_t ldS, int64_t c0, int64_t, const int64_t* lo, const int64_t* hi) {
        kv.values<MR>(Sd, ldS, c0, lo, hi, m, g, pw, of);
      };
      attend_block<MR>(scores, values, mp + (j * s + r0) * t, m, t, hd, S, of, hdp);
    });
    return out;
  }
#endif
  const FloatKV<W> kv(data<W>(k), data<W>(v), b * hkv, t, hd, ldk, hdp);
  for_each_block(map, b, hq, hkv, s, hd, hdp, op, [&](int64_t j, int64_t r0, int64_t m, int64_t g, int64_t first,
                                                       float* of) {
    thread_local std::vector<float> S, qf;
    qf.resize(static_cast<size_t>(MR * hd));
    for (int64_t e = 0; e < MR * hd; ++e) qf[e] = e < m * hd ? load<W>(qp, first + e) : 0.f;
    const float *kg = kv.keys.data() + g * hd * ldk, *vg = kv.values.data() + g * t * hdp;
    auto scores = [&](int64_t c, float* y, int64_t ldy) { fma_tile<MR>(qf.data(), hd, kg + c, ldk, hd, y, ldy); };
    auto values = [&](const float* Sd, int64_t ldS, int64_t c0, int64_t c1, const int64_t*, const int64_t*) {
      for (int64_t d = 0; d < hdp; d += 2 * VL) fma_tile<MR>(Sd, ldS, vg + c0 * hdp + d, hdp, c1 - c0, of + d, hdp);
    };
    attend_block<MR>(scores, values, mp + (j * s + r0) * t, m, t, hd, S, of, hdp);
  });
  return out;
}

// q (b, hq, s, hd), k and v (b, hkv, t, hd): contiguous, float32 or bfloat16 alike; kv_map (hq,) int64: the KV
// head each query head reads; mask (b, 1, s, t) bool, True where a query may attend a key -> (b, hq, s, hd).
inline torch::Tensor prefill_attention(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor kv_map,
                                       torch::Tensor mask) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.sizes() == k.sizes() && q.size(0) == k.size(0) &&
                  q.size(3) == k.size(3),
              "prefill attention: q (b, hq, s, hd) and k, v (b, hkv, t, hd) expected, got ", q.sizes(), ", ",
              k.sizes(), ", ", v.sizes());
  TORCH_CHECK(mask.dim() == 4 && mask.size(0) == q.size(0) && mask.size(1) == 1 && mask.size(2) == q.size(2) &&
                  mask.size(3) == k.size(2) && mask.scalar_type() == torch::kBool,
              "prefill attention: mask (b, 1, s, t) bool expected, got ", mask.sizes(), " ", mask.scalar_type());
  TORCH_CHECK(kv_map.scalar_type() == torch::kLong && kv_map.numel() == q.size(1),
              "prefill attention: kv_map (hq,) int64 expected");
  for (auto [x, name] : {std::pair{&q, "q"}, {&k, "k"}, {&v, "v"}, {&mask, "mask"}})
    TORCH_CHECK(x->is_contiguous() && x->device().is_cpu(), "prefill attention: ", name,
                " must be a contiguous CPU tensor");
  TORCH_CHECK(k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type(),
              "prefill attention: q, k and v in one dtype, got ", q.scalar_type(), ", ", k.scalar_type(), ", ",
              v.scalar_type());
  if (q.scalar_type() == torch::kFloat) return prefill_attention_t<float>(q, k, v, kv_map, mask);
  TORCH_CHECK(q.scalar_type() == torch::kBFloat16, "prefill attention: float32 or bfloat16, got ", q.scalar_type());
  return prefill_attention_t<uint16_t>(q, k, v, kv_map, mask);
}

}  // namespace shardlm
