// The compiled CPU decode kernels (one extension module, built once per machine by shardlm.kernels):
// `gemv` here, the fused attention / MLP halves of a block in decode.h (every block in one call: stack.h), the
// integer decode products with int8 and int4 weights in qrows.h and q4tiles.h, their prefill products in integer
// panels (qpanel.h), and the float prefill panels (qgemm.h).
//
// gemv: y[b, n] = sum_k x[b, k] * w[n, k] for a few rows b.
//
// One decode step multiplies each weight matrix by one (or a few) activation rows, so the work is
// bound by streaming the weights from memory. The library kernels available to PyTorch on CPU
// stream fp32 weights at about 11 (MKL) to 17 (oneDNN, pre-packed) GB/s on our 2-core machine;
// this loop reaches about 26 GB/s because each thread walks whole rows of the row-major weight
// with vectorized dot products and nothing else. Rows are split across threads with
// at::parallel_for (the same OpenMP pool as the rest of torch).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cstdint>
#include <optional>
#include <vector>

#include "argmax.h"
#include "draw.h"
#include "decode.h"
#include "fewrows.h"
#include "prefill_attn.h"
#include "prefill_ops.h"
#include "qgemm.h"
#include "qpanel.h"
#include "stack.h"

// The rows of x (..., k) as contiguous float32 (b, k) (copied only if not float32 or not contiguous), and the shape
// (..., n) of their product with a weight of n rows.
inline torch::Tensor float_rows(const torch::Tensor& x_in) {
  return x_in.reshape({-1, x_in.size(-1)}).to(torch::kFloat).contiguous();
}
inline std::vector<int64_t> out_shape(const torch::Tensor& x_in, int64_t n) {
  auto shape = x_in.sizes().vec();
  shape.back() = n;
  return shape;
}

// x (..., k) float32 or bfloat16; w (n, k) float32 or bfloat16 contiguous -> (..., n) in x's dtype.
// Accumulates in float32. One call per linear layer keeps the per-layer Python overhead small.
torch::Tensor gemv(torch::Tensor x_in, torch::Tensor w) {
  TORCH_CHECK(w.dim() == 2 && x_in.size(-1) == w.size(1), "gemv: shapes (..., k) and (n, k) expected");
  TORCH_CHECK(w.is_contiguous(), "gemv: contiguous weight expected");
  const auto x = float_rows(x_in);
  const int64_t n = w.size(0), k = w.size(1), b = x.size(0);
  auto y = torch::empty({b, n}, x.options());
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  if (w.scalar_type() == torch::kFloat) {
    shardlm::gemv_segments<float>({{w.data_ptr<float>(), yp, n}}, xp, k, b);
  } else {
    TORCH_CHECK(w.scalar_type() == torch::kBFloat16, "gemv: float32 or bfloat16 weights");
    shardlm::gemv_segments<uint16_t>({{shardlm::data<uint16_t>(w), yp, n}}, xp, k, b);
  }
  return y.view(out_shape(x_in, n)).to(x_in.scalar_type());
}

// An int8 weight's codes (n, kq) and scales (n,) checked against an input of width k (kq: k rounded up to 32).
inline void check_int8(const torch::Tensor& q, const torch::Tensor& scale, int64_t k, const char* name) {
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == torch::kChar && q.is_contiguous(), name, ": contiguous int8 (n, kq)");
  TORCH_CHECK(q.size(1) == (k + shardlm::QBLOCK - 1) / shardlm::QBLOCK * shardlm::QBLOCK && scale.numel() == q.size(0),
              name, ": shapes (..., k), (n, k rounded up to 32), (n,) expected; got k = ", k, ", codes ", q.sizes(),
              ", ", scale.numel(), " scales");
}

// x (..., k) float32 or bfloat16; q (n, kq) int8 codes, kq = k rounded up to 32 (zero columns past k); scale (n,)
// The orders an int8 weight's codes may come in for `who`: interleaved ones are summed exact only (qexact.h), paired
// ones in float lanes only (qpairs.h).
static void check_code_order(const char* who, bool exact, bool wide, bool interleaved, bool paired) {
  TORCH_CHECK(!interleaved || exact || wide, who, ": interleaved codes are summed exact only; pass exact=True");
  TORCH_CHECK(!paired || !(exact || wide || interleaved), who, ": paired codes are summed in float lanes only; pass "
              "exact=False, wide=False, interleaved=False");
}

// A copy of int8 codes (n, kp), kp a multiple of 32, with each row put in another order by reorder(codes, n, kp).
static torch::Tensor reordered_int8(const torch::Tensor& q, const char* who,
                                    void (*reorder)(int8_t*, int64_t, int64_t)) {
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == torch::kChar && q.size(1) % shardlm::QBLOCK == 0, who,
              ": int8 codes (n, kp) with kp a multiple of 32 expected, got ", q.sizes(), " ", q.scalar_type());
  auto out = q.contiguous().clone();
  reorder(out.data_ptr<int8_t>(), out.size(0), out.size(1));
  return out;
}

// -> (..., n) in x's dtype: x @ (q * scale)^T. The rows of x are quantized to int16 in blocks of 32 and meet the
// codes in integer dot products (qrows.h). `exact`: summed in double (a row-parallel kind of weight); `wide`:
// summed in double and returned as float64 (a row-parallel rank's partial sums, all-reduced in float64);
// otherwise returned in x's dtype.
torch::Tensor gemv_int8(torch::Tensor x_in, torch::Tensor q, torch::Tensor scale, bool exact, bool wide,
                        bool interleaved, bool paired) {
  check_int8(q, scale, x_in.size(-1), "gemv_int8");
  check_code_order("gemv_int8", exact, wide, interleaved, paired);
  const int64_t n = q.size(0), k = x_in.size(-1), kq = q.size(1);
  const auto x = float_rows(x_in), scale32 = scale.to(torch::kFloat).contiguous();
  const int64_t b = x.size(0);
  shardlm::QuantRows xq;
  shardlm::quantize_rows(x.data_ptr<float>(), b, k, kq, xq);
  shardlm::order_rows_for(xq, b, interleaved, exact || wide);
  const int8_t* w = q.data_ptr<int8_t>();
  const float* s = scale32.data_ptr<float>();
  const auto lead = out_shape(x_in, n);
  if (wide) {
    auto y = torch::empty({b, n}, x.options().dtype(torch::kDouble));
    double* yp = y.data_ptr<double>();
    at::parallel_for(0, n, 16, [&](int64_t lo, int64_t hi) { shardlm::qrows<double>(w, kq, s, xq, yp, n, b, lo, hi, true); });
    return y.view(lead);
  }
  auto y = torch::empty({b, n}, x.options());
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, n, 16, [&](int64_t lo, int64_t hi) {
    shardlm::qrows<float>(w, kq, s, xq, yp, n, b, lo, hi, exact, paired);
  });
  return y.view(lead).to(x_in.scalar_type());
}

// x (..., k) float32 or bfloat16; an int4 weight of n rows in q4tiles.h's row tiles: codes (tiles, groups, 256)
// uint8 and sz (tiles, groups, 32) bfloat16; x's k columns sit at [pad_left, pad_left + k) of kp = 32 * groups,
// zeros around them -> (..., n) in x's dtype, in integer dot products. `exact` and `wide` as for gemv_int8.
torch::Tensor gemm_int4(torch::Tensor x_in, torch::Tensor codes, torch::Tensor sz, int64_t pad_left, int64_t n,
                        bool exact, bool wide) {
  const int64_t k = x_in.size(-1);
  const shardlm::Int4Tiles w = shardlm::int4_tiles(codes, sz, n, k, pad_left, "gemm_int4");
  const int64_t kp = w.groups * shardlm::QBLOCK;
  const auto x = float_rows(x_in);
  const int64_t b = x.size(0);
  shardlm::QuantRows xq;
  shardlm::quantize_padded(x.data_ptr<float>(), b, k, pad_left, kp, xq);
  shardlm::split_bytes(xq);
  const auto lead = out_shape(x_in, n);
  if (wide) {
    auto y = torch::empty({b, n}, x.options().dtype(torch::kDouble));
    double* yp = y.data_ptr<double>();
    at::parallel_for(0, w.tiles(), 1, [&](int64_t lo, int64_t hi) { shardlm::q4rows_tiled<double>(w, xq, yp, b, lo, hi, true); });
    return y.view(lead);
  }
  auto y = torch::empty({b, n}, x.options());
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, w.tiles(), 1, [&](int64_t lo, int64_t hi) { shardlm::q4rows_tiled<float>(w, xq, yp, b, lo, hi, exact); });
  return y.view(lead).to(x_in.scalar_type());
}

// The float prefill products (qgemm.h) for x (..., k) float32 or bfloat16 and a kp-wide weight (kp >= k; zeros
// past k): x copied into zero-padded float rows where kp > k, then `widen`'s panels.
template <typename Widen>
torch::Tensor panel_product(const torch::Tensor& x_in, int64_t kp, int64_t n, const Widen& widen) {
  const int64_t k = x_in.size(-1);
  const auto lead = out_shape(x_in, n);
  torch::Tensor x;
  if (kp == k) {  // no padding: float rows as they are
    x = float_rows(x_in);
  } else {
    x = torch::zeros({x_in.numel() / std::max<int64_t>(k, 1), kp}, x_in.options().dtype(torch::kFloat));
    x.narrow(1, 0, k).copy_(x_in.reshape({-1, k}));  // (b, kp): zeros meet the weight's zero columns
  }
  auto y = torch::empty({x.size(0), n}, x.options());
  shardlm::panel_gemm(x.data_ptr<float>(), x.size(0), kp, n, y.data_ptr<float>(), widen);
  return y.view(lead).to(x_in.scalar_type());
}

// The integer prefill panels (qpanel.h) for x (..., k) float32 or bfloat16 whose k columns sit at
// [pad_left, pad_left + k) of kp: its rows quantized as decode quantizes them, then an int8 weight (w8 and its row
// scales s8) or an int4 one (w4); `exact` and `wide` as for gemv_int8.
template <bool Q4>
torch::Tensor integer_panels(const torch::Tensor& x_in, int64_t pad_left, int64_t kp, int64_t n, const int8_t* w8,
                             const float* s8, const shardlm::Int4Tiles* w4, bool exact, bool wide,
                             bool interleaved = false, bool paired = false) {
  const auto x = float_rows(x_in);
  const int64_t b = x.size(0);
  // the calling thread's rows, kept up to 8 M codes (16 MiB): fresh ones were zeroed each call before
  // quantize_range overwrote every value; a longer chunk's are its own, freed with the call
  thread_local shardlm::QuantRows kept;
  shardlm::QuantRows own;
  shardlm::QuantRows& xq = b * kp <= (int64_t{8} << 20) ? kept : own;
  shardlm::quantize_rows_parallel(x.data_ptr<float>(), b, x_in.size(-1), pad_left, kp, xq);
  const auto lead = out_shape(x_in, n);
  if (wide) {
    auto y = torch::empty({b, n}, x.options().dtype(torch::kDouble));
    shardlm::qpanel_gemm<double, Q4>(w8, s8, w4, n, xq, b, true, y.data_ptr<double>(), interleaved, paired);
    return y.view(lead);
  }
  auto y = torch::empty({b, n}, x.options());
  shardlm::qpanel_gemm<float, Q4>(w8, s8, w4, n, xq, b, exact, y.data_ptr<float>(), interleaved, paired);
  return y.view(lead).to(x_in.scalar_type());
}

// A copy of int8 codes (n, kp), kp a multiple of 32, in qexact.h's interleaved order (or back from it: the same
// transpose), for the exact kernels.
torch::Tensor interleave_int8(torch::Tensor q) {
  return reordered_int8(q, "interleave_int8", shardlm::interleave_codes<int8_t>);
}

// A copy of int8 codes (n, kp), kp a multiple of 32, in qpairs.h's paired order (or back from it: the same
// exchange), for the float-summed kernels.
torch::Tensor pair_int8(torch::Tensor q) { return reordered_int8(q, "pair_int8", shardlm::pair_codes<int8_t>); }

// Prefill with an int8 weight: the arguments of gemv_int8, through the integer panels.
torch::Tensor prefill_int8(torch::Tensor x_in, torch::Tensor q, torch::Tensor scale, bool exact, bool wide,
                           bool interleaved, bool paired) {
  check_int8(q, scale, x_in.size(-1), "prefill_int8");
  check_code_order("prefill_int8", exact, wide, interleaved, paired);
  const auto scale32 = scale.to(torch::kFloat).contiguous();
  return integer_panels<false>(x_in, 0, q.size(1), q.size(0), q.data_ptr<int8_t>(), scale32.data_ptr<float>(), nullptr,
                               exact, wide, interleaved, paired);
}

// Prefill with an int4 weight: the arguments of gemm_int4, through the integer panels (gemm_int4's arithmetic per
// output).
torch::Tensor prefill_int4(torch::Tensor x_in, torch::Tensor codes, torch::Tensor sz, int64_t pad_left, int64_t n,
                           bool exact, bool wide) {
  const shardlm::Int4Tiles w = shardlm::int4_tiles(codes, sz, n, x_in.size(-1), pad_left, "prefill_int4");
  return integer_panels<true>(x_in, pad_left, w.groups * shardlm::QBLOCK, n, nullptr, nullptr, &w, exact, wide);
}

// Prefill with a float32 or bfloat16 weight (n, k): x (..., k) -> (..., n) in x's dtype, each output one FMA chain
// over k in order, whatever the rows around it: passes of up to `few_rows` rows read the weight in place
// (fewrows.h), larger ones through widened panels (qgemm.h); both give the same bits.
template <typename W>
torch::Tensor prefill_float_t(const torch::Tensor& x_in, const torch::Tensor& w, int64_t few_rows) {
  const int64_t n = w.size(0), k = w.size(1), kp = (k + 7) / 8 * 8;
  const W* wp = shardlm::data<W>(w);
  if (x_in.numel() / std::max<int64_t>(k, 1) > few_rows)
    return panel_product(x_in, kp, n,
                         [&](int64_t r0, float* out) { shardlm::widen_panel_float(wp, k, kp, n, r0, out); });
  const auto x = float_rows(x_in);  // (b, k)
  auto y = torch::empty({x.size(0), n}, x.options());
  shardlm::few_rows_gemm(x.data_ptr<float>(), x.size(0), k, wp, n, y.data_ptr<float>());
  return y.view(out_shape(x_in, n)).to(x_in.scalar_type());
}

torch::Tensor prefill_float(torch::Tensor x_in, torch::Tensor w, int64_t few_rows) {
  TORCH_CHECK(w.dim() == 2 && x_in.size(-1) == w.size(1) && w.is_contiguous(),
              "prefill_float: shapes (..., k) and contiguous (n, k) expected; got ", x_in.sizes(), " and ", w.sizes());
  TORCH_CHECK(w.scalar_type() == torch::kFloat || w.scalar_type() == torch::kBFloat16,
              "prefill_float: float32 or bfloat16 weights");
  return w.scalar_type() == torch::kFloat ? prefill_float_t<float>(x_in, w, few_rows)
                                          : prefill_float_t<uint16_t>(x_in, w, few_rows);
}

// Each row's argmax of logits (b, n) float32, as torch.argmax(dim=-1) gives it -> (b,) int64 (argmax.h).
torch::Tensor argmax_rows(torch::Tensor logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == torch::kFloat && logits.size(1) > 0,
              "argmax_rows: float32 logits (rows, vocab) expected; got ", logits.sizes(), " ", logits.scalar_type());
  const auto x = logits.contiguous();
  auto out = torch::empty({x.size(0)}, torch::kLong);
  shardlm::argmax_rows(x.data_ptr<float>(), x.size(0), x.size(1), out.data_ptr<int64_t>());
  return out;
}

// Each row's inverse-CDF draw from probabilities (b, n) float32 at uniforms u (b,) float64, as runtime/sampling.py's
// `draw` gives it (draw.h) -> (b,) int64; -1 for a row whose total is not finite.
torch::Tensor draw_rows(torch::Tensor probs, torch::Tensor u) {
  TORCH_CHECK(probs.dim() == 2 && probs.scalar_type() == torch::kFloat && u.dim() == 1 &&
                  u.scalar_type() == torch::kDouble && u.size(0) == probs.size(0) && probs.size(1) > 0,
              "draw_rows: float32 probabilities (rows, vocab) and float64 uniforms (rows,) expected; got ",
              probs.sizes(), " ", probs.scalar_type(), " and ", u.sizes(), " ", u.scalar_type());
  const auto p = probs.contiguous();
  const auto uu = u.contiguous();
  auto out = torch::empty({p.size(0)}, torch::kLong);
  shardlm::draw_rows(p.data_ptr<float>(), p.size(0), p.size(1), uu.data_ptr<double>(), out.data_ptr<int64_t>());
  return out;
}

// Greedy decode tokens of a one-rank CPU model in one call (runtime/greedy_run.py): each token takes, op for op, the
// path a Python decode step takes (embedding row, rotary rows, the DecodeStack, the final RMSNorm through torch's
// rms_norm, the LM head through gemv / gemv_int8, argmax_rows), so its tokens and cache writes are that path's bit for
// bit; what goes is the Python between the ops and its per-step objects (about 0.4 ms of a 2.7 ms int4 token, much
// of it torch ops run on caches the weights had just flushed).
struct GreedyModel {
  std::optional<torch::Tensor> embed_q, embed_scale, embed_weight;  // int8 rows and scales, or float rows
  int64_t embed_width = 0;                                            // an int8 row's real width
  torch::Tensor like;                                                 // an empty tensor of the model's dtype
  torch::Tensor cos_table, sin_table;  // (max_len, hd) in the model's dtype, or undefined: from inv_freq each token
  torch::Tensor inv_freq;              // (hd / 2,) float32
  torch::Tensor norm_weight;
  double norm_eps = 0.0;
  std::optional<torch::Tensor> head_q, head_scale, head_weight;       // int8 head, or float head
  std::optional<torch::Tensor> head4_codes, head4_sz;                 // or int4 head (pad_left, rows)
  int64_t head4_pad_left = 0, head4_rows = 0;
  bool head_exact = false;
  bool embed_paired = false, head_paired = false;  // int8 codes in qpairs.h's paired order
};

// tokens (b,) -> (b, dim) in the model's dtype, as Int8Embedding / nn.Embedding compute them.
static torch::Tensor greedy_embed(const GreedyModel& m, const torch::Tensor& tokens) {
  const auto dtype = m.like.scalar_type();
  if (m.embed_q.has_value()) {
    auto rows = m.embed_q->index_select(0, tokens);  // (b, kp), a copy
    if (m.embed_paired) shardlm::pair_codes(rows.data_ptr<int8_t>(), rows.size(0), rows.size(1));  // back to natural
    const auto codes = rows.narrow(1, 0, m.embed_width).to(torch::kFloat);
    return (codes * m.embed_scale->index_select(0, tokens).to(torch::kFloat).unsqueeze(-1)).to(dtype);
  }
  return m.embed_weight->index_select(0, tokens);
}

// The rotary rows (b, hd) of positions (b,): the table's rows, or rope_cos_sin's ops on a step's shapes.
static std::pair<torch::Tensor, torch::Tensor> greedy_rope(const GreedyModel& m, const torch::Tensor& pos) {
  if (m.cos_table.defined()) return {m.cos_table.index_select(0, pos), m.sin_table.index_select(0, pos)};
  const int64_t b = pos.size(0);
  const auto freqs = pos.to(torch::kFloat).view({b, 1, 1}) * m.inv_freq.view({1, 1, -1});  // (b, 1, hd / 2)
  const auto emb = at::cat({freqs, freqs}, -1);                                            // (b, 1, hd)
  const auto dtype = m.like.scalar_type();
  return {emb.cos().to(dtype).view({b, -1}), emb.sin().to(dtype).view({b, -1})};
}

// (b, t) bool: row j sees keys [max(0, p_j - window + 1), p_j] (window 0: no window), t = max(p) + 1.
static torch::Tensor greedy_mask(const std::vector<int64_t>& pos, int64_t window) {
  const int64_t b = static_cast<int64_t>(pos.size()), t = *std::max_element(pos.begin(), pos.end()) + 1;
  auto mask = torch::empty({b, t}, torch::kBool);
  bool* mp = mask.data_ptr<bool>();
  for (int64_t j = 0; j < b; ++j)
    for (int64_t k = 0; k < t; ++k) mp[j * t + k] = k <= pos[j] && (window <= 0 || k > pos[j] - window);
  return mask;
}

// h (b, dim) after the last block -> logits (b, vocab) float32: RMSNorm.forward, then the head's product, .float().
static torch::Tensor greedy_logits(const GreedyModel& m, const torch::Tensor& h) {
  const auto x = h.view({h.size(0), 1, h.size(1)});  // (b, 1, dim), as the module path holds it
  const auto normed = at::rms_norm(x.to(torch::kFloat), {h.size(1)}, std::nullopt, m.norm_eps).to(x.scalar_type());
  const auto y = m.norm_weight * normed;
  const auto logits = m.head_q.has_value() ? gemv_int8(y, *m.head_q, *m.head_scale, m.head_exact, false, false,
                                                       m.head_paired)  // natural or paired codes (greedy_run.py)
                      : m.head4_codes.has_value()
                          ? gemm_int4(y, *m.head4_codes, *m.head4_sz, m.head4_pad_left, m.head4_rows, m.head_exact, false)
                          : gemv(y, *m.head_weight);  // (b, 1, vocab)
  return logits.to(torch::kFloat).select(1, 0);  // (b, vocab)
}

using Caches = std::vector<std::pair<torch::Tensor, torch::Tensor>>;

// greedy_run's and decode_logits's inputs: tokens, rows and positions (b,), one embedding, one head.
static void check_step_inputs(const GreedyModel& m, const torch::Tensor& tokens, const torch::Tensor& rows,
                              const torch::Tensor& positions) {
  TORCH_CHECK(tokens.dim() == 1 && tokens.size(0) > 0 && rows.sizes() == tokens.sizes() &&
                  positions.sizes() == tokens.sizes(),
              "greedy_run: tokens, rows and positions must be (b,) with b > 0");
  TORCH_CHECK(m.embed_q.has_value() + m.embed_weight.has_value() == 1 && m.embed_q.has_value() == m.embed_scale.has_value(),
              "greedy_run: the model needs one embedding: int8 rows with their scales, or float rows");
  TORCH_CHECK(m.head_q.has_value() + m.head4_codes.has_value() + m.head_weight.has_value() == 1 &&
                  m.head_q.has_value() == m.head_scale.has_value() && m.head4_codes.has_value() == m.head4_sz.has_value(),
              "greedy_run: the model needs one head: int8 codes with scales, int4 tiles, or float rows");
  TORCH_CHECK(m.like.defined() && m.norm_weight.defined() && (m.cos_table.defined() || m.inv_freq.defined()),
              "greedy_run: the model's dtype, final norm weight and rotary table or frequencies must be set");
}

// One decode step: tokens (b,) go in at positions (b,) of cache rows (b,) (all int64, contiguous) -> the next
// position's logits (b, vocab) float32.
static torch::Tensor step_logits(const shardlm::DecodeStack& stack, const GreedyModel& m, const Caches& caches,
                                 const torch::Tensor& tok, const torch::Tensor& rows, const torch::Tensor& pos,
                                 int64_t window) {
  const int64_t b = tok.size(0), max_len = caches.empty() ? 0 : caches[0].first.size(2);
  std::vector<int64_t> p(pos.data_ptr<int64_t>(), pos.data_ptr<int64_t>() + b);
  TORCH_CHECK(*std::max_element(p.begin(), p.end()) < max_len, "greedy_run: position ",
              *std::max_element(p.begin(), p.end()), " is past the ", max_len, " positions the cache holds");
  const auto [cs, sn] = greedy_rope(m, pos);
  const auto h = stack.step(greedy_embed(m, tok), cs, sn, rows, pos, greedy_mask(p, window), caches);
  return greedy_logits(m, h);
}

// n greedy tokens for each row: feeding tokens (b,) at positions (b,) into cache rows (b,), then each row's argmax
// at the next position. Returns (n, b) int64.
torch::Tensor greedy_run(const shardlm::DecodeStack& stack, const GreedyModel& m, const Caches& caches,
                         torch::Tensor tokens, torch::Tensor rows, torch::Tensor positions, int64_t window, int64_t n) {
  check_step_inputs(m, tokens, rows, positions);
  TORCH_CHECK(n >= 0, "greedy_run: n is ", n, "; a run has 0 or more tokens");
  auto out = torch::empty({n, tokens.size(0)}, torch::kLong);
  auto pos = positions.to(torch::kLong).contiguous().clone();
  const auto rws = rows.to(torch::kLong).contiguous();
  auto tok = tokens.to(torch::kLong).contiguous();
  for (int64_t i = 0; i < n; ++i) {
    tok = argmax_rows(step_logits(stack, m, caches, tok, rws, pos, window));
    out[i].copy_(tok);
    pos.add_(1);
  }
  return out;
}

// One step of greedy_run's path for rows that sample: the logits (b, vocab) float32 of the position after each
// row's token, bit for bit the Python step's (the caller samples them as that step would).
torch::Tensor decode_logits(const shardlm::DecodeStack& stack, const GreedyModel& m, const Caches& caches,
                            torch::Tensor tokens, torch::Tensor rows, torch::Tensor positions, int64_t window) {
  check_step_inputs(m, tokens, rows, positions);
  return step_logits(stack, m, caches, tokens.to(torch::kLong).contiguous(), rows.to(torch::kLong).contiguous(),
                     positions.to(torch::kLong).contiguous(), window);
}

// The fused step's phase clock (team.h): on (from zero) or off; and its times, (threads, phases, 2) seconds of work
// and wait, with the seconds inside the steps' parallel regions and the steps counted.
static void step_phases(bool on) {
  shardlm::phase_clock().reset();
  shardlm::phase_clock().on.store(on);
}
static std::tuple<torch::Tensor, double, int64_t> step_phase_times() {
  using shardlm::PhaseClock;
  const PhaseClock& c = shardlm::phase_clock();
  auto out = torch::empty({PhaseClock::THREADS, PhaseClock::PHASES, 2}, torch::kDouble);
  auto a = out.accessor<double, 3>();
  for (int t = 0; t < PhaseClock::THREADS; ++t)
    for (int p = 0; p < PhaseClock::PHASES; ++p) a[t][p][0] = c.work[t][p], a[t][p][1] = c.wait[t][p];
  return {out, c.region, c.steps};
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("step_phases", &step_phases, "turn the fused decode step's phase clock on (from zero) or off", py::arg("on"));
  m.def("step_phase_times", &step_phase_times, "the phase clock's (threads, phases, 2) seconds of work and wait, "
        "seconds inside the steps' parallel regions, steps");
  m.def("gemv", &gemv, "decode matrix-vector product");
  m.def("argmax_rows", &argmax_rows, "each row's argmax, as torch.argmax(dim=-1)", py::arg("logits"));
  m.def("draw_rows", &draw_rows, "each row's inverse-CDF draw, as runtime/sampling.py's draw", py::arg("probs"),
        py::arg("u"));
  m.def("gemv_int8", &gemv_int8, "matrix product with int8 weights and per-row scales (wide: float64 out)",
        py::arg("x"), py::arg("q"), py::arg("scale"), py::arg("exact") = false, py::arg("wide") = false,
        py::arg("interleaved") = false, py::arg("paired") = false);
  m.def("gemm_int4", &gemm_int4, "matrix product with int4 weights in groups of 32 (wide: float64 out)",
        py::arg("x"), py::arg("codes"), py::arg("sz"), py::arg("pad_left"), py::arg("n"), py::arg("exact") = false,
        py::arg("wide") = false);
  m.def("prefill_float", &prefill_float, "many-row product with float32 or bfloat16 weights (in place for a few rows, "
        "else through panels)", py::arg("x"), py::arg("w"), py::arg("few_rows") = shardlm::FEW_ROWS);
  m.def("prefill_int8", &prefill_int8, "many-row product with int8 weights through integer panels",
        py::arg("x"), py::arg("q"), py::arg("scale"), py::arg("exact") = false, py::arg("wide") = false,
        py::arg("interleaved") = false, py::arg("paired") = false);
  m.def("prefill_int4", &prefill_int4, "many-row product with int4 weights through integer panels",
        py::arg("x"), py::arg("codes"), py::arg("sz"), py::arg("pad_left"), py::arg("n"), py::arg("exact") = false,
        py::arg("wide") = false);
  m.def("interleave_int8", &interleave_int8, "an int8 weight's codes (n, kp) in qexact.h's interleaved order, or "
        "back (the same transpose)", py::arg("q"));
  m.def("pair_int8", &pair_int8, "an int8 weight's codes (n, kp) in qpairs.h's paired order, or back (the same "
        "exchange)", py::arg("q"));
  m.def("int8_units", &shardlm::int8_units, "the instructions the int8 dot products use on this build");
  m.def("bf16_dot", [] { return shardlm::BF16_DOT; }, "whether bfloat16 rows use avx512_bf16 dot products");
  m.def("prefill_attention", &shardlm::prefill_attention, "attention of every position of a prefill pass");
  m.def("prefill_norm", &shardlm::prefill_norm, "[x + residual, rms_norm(x + residual) * weight] of a prefill pass",
        py::arg("x"), py::arg("residual"), py::arg("weight"), py::arg("eps"));
  m.def("rope_heads", &shardlm::rope_heads, "rotary embedding of (b, s, heads * hd), laid out (b, heads, s, hd)",
        py::arg("x"), py::arg("cos"), py::arg("sin"), py::arg("head_dim"));
  m.def("silu_mul_", &shardlm::silu_mul_, "up = silu(gate) * up in place", py::arg("up"), py::arg("gate"));
  m.def("attn_decode", &shardlm::attn_decode, "attention half of a block for one new token per row");
  m.def("mlp_decode", &shardlm::mlp_decode, "MLP half of a block up to the down projection");
  // module_local: a build for another instruction set (tests load haswell and x86-64 builds) registers its own
  py::class_<shardlm::DecodeStack>(m, "DecodeStack", py::module_local(),
                                   "every block of a one-rank model in one call per decode step")
      .def(py::init<const std::vector<std::vector<torch::Tensor>>&,
                    const std::vector<std::optional<std::vector<torch::Tensor>>>&,
                    const std::vector<std::optional<std::vector<std::pair<int64_t, int64_t>>>>&,
                    const std::vector<std::vector<std::optional<torch::Tensor>>>&,
                    const std::vector<std::pair<torch::Tensor, torch::Tensor>>&,
                    const std::vector<std::pair<double, double>>&, const std::vector<torch::Tensor>&>(),
           py::arg("weights"), py::arg("scales"), py::arg("pads"), py::arg("biases"), py::arg("norms"),
           py::arg("eps"), py::arg("kv_maps"))
      .def("step", &shardlm::DecodeStack::step, py::arg("x"), py::arg("cos"), py::arg("sin"), py::arg("rows"),
           py::arg("positions"), py::arg("mask"), py::arg("caches"))
      .def("__len__", &shardlm::DecodeStack::size);
  py::class_<GreedyModel>(m, "GreedyModel", py::module_local(), "what greedy_run reads besides the stack")
      .def(py::init<>())
      .def_readwrite("embed_q", &GreedyModel::embed_q)
      .def_readwrite("embed_scale", &GreedyModel::embed_scale)
      .def_readwrite("embed_weight", &GreedyModel::embed_weight)
      .def_readwrite("embed_width", &GreedyModel::embed_width)
      .def_readwrite("like", &GreedyModel::like)
      .def_readwrite("inv_freq", &GreedyModel::inv_freq)
      .def_readwrite("cos_table", &GreedyModel::cos_table)
      .def_readwrite("sin_table", &GreedyModel::sin_table)
      .def_readwrite("norm_weight", &GreedyModel::norm_weight)
      .def_readwrite("norm_eps", &GreedyModel::norm_eps)
      .def_readwrite("head_q", &GreedyModel::head_q)
      .def_readwrite("head_scale", &GreedyModel::head_scale)
      .def_readwrite("head_weight", &GreedyModel::head_weight)
      .def_readwrite("head4_codes", &GreedyModel::head4_codes)
      .def_readwrite("head4_sz", &GreedyModel::head4_sz)
      .def_readwrite("head4_pad_left", &GreedyModel::head4_pad_left)
      .def_readwrite("head4_rows", &GreedyModel::head4_rows)
      .def_readwrite("head_exact", &GreedyModel::head_exact)
      .def_readwrite("embed_paired", &GreedyModel::embed_paired)
      .def_readwrite("head_paired", &GreedyModel::head_paired);
  // without the GIL: a run lasts many tokens, and the rank's heartbeat thread must go on stamping meanwhile
  m.def("greedy_run", &greedy_run, "greedy decode tokens of a one-rank model, each as a Python step computes it",
        py::arg("stack"), py::arg("model"), py::arg("caches"), py::arg("tokens"), py::arg("rows"), py::arg("positions"),
        py::arg("window"), py::arg("n"), py::call_guard<py::gil_scoped_release>());
  m.def("decode_logits", &decode_logits, "one decode step of greedy_run's path -> logits (b, vocab) float32",
        py::arg("stack"), py::arg("model"), py::arg("caches"), py::arg("tokens"), py::arg("rows"), py::arg("positions"),
        py::arg("window"), py::call_guard<py::gil_scoped_release>());
}
