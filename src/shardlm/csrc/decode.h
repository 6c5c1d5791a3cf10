// One decode step of a Llama block's two halves, each in a single call (float32 or bfloat16, a few rows).
//
// A decode step runs ~45 small torch ops per layer (norms, three projections, rotary, cache
// writes, SDPA, gating); at batch 1 their dispatch costs about as much as streaming the weights
// (~6-9 ms of a ~26 ms step for the bundled model, measured). Here each half of the block is one
// call: the projections stream their weights row by row (as `gemv` does), the matrices that read
// the same input in one parallel region, and the small per-head work runs in place. The output
// projections (o, down) are part of the calls; on one rank the residual adds are too, and under
// tensor parallelism the caller all-reduces each half's partial output before adding it.
#pragma once
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <initializer_list>
#include <limits>
#include <optional>
#include <type_traits>
#include <vector>

#include "attend.h"
#include "decode_attn.h"
#include "q4tiles.h"
#include "qrows.h"
#include "rows.h"

namespace shardlm {

// The element type of a model's weights and cache: float32 tensors as float, bfloat16 as raw bits.
template <typename W>
constexpr c10::ScalarType dtype_of() { return std::is_same_v<W, float> ? torch::kFloat : torch::kBFloat16; }

template <typename W>
inline const W* data(const torch::Tensor& t) { return reinterpret_cast<const W*>(t.data_ptr()); }

template <typename W>
inline W* mutable_data(torch::Tensor& t) { return reinterpret_cast<W*>(t.data_ptr()); }

inline void check(const torch::Tensor& t, c10::ScalarType dtype, const char* name) {
  TORCH_CHECK(t.scalar_type() == dtype && t.is_contiguous() && t.device().is_cpu(), "fused decode: ", name,
              " must be a contiguous ", c10::toString(dtype), " CPU tensor, got ", t.scalar_type());
}

// A small tensor (activations, norm weights, biases, rotary tables) as contiguous float32.
inline torch::Tensor f32(const torch::Tensor& t) { return t.to(torch::kFloat).contiguous(); }

inline torch::Tensor bias_f32(const std::optional<torch::Tensor>& b, int64_t n, const char* name) {
  if (!b.has_value()) return torch::Tensor();
  TORCH_CHECK(b->numel() == n, "fused decode: ", name, " has ", b->numel(), " elements, expected ", n);
  return f32(*b);
}

inline const float* ptr_or_null(const torch::Tensor& t) { return t.defined() ? t.data_ptr<float>() : nullptr; }

template <typename W>
inline W store(float v);
template <>
inline float store<float>(float v) { return v; }
template <>
inline uint16_t store<uint16_t>(float v) { return c10::BFloat16(v).x; }  // round to nearest even

// One head of hd values rotated by cos/sin (hd each), half-split convention: out = x * cos + rotate_half(x) * sin,
// each product rounded on its own, then the sum (a * c - e * s is a * c + (-e) * s bit for bit), as the module
// path's torch ops round it. `out` may be `x`.
inline void rotate_head(const float* x, const float* c, const float* s, float* out, int64_t hd) {
  const int64_t half = hd / 2;
  for (int64_t i = 0; i < half; ++i) {
    const float a = x[i], e = x[i + half];
    out[i] = a * c[i] - e * s[i];
    out[i + half] = e * c[i + half] + a * s[i + half];
  }
}

// Rotate each head (hd values, half-split convention) of b rows x heads by cos/sin (b, hd), in place.
inline void rope_rows(float* v, const float* cos, const float* sin, int64_t b, int64_t heads, int64_t hd) {
  for (int64_t j = 0; j < b; ++j)
    for (int64_t h = 0; h < heads; ++h) {
      float* x = v + (j * heads + h) * hd;
      rotate_head(x, cos + j * hd, sin + j * hd, x, hd);
    }
}

// One weight matrix's share of a parallel region: y (b, n) = x (b, k) @ w (n, k)^T.
template <typename W>
struct Segment {
  const W* w;
  float* y;
  int64_t n;
};

// Several matrices that read the same x (b, k), as one range of rows split across threads: each
// thread streams its share of every matrix in one parallel region (one fork/join, not one per matrix).
template <typename W>
inline void gemv_segment_list(const std::vector<Segment<W>>& s, const float* x, int64_t k, int64_t b,
                              int64_t ldw = 0) {
  int64_t total = 0;
  for (const auto& g : s) total += g.n;
  at::parallel_for(0, total, 16, [&](int64_t lo, int64_t hi) {
    int64_t start = 0;
    for (const auto& g : s) {  // the part of [lo, hi) that falls in this matrix's rows
      const int64_t a = std::max(lo, start), e = std::min(hi, start + g.n);
      if (a < e) rows<W>(g.w, x, g.y, g.n, k, b, a - start, e - start, ldw);
      start += g.n;
    }
  });
}

template <typename W>
inline void gemv_segments(std::initializer_list<Segment<W>> segs, const float* x, int64_t k, int64_t b,
                          int64_t ldw = 0) {
  gemv_segment_list<W>(std::vector<Segment<W>>(segs), x, k, b, ldw);
}

// An int4 weight of n rows in q4tiles.h's row tiles (codes (tiles, groups, 256) uint8, scales and zeros (tiles,
// groups, 32) bfloat16) whose k input columns start at column pad_left of its padded width, checked.
inline Int4Tiles int4_tiles(const torch::Tensor& codes, const torch::Tensor& sz, int64_t n, int64_t k,
                            int64_t pad_left, const char* who) {
  TORCH_CHECK(codes.dim() == 3 && codes.scalar_type() == torch::kByte && codes.is_contiguous() &&
                  codes.size(2) == Q4TILE_BYTES && sz.dim() == 3 && sz.scalar_type() == torch::kBFloat16 &&
                  sz.is_contiguous() && sz.size(2) == 2 * Q4TILE,
              who, ": int4 weights as contiguous uint8 codes (tiles, groups, 256) and bfloat16 scales and zeros (tiles, "
              "groups, 32) expected, got ", codes.sizes(), " ", codes.scalar_type(), " and ", sz.sizes(), " ",
              sz.scalar_type());
  const int64_t tiles = codes.size(0), groups = codes.size(1), kp = groups * QBLOCK;
  TORCH_CHECK(n > 0 && tiles == (n + Q4TILE - 1) / Q4TILE && sz.size(0) == tiles && sz.size(1) == groups,
              who, ": ", n, " rows need ", (n + Q4TILE - 1) / Q4TILE, " tiles; codes ", codes.sizes(), ", scales ",
              sz.sizes());
  TORCH_CHECK(pad_left >= 0 && pad_left + k <= kp && kp - pad_left - k < QBLOCK, who, ": inputs (..., ", k,
              ") at column ", pad_left, " do not fit ", groups, " groups of ", QBLOCK, " columns");
  return {codes.data_ptr<uint8_t>(), reinterpret_cast<const uint16_t*>(sz.data_ptr()), n, groups};
}

// A linear weight as the fused kernels take it: codes (n, k) in the model's dtype; int8 codes (n, kp) whose rows
// are padded with zero columns to kp = k rounded up to QBLOCK, with a float32 scale per row (`interleaved`: in
// qexact.h's interleaved order, an exact weight's; `paired`: in qpairs.h's paired order, one summed in float lanes);
// or an int4 weight of `rows` rows in row tiles (int4_tiles), whose k input columns start at column pad_left of kp
// (a row-parallel slice that starts inside a group).
struct Linear {
  torch::Tensor w;
  torch::Tensor scale;  // undefined for a float weight; (n,) float32 for int8; (tiles, groups, 32) bfloat16 for int4
  int64_t pad_left = 0;
  int64_t rows = 0;  // int4: the weight's real rows (its tiles hold a multiple of 16)
  bool interleaved = false;
  bool paired = false;

  bool quantized() const { return scale.defined(); }
  bool int4() const { return quantized() && w.scalar_type() == torch::kByte; }
  int64_t out_rows() const { return int4() ? rows : w.size(0); }
  int64_t padded_width() const { return int4() ? w.size(1) * QBLOCK : w.size(1); }
  Int4Tiles tiles() const {
    return {data<uint8_t>(w), data<uint16_t>(scale), rows, w.size(1)};
  }
};

// The weight `i` of `ws`, with its scales and left padding when `scales` are given (int8 or int4 weights). For an
// int8 weight, pads[i] (when given) is (0, order): 0 natural codes, 1 interleaved, 2 paired (kernels/fused.py).
inline Linear linear_of(const std::vector<torch::Tensor>& ws, const std::optional<std::vector<torch::Tensor>>& scales,
                        const std::optional<std::vector<std::pair<int64_t, int64_t>>>& pads, size_t i) {
  TORCH_CHECK(!scales.has_value() || scales->size() == ws.size(), "fused decode: ", ws.size(), " weights but ",
              scales->size(), " scales");
  TORCH_CHECK(!pads.has_value() || pads->size() == ws.size(), "fused decode: ", ws.size(), " weights but ",
              pads->size(), " paddings");
  if (!scales.has_value()) return {ws[i], torch::Tensor(), 0};
  const torch::Tensor& s = (*scales)[i];
  // int8 scales arrive float32 from the CPU's Int8Weight (shardlm.quant); anything else is converted
  const bool convert = ws[i].scalar_type() == torch::kChar && (s.scalar_type() != torch::kFloat || !s.is_contiguous());
  const auto scale = convert ? s.to(torch::kFloat).contiguous() : s;
  const auto [pad_left, second] = pads.has_value() ? (*pads)[i] : std::pair<int64_t, int64_t>{0, 0};
  if (ws[i].scalar_type() == torch::kChar) {
    TORCH_CHECK(second >= 0 && second <= 2, "fused decode: int8 weight ", i, " has code order ", second,
                ", expected 0 (natural), 1 (interleaved) or 2 (paired)");
    return {ws[i], scale, pad_left, 0, second == 1, second == 2};
  }
  return {ws[i], scale, pad_left, second};
}

// Check a weight that maps k inputs to n outputs, stored as the model's dtype, int8 or int4 (see Linear).
inline void check_linear(const Linear& l, c10::ScalarType dtype, const char* name, int64_t n, int64_t k) {
  if (!l.quantized()) {
    check(l.w, dtype, name);
    TORCH_CHECK(l.w.dim() == 2 && l.w.size(0) == n && l.w.size(1) == k, "fused decode: ", name, " is ", l.w.sizes(),
                ", expected (", n, ", ", k, ")");
    return;
  }
  const int64_t kp = (l.pad_left + k + QBLOCK - 1) / QBLOCK * QBLOCK;
  if (l.int4()) {
    TORCH_CHECK(l.rows == n, "fused decode: int4 ", name, " has ", l.rows, " rows, expected ", n);
    int4_tiles(l.w, l.scale, n, k, l.pad_left, "fused decode");
    return;
  }
  check(l.w, torch::kChar, name);
  TORCH_CHECK(l.pad_left == 0 && l.w.dim() == 2 && l.w.size(0) == n && l.w.size(1) == kp && l.scale.numel() == n,
              "fused decode: int8 ", name, " is ", l.w.sizes(), " with ", l.scale.numel(), " scales, expected (", n,
              ", ", kp, ") and ", n);
}

// x (b, k) placed at columns [pad_left, pad_left + k) of kp zero columns, quantized in blocks of QBLOCK.
inline void quantize_padded(const float* x, int64_t b, int64_t k, int64_t pad_left, int64_t kp, QuantRows& out) {
  size_rows(out, b, kp);
  quantize_range(x, 0, b, k, pad_left, out);
}

// x (b, k) quantized for the quantized weight l, whose sums are `exact` or in float lanes: placed at its columns and
// in the order those sums read (int4: with the codes' bytes split; int8: interleaved where its codes are, paired for
// float lanes on a 512-bit build, qpairs.h).
inline void quantize_for(const Linear& l, const float* x, int64_t b, int64_t k, bool exact, QuantRows& out) {
  quantize_padded(x, b, k, l.pad_left, l.padded_width(), out);
  if (l.int4())
    split_bytes(out);
  else
    order_rows_for(out, b, l.interleaved, exact);
}

// Units [lo, hi) of a quantized weight (int4: tiles of 16 rows; int8: rows) against xq into y (b, n) as T.
template <typename T>
inline void quantized_units(const Linear& l, const QuantRows& xq, T* y, int64_t b, int64_t lo, int64_t hi,
                            bool exact) {
  if (l.int4())
    q4rows_tiled<T>(l.tiles(), xq, y, b, lo, hi, exact);
  else
    qrows<T>(data<int8_t>(l.w), xq.kp, data<float>(l.scale), xq, y, l.w.size(0), b, lo, hi, exact, l.paired);
}

// Weights read as one range of units (each weight's size(0): int8 or float rows, int4 tiles): for the part of
// [lo, hi) that falls in each weight, part(weight, its output, first unit, end unit), units counted in that weight.
template <typename Outs, typename Part>
inline void each_part(const Outs& outs, int64_t lo, int64_t hi, Part&& part) {
  int64_t start = 0;
  for (auto [l, y] : outs) {
    const int64_t n = l->w.size(0), a = std::max(lo, start), e = std::min(hi, start + n);
    if (a < e) part(*l, y, a - start, e - start);
    start += n;
  }
}

// ys[i] (b, n_i) = x (b, k) @ weight_i^T for int8 or int4 weights of one padded width that read the same x, in
// one parallel region (x quantized once, for all). `exact`: sums in double (the o and down projections, whose
// rows tensor parallelism splits; qrows.h); T = double keeps a row-parallel rank's partial sums unrounded.
template <typename T>
inline void project_quantized(const std::vector<std::pair<const Linear*, T*>>& o, const float* x, int64_t k, int64_t b,
                              bool exact) {
  const Linear& first = *o[0].first;
  for (auto [l, y] : o)
    TORCH_CHECK(l->quantized() && l->int4() == first.int4() && l->pad_left == first.pad_left &&
                    l->padded_width() == first.padded_width() && l->interleaved == first.interleaved &&
                    l->paired == first.paired,
                "fused decode: weights read together differ in form");
  TORCH_CHECK(exact || !first.interleaved, "fused decode: interleaved int8 codes are summed exact only");
  TORCH_CHECK(!exact || !first.paired, "fused decode: paired int8 codes are summed in float lanes only");
  QuantRows xq;
  quantize_for(first, x, b, k, exact, xq);
  int64_t total = 0;
  for (auto [l, y] : o) total += l->w.size(0);
  at::parallel_for(0, total, first.int4() ? 1 : 16, [&](int64_t lo, int64_t hi) {
    each_part(o, lo, hi,
              [&](const Linear& l, T* y, int64_t a, int64_t e) { quantized_units<T>(l, xq, y, b, a, e, exact); });
  });
}

// ys[i] (b, n_i) = x (b, k) @ weight_i^T for weights that read the same x, in one parallel region: all float
// (the model's dtype W), or all quantized (project_quantized; `exact` for the output projections).
template <typename W>
inline void project(std::initializer_list<std::pair<const Linear*, float*>> outs, const float* x, int64_t k,
                    int64_t b, bool exact = false) {
  const std::vector<std::pair<const Linear*, float*>> o(outs);
  if (o[0].first->quantized()) {
    project_quantized<float>(o, x, k, b, exact);
    return;
  }
  std::vector<Segment<W>> segs;
  for (auto [l, y] : o) segs.push_back({data<W>(l->w), y, l->w.size(0)});
  gemv_segment_list<W>(segs, x, k, b);
}

// The output projection of a half block: x (b, k) @ w^T as (b, n) float32 for the caller to finish; for a
// quantized row-parallel weight (finish false), the partial sums in float64 for a float64 all-reduce.
template <typename W>
inline torch::Tensor output_projection(const Linear& w, const float* x, int64_t k, int64_t b, bool finish,
                                       const torch::TensorOptions& opts) {
  const int64_t n = w.out_rows();
  if (w.quantized() && !finish) {
    auto partial = torch::empty({b, n}, opts.dtype(torch::kDouble));
    project_quantized<double>({{&w, partial.data_ptr<double>()}}, x, k, b, true);
    return partial;
  }
  auto out = torch::empty({b, n}, opts);
  project<W>({{&w, out.data_ptr<float>()}}, x, k, b, true);
  return out;
}

// y (b, n) += res (b, n) where there is one, then += bias (n) where there is one: the order in which a
// tensor-parallel caller adds them after its all-reduce (fused.py's _finish), so one rank rounds alike.
inline void add_rows(float* y, const float* bias, const float* res, int64_t b, int64_t n) {
  for (int64_t j = 0; j < b; ++j)
    for (int64_t i = 0; i < n; ++i) {
      if (res) y[j * n + i] += res[j * n + i];
      if (bias) y[j * n + i] += bias[i];
    }
}

// Attention half of a block for one new token per row.
//   x (b, dim): block input; ln (dim): input norm weight; wq (hq*hd, dim), wk/wv (hkv*hd, dim)
//   with optional biases; cos/sin (b, hd) for the new positions; kc/vc (slots, hkv, max_len, hd):
//   the layer's cache; row j of x reads and writes cache row rows[j] and its new key and value go to
//   position positions[j] of it (rows and positions (b,) int64: rows of a static batch share one
//   position, serving slots each have their own); kv_map (hq,) int64: the KV head each query head
//   reads; mask (b, t) bool: the keys each row may attend, t = the largest position + 1 (its own
//   position always set; a row's keys past its position are masked, so they cost nothing);
//   wo (dim, hq*hd): the o projection (this rank's input columns under tensor parallelism).
// Norm weights, biases, rotary tables and the cache are all float32 or all bfloat16 (the model's dtype);
// the four weights are in that dtype too, or all int8 or all int4 (see Linear; their input is then quantized
// per block, qrows.h). The arithmetic is float32 throughout and the cache and the result are
// stored in the model's dtype.
// Returns heads @ wo^T (b, dim). With `finish` (one rank: nothing to all-reduce) the input x and the o bias
// `bo` are added, giving the block's residual stream after attention; otherwise the caller all-reduces the
// partial sums (float64 for quantized weights, so that they add up as one rank's sum does) and adds them.
template <typename W>
torch::Tensor attn_decode_t(torch::Tensor x, torch::Tensor ln, double eps, const Linear& wq, const Linear& wk,
                            const Linear& wv, std::optional<torch::Tensor> bq, std::optional<torch::Tensor> bk,
                            std::optional<torch::Tensor> bv, torch::Tensor cos, torch::Tensor sin,
                            torch::Tensor kc, torch::Tensor vc, torch::Tensor rows, torch::Tensor positions,
                            torch::Tensor kv_map, torch::Tensor mask, const Linear& wo, std::optional<torch::Tensor> bo,
                            bool finish) {
  const auto dtype = dtype_of<W>();
  for (auto [t, name] : {std::pair{&x, "x"}, {&ln, "norm weight"}, {&cos, "cos"}, {&sin, "sin"}, {&kc, "key cache"},
                         {&vc, "value cache"}})
    check(*t, dtype, name);
  const int64_t b = x.size(0), dim = x.size(1), hd = kc.size(3), hkv = kc.size(1), max_len = kc.size(2);
  const int64_t nq = wq.out_rows(), nk = hkv * hd, hq = nq / hd, slots = kc.size(0);
  check_linear(wq, dtype, "q weight", nq, dim);
  check_linear(wk, dtype, "k weight", nk, dim);
  check_linear(wv, dtype, "v weight", nk, dim);
  check_linear(wo, dtype, "o weight", dim, nq);
  TORCH_CHECK(wk.quantized() == wq.quantized() && wv.quantized() == wq.quantized() && wo.quantized() == wq.quantized(),
              "fused decode: the attention weights are all quantized or none");
  TORCH_CHECK(nq % hd == 0 && vc.sizes() == kc.sizes() && cos.size(0) == b && cos.size(1) == hd,
              "fused decode: inconsistent attention shapes");
  TORCH_CHECK(rows.scalar_type() == torch::kLong && positions.scalar_type() == torch::kLong && rows.numel() == b &&
                  positions.numel() == b && rows.is_contiguous() && positions.is_contiguous(),
              "fused decode: rows and positions must be (b,) int64");
  TORCH_CHECK(mask.scalar_type() == torch::kBool && mask.is_contiguous() && mask.dim() == 2 && mask.size(0) == b,
              "fused decode: mask must be (b, t) bool");
  const int64_t t = mask.size(1);
  TORCH_CHECK(t <= max_len, "KV cache holds ", max_len, " tokens; this step needs ", t, ". Raise max_len.");
  TORCH_CHECK(kv_map.scalar_type() == torch::kLong && kv_map.numel() == hq, "fused decode: kv_map must be (hq,) int64");
  const int64_t* row_of = rows.data_ptr<int64_t>();
  const int64_t* pos_of = positions.data_ptr<int64_t>();
  for (int64_t j = 0; j < b; ++j)
    TORCH_CHECK(row_of[j] >= 0 && row_of[j] < slots && pos_of[j] >= 0 && pos_of[j] < t, "fused decode: row ", j,
                " writes slot ", row_of[j], " position ", pos_of[j], " outside ", slots, " slots x ", t, " positions");
  const auto bo32 = finish ? bias_f32(bo, dim, "o bias") : torch::Tensor();
  const auto bq32 = bias_f32(bq, nq, "q bias"), bk32 = bias_f32(bk, nk, "k bias"), bv32 = bias_f32(bv, nk, "v bias");
  const auto x32 = f32(x), cos32 = f32(cos), sin32 = f32(sin);
  const auto opts = x32.options();

  auto xn = torch::empty({b, dim}, opts);
  rms_norm_rows(x32.data_ptr<float>(), f32(ln).data_ptr<float>(), static_cast<float>(eps), xn.data_ptr<float>(), b, dim);
  auto q = torch::empty({b, nq}, opts);
  auto k = torch::empty({b, nk}, opts);
  auto v = torch::empty({b, nk}, opts);
  const float* xp = xn.data_ptr<float>();
  float *qp = q.data_ptr<float>(), *kp = k.data_ptr<float>(), *vp = v.data_ptr<float>();
  project<W>({{&wq, qp}, {&wk, kp}, {&wv, vp}}, xp, dim, b);
  add_rows(qp, ptr_or_null(bq32), nullptr, b, nq);
  add_rows(kp, ptr_or_null(bk32), nullptr, b, nk);
  add_rows(vp, ptr_or_null(bv32), nullptr, b, nk);
  rope_rows(qp, cos32.data_ptr<float>(), sin32.data_ptr<float>(), b, hq, hd);
  rope_rows(kp, cos32.data_ptr<float>(), sin32.data_ptr<float>(), b, hkv, hd);
  W *kcp = mutable_data<W>(kc), *vcp = mutable_data<W>(vc);
  for (int64_t j = 0; j < b; ++j)
    for (int64_t h = 0; h < hkv; ++h) {  // cache[rows[j], h, positions[j], :] = k/v of the new token
      const int64_t slot = ((row_of[j] * hkv + h) * max_len + pos_of[j]) * hd, src = (j * hkv + h) * hd;
      for (int64_t i = 0; i < hd; ++i) {
        kcp[slot + i] = store<W>(kp[src + i]);
        vcp[slot + i] = store<W>(vp[src + i]);
      }
    }

  auto heads = torch::empty({b, nq}, opts);  // (b, hq, hd) flattened
  float* op = heads.data_ptr<float>();
  const int64_t* map = kv_map.data_ptr<int64_t>();
  const bool* mp = mask.data_ptr<bool>();
  for (int64_t h = 0; h < hq; ++h)
    TORCH_CHECK(map[h] >= 0 && map[h] < hkv, "fused decode: kv_map[", h, "] = ", map[h], " is not a local KV head");
  attend_heads<W>(qp, kcp, vcp, row_of, map, mp, op, b, hq, hkv, hd, max_len, t);
  auto out = output_projection<W>(wo, op, nq, b, finish, opts);
  if (out.scalar_type() == torch::kDouble) return out;  // quantized partial sums: all-reduced in float64
  if (finish) add_rows(mutable_data<float>(out), ptr_or_null(bo32), x32.data_ptr<float>(), b, dim);
  return out.to(dtype);
}

// MLP half of a block: down(silu(gate(norm(x))) * up(norm(x))) -> (b, dim).
//   x (b, dim); ln (dim); wg/wu (inter, dim) with optional biases; wd (dim, inter): the down
//   projection (this rank's input columns under tensor parallelism). With `finish` the down bias
//   `bd` and x are added (one rank); otherwise the caller all-reduces the partial sums.
template <typename W>
torch::Tensor mlp_decode_t(torch::Tensor x, torch::Tensor ln, double eps, const Linear& wg, const Linear& wu,
                           std::optional<torch::Tensor> bg, std::optional<torch::Tensor> bu, const Linear& wd,
                           std::optional<torch::Tensor> bd, bool finish) {
  for (auto [t, name] : {std::pair{&x, "x"}, {&ln, "norm weight"}}) check(*t, dtype_of<W>(), name);
  const int64_t b = x.size(0), dim = x.size(1), n = wg.out_rows();
  check_linear(wg, dtype_of<W>(), "gate weight", n, dim);
  check_linear(wu, dtype_of<W>(), "up weight", n, dim);
  check_linear(wd, dtype_of<W>(), "down weight", dim, n);
  TORCH_CHECK(wu.quantized() == wg.quantized() && wd.quantized() == wg.quantized(),
              "fused decode: the MLP weights are all quantized or none");
  const auto bg32 = bias_f32(bg, n, "gate bias"), bu32 = bias_f32(bu, n, "up bias");
  const auto bd32 = finish ? bias_f32(bd, dim, "down bias") : torch::Tensor();
  const auto x32 = f32(x);
  const auto opts = x32.options();
  auto xn = torch::empty({b, dim}, opts);
  rms_norm_rows(x32.data_ptr<float>(), f32(ln).data_ptr<float>(), static_cast<float>(eps), xn.data_ptr<float>(), b, dim);
  auto gate = torch::empty({b, n}, opts);
  auto act = torch::empty({b, n}, opts);  // up(x), then silu(gate) * up in place
  float *gp = gate.data_ptr<float>(), *ap = act.data_ptr<float>();
  // gate and up as two whole-matrix segments: interleaving their rows streamed ~15 % slower (measured)
  project<W>({{&wg, gp}, {&wu, ap}}, xn.data_ptr<float>(), dim, b);
  add_rows(gp, ptr_or_null(bg32), nullptr, b, n);
  add_rows(ap, ptr_or_null(bu32), nullptr, b, n);
  // silu(g) * u, in runs of eight values across the threads (each value is computed alike wherever its run ends)
  at::parallel_for(0, (b * n + 7) / 8, 512, [&](int64_t lo, int64_t hi) {
    silu_mul(ap + lo * 8, gp + lo * 8, std::min(b * n, hi * 8) - lo * 8);
  });
  auto out = output_projection<W>(wd, ap, n, b, finish, opts);
  if (out.scalar_type() == torch::kDouble) return out;  // quantized partial sums: all-reduced in float64
  if (finish) add_rows(mutable_data<float>(out), ptr_or_null(bd32), x32.data_ptr<float>(), b, dim);
  return out.to(dtype_of<W>());
}

// Entry points: dispatch on the model's dtype (x: float32 or bfloat16). The weights come as a list (q, k, v, o or
// gate, up, down) in that dtype, or as int8 or int4 codes with `scales` (one tensor per weight) and, for int4,
// `pads` (each weight's (pad_left, rows); see Linear).
inline bool float_model(const torch::Tensor& x) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat || x.scalar_type() == torch::kBFloat16,
              "fused decode: float32 or bfloat16 activations, got ", x.scalar_type());
  return x.scalar_type() == torch::kFloat;
}

inline torch::Tensor attn_decode(torch::Tensor x, torch::Tensor ln, double eps, std::vector<torch::Tensor> weights,
                                 std::optional<std::vector<torch::Tensor>> scales, std::optional<torch::Tensor> bq,
                                 std::optional<torch::Tensor> bk, std::optional<torch::Tensor> bv, torch::Tensor cos,
                                 torch::Tensor sin, torch::Tensor kc, torch::Tensor vc, torch::Tensor rows,
                                 torch::Tensor positions, torch::Tensor kv_map, torch::Tensor mask,
                                 std::optional<torch::Tensor> bo, bool finish,
                                 std::optional<std::vector<std::pair<int64_t, int64_t>>> pads) {
  TORCH_CHECK(weights.size() == 4, "fused decode: attention takes 4 weights (q, k, v, o), got ", weights.size());
  const Linear q = linear_of(weights, scales, pads, 0), k = linear_of(weights, scales, pads, 1),
               v = linear_of(weights, scales, pads, 2), o = linear_of(weights, scales, pads, 3);
  auto run = float_model(x) ? attn_decode_t<float> : attn_decode_t<uint16_t>;
  return run(x, ln, eps, q, k, v, bq, bk, bv, cos, sin, kc, vc, rows, positions, kv_map, mask, o, bo, finish);
}

inline torch::Tensor mlp_decode(torch::Tensor x, torch::Tensor ln, double eps, std::vector<torch::Tensor> weights,
                                std::optional<std::vector<torch::Tensor>> scales, std::optional<torch::Tensor> bg,
                                std::optional<torch::Tensor> bu, std::optional<torch::Tensor> bd, bool finish,
                                std::optional<std::vector<std::pair<int64_t, int64_t>>> pads) {
  TORCH_CHECK(weights.size() == 3, "fused decode: the MLP takes 3 weights (gate, up, down), got ", weights.size());
  const Linear g = linear_of(weights, scales, pads, 0), u = linear_of(weights, scales, pads, 1),
               d = linear_of(weights, scales, pads, 2);
  auto run = float_model(x) ? mlp_decode_t<float> : mlp_decode_t<uint16_t>;
  return run(x, ln, eps, g, u, bg, bu, d, bd, finish);
}

}  // namespace shardlm
