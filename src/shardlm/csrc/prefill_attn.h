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
#include <array>
#include <cstring>
#include <type_traits>
#include <vector>
#include "attend.h"
#include "decode.h"
#include "prefill_dot.h"
#include "qgemm.h"

namespace shardlm {

// Float buffers from a cache line (rows.h LineAligned), so that each 512-bit load of a key panel or of a score row
// reads one line, not two as from malloc's 16-byte boundaries.
using LineVec = std::vector<float, LineAligned<float>>;

// Each mask row's allowed key range [lo, hi) and whether a key inside it is masked, found once for all heads (the
// mask is (b, 1, s, t): every head of a sequence shares it), where each block of each head scanned its rows again.
// On the calling thread up to 4096 rows: the scans of a 512-token prompt take less than waking the pool.
struct KeySpans {
  std::vector<int64_t> lo, hi;
  std::vector<uint8_t> dense;  // 1: no masked key inside [lo, hi)
  KeySpans(const bool* mask, int64_t rows, int64_t t) : lo(rows), hi(rows), dense(rows) {
    at::parallel_for(0, rows, 4096, [&](int64_t a, int64_t e) {
      for (int64_t r = a; r < e; ++r) {
        const bool* row = mask + r * t;
        const auto [l, h] = allowed_span(row, t);  // attend.h
        lo[r] = l, hi[r] = h;
        // a bool false is a zero byte: memchr scans a vector at a time
        dense[r] = l >= h || std::memchr(row + l, 0, static_cast<size_t>(h - l)) == nullptr;
      }
    });
  }
};

// Row p (n = hi - lo scores of its allowed range, scaled in place) -> softmax weights, masked keys 0 (dense: none
// is). The max is exact in any order; e^x is lane by lane; the sum runs in eight lanes from the row's first key,
// then the lanes in order (lane_sums8). A range with no masked key inside (causal rows, padding, windows) skips the per-key test.
// (Decode keeps its own sum, scalar in key order (attend.h softmax_weights): moving it to eight lanes changed
// bfloat16 greedy tokens of the bundled model at near ties, measured.)
#if defined(__AVX512F__)
// softmax_row's arithmetic on a range with no masked key, sixteen lanes a step and the last n % 16 keys as one
// masked step (the sum adds its two eight-lane halves as two runs of eight, the lanes past n as zeros, which change
// no sum), where the general path ends each pass with scalar and eight-lane tails.
inline void softmax_dense16(float* p, int64_t n, float scale) {
  const int64_t whole = n - n % 16;
  const __mmask16 tail = static_cast<__mmask16>((1u << (n - whole)) - 1u);
  const __m512 sv = _mm512_set1_ps(scale);
  __m512 mv = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t c = 0; c < whole; c += 16) {  // scale and the max in one pass (the max is exact in any order)
    __m512 x = _mm512_loadu_ps(p + c);
    if (scale != 1.f) x = _mm512_mul_ps(x, sv), _mm512_storeu_ps(p + c, x);
    mv = _mm512_max_ps(x, mv);  // x > mv ? x : mv
  }
  if (tail) {
    __m512 x = _mm512_maskz_loadu_ps(tail, p + whole);
    if (scale != 1.f) x = _mm512_mul_ps(x, sv), _mm512_mask_storeu_ps(p + whole, tail, x);
    mv = _mm512_mask_max_ps(mv, tail, x, mv);
  }
  const float top = _mm512_reduce_max_ps(mv);
  v8f lanes = v8f{};
  for (int64_t c = 0; c < whole; c += 16) {
    const v16f x = exp16(load16(p + c) - top);
    lanes = lanes + low8(x);
    lanes = lanes + high8(x);
    std::memcpy(p + c, &x, sizeof(x));
  }
  if (tail) {
    const v16f in = reinterpret_cast<v16f>(_mm512_maskz_loadu_ps(tail, p + whole));
    const __m512 e = reinterpret_cast<__m512>(exp16(in - top));
    const v16f x = reinterpret_cast<v16f>(_mm512_maskz_mov_ps(tail, e));
    lanes = lanes + low8(x);
    lanes = lanes + high8(x);
    _mm512_mask_storeu_ps(p + whole, tail, e);
  }
  float total;
  lane_sums8(&lanes, 1, &total);
  const __m512 inv = _mm512_set1_ps(1.f / total);
  for (int64_t c = 0; c < whole; c += 16) _mm512_storeu_ps(p + c, _mm512_mul_ps(_mm512_loadu_ps(p + c), inv));
  if (tail) _mm512_mask_storeu_ps(p + whole, tail, _mm512_mul_ps(_mm512_maskz_loadu_ps(tail, p + whole), inv));
}
#endif

inline void softmax_row(float* p, const bool* allowed, int64_t n, float scale, bool dense) {
#if defined(__AVX512F__)
  if (dense) return softmax_dense16(p, n, scale);
#endif
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

// y[r, 0:NV VL] = sum_i x[r * ldx + i] * b[i * ldb + 0:NV VL] over i in [0, k), for R rows: one FMA chain per
// output in order of i, NV vectors of b and R broadcasts of x feeding R NV FMAs (qgemm.h's panel tile, with b's rows
// ldb apart). Outputs are P (R, n) against V. R row pointers live in general registers: past 6 the compiler spilled
// them inside the loop (two reloads per step, perf annotate), so the value tile runs 6 rows by 4 vectors.
template <int R, int NV = 2>
inline void fma_tile(const float* x, int64_t ldx, const float* b, int64_t ldb, int64_t k, float* y, int64_t ldy) {
  vpf acc[R][NV];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < NV; ++v) acc[r][v] = vpf{};
  for (int64_t i = 0; i < k; ++i) {
    vpf bv[NV];
    for (int v = 0; v < NV; ++v) bv[v] = load_p(b + i * ldb + v * VL);
    for (int r = 0; r < R; ++r) {
      const vpf xb = splat_p(x + r * ldx + i);
      for (int v = 0; v < NV; ++v) acc[r][v] = fma_p(bv[v], xb, acc[r][v]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < NV; ++v) std::memcpy(y + r * ldy + v * VL, &acc[r][v], sizeof(vpf));
}

// The same product with x packed k-major: xt[i * R + r] = x[r, i], so a step's R broadcasts read one pointer at
// fixed offsets (no row pointers to keep). Scores are q (R, hd), packed once a block, against K^T; each score is
// multiplied by `scale` as it is stored (the same bits as scaling it after).
template <int R>
inline void fma_tile_packed(const float* xt, const float* b, int64_t ldb, int64_t k, float* y, int64_t ldy,
                            float scale) {
  vpf acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = vpf{};
  for (int64_t i = 0; i < k; ++i) {
    const vpf b0 = load_p(b + i * ldb), b1 = load_p(b + i * ldb + VL);
    __builtin_prefetch(b + (k + i) * ldb);  // the next panel (k steps of ldb on)
    __builtin_prefetch(b + (k + i) * ldb + VL);
    for (int r = 0; r < R; ++r) {
      const vpf xb = splat_p(xt + i * R + r);
      acc[r][0] = fma_p(b0, xb, acc[r][0]);
      acc[r][1] = fma_p(b1, xb, acc[r][1]);
    }
  }
  for (int r = 0; r < R; ++r) {
    const vpf y0 = acc[r][0] * scale, y1 = acc[r][1] * scale;
    std::memcpy(y + r * ldy, &y0, sizeof(vpf));
    std::memcpy(y + r * ldy + VL, &y1, sizeof(vpf));
  }
}

// out (R, hdp) = S (R, keys [0, n), rows ldS apart) times V (n, hdp): tiles of 6 rows by 4 vectors where the head
// fits them (AVX-512, hdp a multiple of 64), else R rows by 2 vectors.
template <int R>
inline void value_tiles(const float* S, int64_t ldS, const float* v, int64_t hdp, int64_t n, float* out) {
  int64_t d = 0;
  if constexpr (R % 6 == 0 && VL == 16) {
    for (; d + 4 * VL <= hdp; d += 4 * VL)
      for (int r = 0; r < R; r += 6) fma_tile<6, 4>(S + r * ldS, ldS, v + d, hdp, n, out + r * hdp + d, hdp);
  }
  for (; d < hdp; d += 2 * VL) fma_tile<R>(S, ldS, v + d, hdp, n, out + d, hdp);
}

// One block of R rows of head h of sequence j, the first m real (results of rows past m are dropped): rows row0 ..
// row0 + m of spans and of mask (each t wide). scores(c, y,
// ldy) writes the R rows' scores against keys c .. c + 2 VL at y (rows ldy apart; keys past t score zero), which
// the softmax multiplies by `scale` (1: they came scaled);
// values(S, ldS, c0, c1, lo, hi) writes out (R, hdp) from the softmax weights S[r, c - c0] of keys [c0, c1) (zero
// outside each row's keys [lo[r], hi[r]); rows ldS apart); S: scratch.
template <int R, typename Scores, typename Values>
void attend_block(Scores scores, Values values, const KeySpans& spans, int64_t row0, const bool* mask, int64_t m,
                  int64_t t, float scale, LineVec& S, float* out, int64_t hdp) {
  const int64_t *lo = spans.lo.data() + row0, *hi = spans.hi.data() + row0;
  int64_t c0 = t, c1 = 0;
  for (int64_t r = 0; r < m; ++r)
    if (lo[r] < hi[r]) c0 = std::min(c0, lo[r]), c1 = std::max(c1, hi[r]);
  if (c0 >= c1) {
    std::fill(out, out + R * hdp, 0.f);
    return;
  }
  const int64_t cs = c0 / (2 * VL) * (2 * VL);  // scores from a whole panel of keys (FloatKV); values from c0
  const int64_t n = c1 - cs, ldS = (n + 15) / 16 * 16 + 2 * VL;  // rows on cache lines
  S.resize(static_cast<size_t>(R * ldS));  // every entry of the R rows is written below
  for (int64_t c = cs; c < c1; c += 2 * VL) scores(c, S.data() + (c - cs), ldS);  // S[r, c - cs : +2 VL]
  for (int64_t r = 0; r < R; ++r) {  // each row's softmax over its own keys; zero weight elsewhere
    float* row = S.data() + r * ldS;
    if (r >= m || lo[r] >= hi[r]) {
      std::fill(row, row + ldS, 0.f);
      continue;
    }
    const int64_t a = lo[r] - cs, e = hi[r] - cs;
    std::fill(row, row + a, 0.f);
    softmax_row(row + a, mask + r * t + lo[r], e - a, scale, spans.dense[row0 + r]);
    std::fill(row + e, row + ldS, 0.f);
  }
  values(S.data() + (c0 - cs), ldS, c0, c1, lo, hi);
}

// The KV heads of k and v (b, hkv, t, hd) widened for the float tiles: K transposed in panels of KW keys, each
// (hd, KW) and contiguous (a head's panels in key order, keys past t zero), so a score tile reads one run of memory
// where rows of K^T t apart were 64 streams; V (t, hdp) a head. Widened by (head, panel), both threads busy.
template <typename W>
struct FloatKV {
  static constexpr int64_t KW = 2 * VL;  // keys a panel (a score tile's width)
  static constexpr int64_t KEPT_FLOATS = int64_t{4} << 20;  // 16 MiB a buffer: larger ones are the call's own
  int64_t hd, panels;
  LineVec own_keys, own_values;  // a call's own buffers, past KEPT_FLOATS
  float *keys, *values;
  FloatKV(const W* k, const W* v, int64_t heads, int64_t t, int64_t hd_, int64_t hdp)
      : hd(hd_), panels((t + KW - 1) / KW) {
    thread_local LineVec key_buf, value_buf;  // the calling thread's, kept: see room()
    keys = room(key_buf, own_keys, heads * panels * hd * KW), values = room(value_buf, own_values, heads * t * hdp);
    at::parallel_for(0, heads * panels, 8, [&](int64_t lo, int64_t hi) {
      for (int64_t task = lo; task < hi; ++task) {
        const int64_t g = task / panels, c0 = (task % panels) * KW, c1 = std::min(t, c0 + KW);
        float* panel = keys + task * hd * KW;  // (hd, KW)
        for (int64_t c = c0; c < c0 + KW; ++c)
          for (int64_t i = 0; i < hd; ++i) panel[i * KW + c - c0] = c < c1 ? load<W>(k, (g * t + c) * hd + i) : 0.f;
        for (int64_t c = c0; c < c1; ++c)
          for (int64_t i = 0; i < hdp; ++i)
            values[(g * t + c) * hdp + i] = i < hd ? load<W>(v, (g * t + c) * hd + i) : 0.f;
      }
    });
  }
  // Room for n floats, every one overwritten by the caller: the thread's kept buffer, grown, up to KEPT_FLOATS;
  // past it, `own` (freed with the call, so a long prompt's buffers are not held after it). Buffers of a 512-token
  // call allocated afresh each call made it run 0.80 or 1.0 of the time by process (fresh pages, faulted in).
  static float* room(LineVec& kept, LineVec& own, int64_t n) { return grown(n > KEPT_FLOATS ? own : kept, n); }
  // Head g's panel holding key c (c a multiple of KW).
  const float* panel(int64_t g, int64_t c) const { return keys + (g * panels + c / KW) * hd * KW; }
};

// Every block of MR query rows of a query head: fn(j, r0, m, g, first, of) for sequence j, rows r0 .. r0 + m (m <=
// MR real), KV head g (of all b * hkv), q's offset of row r0, and an (MR, hdp) float32 output it fills; the rows
// are then stored into out in q's dtype. The threads take runs of blocks of equal cost (keys the block's rows
// see, plus a block's setup): in even halves of a causal prompt the later, longer blocks made one thread work
// about 12 % longer (perf: 4 % of samples in the pool's wait).
template <typename W, typename Fn>
void for_each_block(const KeySpans& spans, const int64_t* map, int64_t b, int64_t hq, int64_t hkv, int64_t s,
                    int64_t hd, int64_t hdp, W* op, Fn fn) {
  const int64_t blocks = (s + MR - 1) / MR, tasks = b * hq * blocks;
  const auto block_of = [&](int64_t task) {  // task = (j, h, block) -> j, h, r0, m
    const int64_t j = task / (hq * blocks), h = (task / blocks) % hq, r0 = (task % blocks) * MR;
    return std::array<int64_t, 4>{j, h, r0, std::min<int64_t>(MR, s - r0)};
  };
  const int64_t parts = std::min<int64_t>(at::get_num_threads(), tasks);
  if (parts == 0) return;
  const std::vector<int64_t> runs = cost_runs(tasks, parts, [&](int64_t task) {  // attend.h
    const auto [j, h, r0, m] = block_of(task);
    int64_t c0 = std::numeric_limits<int64_t>::max(), c1 = 0;
    for (int64_t r = j * s + r0; r < j * s + r0 + m; ++r)
      if (spans.lo[r] < spans.hi[r]) c0 = std::min(c0, spans.lo[r]), c1 = std::max(c1, spans.hi[r]);
    return static_cast<double>(std::max<int64_t>(c1 - c0, 0) + 2 * VL);
  });
  at::parallel_for(0, parts, 1, [&](int64_t first, int64_t last) {
    LineVec of(static_cast<size_t>(MR * hdp));
    for (int64_t task = runs[first]; task < runs[last]; ++task) {
      const auto [j, h, r0, m] = block_of(task);
      const int64_t first_q = ((j * hq + h) * s + r0) * hd;
      fn(j, r0, m, j * hkv + map[h], first_q, of.data());
      for (int64_t r = 0; r < m; ++r)
        for (int64_t i = 0; i < hd; ++i) op[first_q + r * hd + i] = store<W>(of[r * hdp + i]);
    }
  });
}

// The shapes and inputs of one call, as prefill_attention_t reads them.
template <typename W>
struct AttnCall {
  int64_t b, hq, s, hd, hkv, t, hdp;
  const W *qp, *kp, *vp;
  const int64_t* map;
  const bool* mp;
  float scale;
};

#if defined(SHARDLM_BF16_DOT)
// bfloat16 through avx512_bf16 (prefill_dot.h): scores and values as dot products of bfloat16 pairs.
inline void attend_pairs(const AttnCall<uint16_t>& a, const KeySpans& spans, uint16_t* op) {
  const PairKV kv(a.kp, a.vp, a.b * a.hkv, a.t, a.hd, a.t + 2 * VL, a.hdp);
  const auto block = [&](int64_t j, int64_t r0, int64_t m, int64_t g, int64_t first, float* of) {
    thread_local LineVec S;
    thread_local std::vector<uint32_t> qw, pw;
    query_pairs(a.qp + first, m, a.hd, MR, qw);
    auto scores = [&](int64_t c, float* y, int64_t ldy) { kv.scores<MR>(qw.data(), g, c, y, ldy); };
    auto values = [&](const float* Sd, int64_t ldS, int64_t c0, int64_t, const int64_t* lo, const int64_t* hi) {
      kv.values<MR>(Sd, ldS, c0, lo, hi, m, g, pw, of);
    };
    const int64_t row0 = j * a.s + r0;
    attend_block<MR>(scores, values, spans, row0, a.mp + row0 * a.t, m, a.t, a.scale, S, of, a.hdp);
  };
  for_each_block(spans, a.map, a.b, a.hq, a.hkv, a.s, a.hd, a.hdp, op, block);
}
#endif

// float32, or bfloat16 widened to it: FMA tiles over FloatKV's panels, the scores scaled as the tile stores them.
template <typename W>
void attend_floats(const AttnCall<W>& a, const KeySpans& spans, W* op) {
  const FloatKV<W> kv(a.kp, a.vp, a.b * a.hkv, a.t, a.hd, a.hdp);
  const auto block = [&](int64_t j, int64_t r0, int64_t m, int64_t g, int64_t first, float* of) {
    thread_local LineVec S, qt;
    qt.resize(static_cast<size_t>(MR * a.hd));  // q^T (hd, MR): rows past m zero
    for (int64_t r = 0; r < MR; ++r)
      for (int64_t i = 0; i < a.hd; ++i) qt[i * MR + r] = r < m ? load<W>(a.qp, first + r * a.hd + i) : 0.f;
    const float* vg = kv.values + g * a.t * a.hdp;
    auto scores = [&](int64_t c, float* y, int64_t ldy) {
      fma_tile_packed<MR>(qt.data(), kv.panel(g, c), kv.KW, a.hd, y, ldy, a.scale);
    };
    auto values = [&](const float* Sd, int64_t ldS, int64_t c0, int64_t c1, const int64_t*, const int64_t*) {
      value_tiles<MR>(Sd, ldS, vg + c0 * a.hdp, a.hdp, c1 - c0, of);
    };
    const int64_t row0 = j * a.s + r0;
    attend_block<MR>(scores, values, spans, row0, a.mp + row0 * a.t, m, a.t, 1.f, S, of, a.hdp);
  };
  for_each_block(spans, a.map, a.b, a.hq, a.hkv, a.s, a.hd, a.hdp, op, block);
}

template <typename W>
torch::Tensor prefill_attention_t(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                  const torch::Tensor& kv_map, const torch::Tensor& mask) {
  const int64_t hd = q.size(3);
  const AttnCall<W> a{q.size(0), q.size(1), q.size(2), hd, k.size(1), k.size(2),
                      (hd + 2 * VL - 1) / (2 * VL) * (2 * VL), data<W>(q), data<W>(k), data<W>(v),
                      kv_map.data_ptr<int64_t>(), mask.data_ptr<bool>(), 1.f / std::sqrt(static_cast<float>(hd))};
  for (int64_t h = 0; h < a.hq; ++h)
    TORCH_CHECK(a.map[h] >= 0 && a.map[h] < a.hkv, "prefill attention: kv_map[", h, "] = ", a.map[h],
                " is not a KV head");
  auto out = torch::empty_like(q);
  const KeySpans spans(a.mp, a.b * a.s, a.t);
#if defined(SHARDLM_BF16_DOT)
  if constexpr (std::is_same_v<W, uint16_t> && VL == 16) {
    attend_pairs(a, spans, mutable_data<W>(out));
    return out;
  }
#endif
  attend_floats(a, spans, mutable_data<W>(out));
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
