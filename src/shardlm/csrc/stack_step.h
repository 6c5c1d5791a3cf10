// One decode step of every block of a one-rank model in a single parallel region (team.h): the threads run the
// whole step together and meet at a barrier where a phase needs the others' results, six times a block (after the
// q/k/v products, after rotary and the cache writes, after attention, after the o product, after the gated
// activation and after the down product: the phases of Phase, which team.h's phase clock times when asked).
//
// Per value the arithmetic is the fused halves' (decode.h), in the same order, so the output is theirs bit for bit:
// each thread takes a fixed share of each product's rows (a row's sum does not depend on who computes it), the norms
// and the activations' quantization run in every thread on its own copy (the same function of the same input), the
// residual adds and the rounding to the model's dtype happen where the halves' `add_rows` and `.to(dtype)` did.
// Buffers are allocated once per step, not per block, and nothing that can fail runs between two barriers but the
// products themselves: a thread that throws marks the team failed, the others leave their waits, and the step
// rethrows.
#pragma once
#include <torch/extension.h>
#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <stdexcept>
#include <utility>
#include <vector>

#include "decode.h"
#include "decode_attn.h"
#include "team.h"

namespace shardlm {

// One block's fixed tensors: norms (as given and in float32), the seven linear weights (see Linear), float32
// biases (undefined where there are none) and the query heads' KV map.
struct StackBlock {
  torch::Tensor ln1, ln2, ln1f, ln2f, kv_map;
  float eps1 = 0.f, eps2 = 0.f;
  Linear q, k, v, o, gate, up, down;
  torch::Tensor bq, bk, bv, bo, bg, bu, bd;
};

// Units of a weight's parallel range (int4: tiles of 16 rows; otherwise rows) and the rows units [lo, hi) give.
inline int64_t units_of(const Linear& l) { return l.w.size(0); }
inline std::pair<int64_t, int64_t> unit_rows(const Linear& l, int64_t lo, int64_t hi) {
  if (l.int4()) return {std::min(l.rows, lo * Q4TILE), std::min(l.rows, hi * Q4TILE)};
  return {lo, hi};
}

// y (b, n) rows of units [lo, hi) of `l` times x: float rows x (b, k), or xq, x quantized (int8 and int4 weights).
template <typename W>
inline void product_units(const Linear& l, const float* x, const QuantRows& xq, float* y, int64_t k, int64_t b,
                          int64_t lo, int64_t hi, bool exact) {
  if (lo >= hi) return;
  if (l.quantized())
    quantized_units<float>(l, xq, y, b, lo, hi, exact);
  else
    rows<W>(data<W>(l.w), x, y, l.w.size(0), k, b, lo, hi);
}

// The products of weights that read the same x, as one range of units split over the team (as project() splits
// it); returns this thread's part of the range.
template <typename W>
inline std::pair<int64_t, int64_t> product_share(std::initializer_list<std::pair<const Linear*, float*>> outs,
                                                 const float* x, const QuantRows& xq, int64_t k, int64_t b, bool exact,
                                                 int64_t tid, int64_t team) {
  int64_t total = 0;
  for (auto [l, y] : outs) total += units_of(*l);
  const auto [lo, hi] = share_of(total, tid, team, outs.begin()->first->int4() ? 1 : 16);
  each_part(outs, lo, hi, [&](const Linear& l, float* y, int64_t a, int64_t e) {
    product_units<W>(l, x, xq, y, k, b, a, e, exact);
  });
  return {lo, hi};
}

// The phases of a block, each ended by a barrier (the phase clock's indices: kernels.cpp's step_phase_times).
enum Phase : int { QKV = 0, ROTARY = 1, ATTEND = 2, OUT = 3, GATE_UP = 4, DOWN = 5 };

inline float round_to(float v, float) { return v; }
inline float round_to(float v, uint16_t) { return bf16_to_float(store<uint16_t>(v)); }

template <typename W>
class StackStep {
 public:
  StackStep(const std::vector<StackBlock>& blocks, const torch::Tensor& x, const torch::Tensor& cos,
            const torch::Tensor& sin, const torch::Tensor& rows, const torch::Tensor& positions,
            const torch::Tensor& mask, const std::vector<std::pair<torch::Tensor, torch::Tensor>>& caches,
            int64_t threads)
      : blocks_(blocks), caches_(caches), x_(x), team_(threads) {
    check_inputs(cos, sin, rows, positions, mask);
    cos_ = f32(cos), sin_ = f32(sin);
    for (const StackBlock& blk : blocks_) {
      nq_ = std::max(nq_, blk.q.out_rows()), nk_ = std::max(nk_, blk.k.out_rows());
      inter_ = std::max(inter_, blk.gate.out_rows());
    }
    plan_attention_of_blocks();
    const auto x32 = f32(x);
    xs_.assign(x32.data_ptr<float>(), x32.data_ptr<float>() + b_ * dim_);
    hs_.resize(b_ * dim_), out_.resize(b_ * dim_), q_.resize(b_ * nq_), heads_.resize(b_ * nq_);
    k_.resize(b_ * nk_), v_.resize(b_ * nk_), gate_.resize(b_ * inter_), act_.resize(b_ * inter_);
  }

  // Every block, then x (b, dim) in the model's dtype.
  torch::Tensor run() {
    std::atomic<bool> short_team{false};
    const double t0 = team_.timed() ? PhaseClock::now() : 0.0;
    if (team_.size() == 1) {
      thread(0);
    } else {
#pragma omp parallel num_threads(team_.size())
      {
        if (omp_get_num_threads() != team_.size())  // a smaller team than asked: run alone after the region
          short_team.store(true);
        else
          thread(omp_get_thread_num());
      }
    }
    // a smaller team than asked reruns the step alone below, which counts itself
    if (team_.timed() && !short_team.load()) phase_clock().region += PhaseClock::now() - t0, phase_clock().steps += 1;
    if (short_team.load())
      return StackStep<W>(blocks_, x_, cos_in_, sin_in_, rows_in_, pos_in_, mask_in_, caches_, 1).run();
    team_.rethrow();
    auto out = torch::empty({b_, dim_}, x_.options());
    W* o = mutable_data<W>(out);
    for (int64_t i = 0; i < b_ * dim_; ++i) o[i] = store<W>(xs_[i]);
    return out;
  }

 private:
  // A thread's own buffers: the normed input, its quantized form and attention's scratch scores.
  struct Scratch {
    std::vector<float> xn, p;
    QuantRows xq;
  };

  void check_inputs(const torch::Tensor& cos, const torch::Tensor& sin, const torch::Tensor& rows,
                    const torch::Tensor& positions, const torch::Tensor& mask);
  void plan_attention_of_blocks();

  void thread(int64_t tid) {
    try {
      team_.start(tid);
      Scratch s;
      s.xn.resize(b_ * std::max(dim_, std::max(nq_, inter_)));
      s.p.resize(MAX_GROUP * std::max<int64_t>(t_, 1));
      for (size_t i = 0; i < blocks_.size(); ++i)
        if (!attention(i, tid, s) || !mlp(blocks_[i], tid, s)) return;
    } catch (...) {
      team_.fail(std::current_exception());
    }
  }

  // x normed by `ln` (and quantized for `l`'s kind of weight) into the thread's scratch.
  void norm_input(const float* x, const torch::Tensor& ln, float eps, const Linear& l, Scratch& s) const {
    rms_norm_rows(x, ln.data_ptr<float>(), eps, s.xn.data(), b_, dim_);
    if (l.quantized()) quantize_for(l, s.xn.data(), b_, dim_, false, s.xq);
  }

  // y (b, n) columns [lo, hi) = round(y + res (+ bias)) in the model's dtype, as add_rows then .to(dtype).
  void finish(const float* y, const float* res, const torch::Tensor& bias, float* into, int64_t lo, int64_t hi) const {
    const float* bp = ptr_or_null(bias);
    for (int64_t j = 0; j < b_; ++j)
      for (int64_t i = lo; i < hi; ++i) {
        float v = y[j * dim_ + i] + res[j * dim_ + i];
        if (bp) v += bp[i];
        into[j * dim_ + i] = round_to(v, W{});
      }
  }

  // An output projection's share (o or down, summed as `exact` weights): `in` (b, k) through w, then
  // into = round(w's rows + res (+ bias)) on this thread's columns.
  void output_share(const Linear& w, const float* in, int64_t k, const float* res, const torch::Tensor& bias,
                    float* into, int64_t tid, Scratch& s) {
    if (w.quantized()) quantize_for(w, in, b_, k, true, s.xq);
    const auto [lo, hi] = product_share<W>({{&w, out_.data()}}, in, s.xq, k, b_, true, tid, team_.size());
    const auto [r0, r1] = unit_rows(w, lo, hi);
    finish(out_.data(), res, bias, into, r0, r1);
  }

  bool attention(size_t i, int64_t tid, Scratch& s);
  void rotate_share(const StackBlock& blk, size_t i, int64_t tid);
  bool mlp(const StackBlock& blk, int64_t tid, Scratch& s);

  const std::vector<StackBlock>& blocks_;
  const std::vector<std::pair<torch::Tensor, torch::Tensor>>& caches_;
  torch::Tensor x_, cos_in_, sin_in_, rows_in_, pos_in_, mask_in_, cos_, sin_;
  Team team_;
  int64_t b_ = 0, dim_ = 0, t_ = 0, hd_ = 0, nq_ = 0, nk_ = 0, inter_ = 0;
  const int64_t *row_of_ = nullptr, *pos_of_ = nullptr;
  const bool* mask_ = nullptr;
  std::vector<AttnPlan> plans_;
  std::vector<size_t> plan_of_;  // block i's plan: plans_[plan_of_[i]]
  std::vector<float> xs_, hs_, out_, q_, k_, v_, heads_, gate_, act_;
};

// The step's inputs against every block's cache, checked before any thread starts (nothing in the region checks).
template <typename W>
void StackStep<W>::check_inputs(const torch::Tensor& cos, const torch::Tensor& sin, const torch::Tensor& rows,
                                const torch::Tensor& positions, const torch::Tensor& mask) {
  const auto dtype = dtype_of<W>();
  check(x_, dtype, "x");
  check(cos, dtype, "cos");
  check(sin, dtype, "sin");
  cos_in_ = cos, sin_in_ = sin, rows_in_ = rows, pos_in_ = positions, mask_in_ = mask;
  TORCH_CHECK(x_.dim() == 2 && x_.size(1) == blocks_[0].ln1.numel(), "decode stack: x is ", x_.sizes(),
              ", expected (b, ", blocks_[0].ln1.numel(), ")");
  b_ = x_.size(0), dim_ = x_.size(1);
  TORCH_CHECK(rows.scalar_type() == torch::kLong && positions.scalar_type() == torch::kLong && rows.numel() == b_ &&
                  positions.numel() == b_ && rows.is_contiguous() && positions.is_contiguous(),
              "fused decode: rows and positions must be (b,) int64");
  TORCH_CHECK(mask.scalar_type() == torch::kBool && mask.is_contiguous() && mask.dim() == 2 && mask.size(0) == b_,
              "fused decode: mask must be (b, t) bool");
  t_ = mask.size(1);
  row_of_ = rows.data_ptr<int64_t>(), pos_of_ = positions.data_ptr<int64_t>(), mask_ = mask.data_ptr<bool>();
  for (size_t i = 0; i < blocks_.size(); ++i) {
    const StackBlock& blk = blocks_[i];
    const torch::Tensor &kc = caches_[i].first, &vc = caches_[i].second;
    check(kc, dtype, "key cache");
    check(vc, dtype, "value cache");
    TORCH_CHECK(kc.dim() == 4 && vc.sizes() == kc.sizes(), "decode stack: block ", i, " caches ", kc.sizes(), " and ",
                vc.sizes(), ", expected two (slots, kv heads, max_len, head_dim)");
    hd_ = i == 0 ? kc.size(3) : hd_;
    const int64_t hkv = kc.size(1), slots = kc.size(0), max_len = kc.size(2);
    TORCH_CHECK(kc.size(3) == hd_ && hkv * hd_ == blk.k.out_rows() && blk.q.out_rows() % hd_ == 0 &&
                    blk.kv_map.numel() == blk.q.out_rows() / hd_ && cos.size(0) == b_ && cos.size(1) == hd_ &&
                    sin.sizes() == cos.sizes(),
                "decode stack: block ", i, " has ", blk.q.out_rows(), " query and ", blk.k.out_rows(),
                " key outputs, a cache of ", kc.sizes(), " and rotary tables of ", cos.sizes());
    TORCH_CHECK(t_ <= max_len, "KV cache holds ", max_len, " tokens; this step needs ", t_, ". Raise max_len.");
    for (int64_t j = 0; j < b_; ++j)
      TORCH_CHECK(row_of_[j] >= 0 && row_of_[j] < slots && pos_of_[j] >= 0 && pos_of_[j] < t_, "fused decode: row ",
                  j, " writes slot ", row_of_[j], " position ", pos_of_[j], " outside ", slots, " slots x ", t_,
                  " positions");
    const int64_t* map = blk.kv_map.data_ptr<int64_t>();
    for (int64_t h = 0; h < blk.kv_map.numel(); ++h)
      TORCH_CHECK(map[h] >= 0 && map[h] < hkv, "fused decode: kv_map[", h, "] = ", map[h], " is not a local KV head");
  }
}

// Two checked (hq,) int64 KV maps with the same heads (compared in place: a dispatched torch::equal per block and
// step would cost more than the plan it saves).
inline bool same_map(const torch::Tensor& a, const torch::Tensor& b) {
  return a.numel() == b.numel() &&
         std::memcmp(a.data_ptr<int64_t>(), b.data_ptr<int64_t>(), a.numel() * sizeof(int64_t)) == 0;
}

// Each block's attention plan; blocks whose KV map and cache shape equal an earlier block's share its plan.
template <typename W>
void StackStep<W>::plan_attention_of_blocks() {
  for (size_t i = 0; i < blocks_.size(); ++i) {
    const torch::Tensor& map = blocks_[i].kv_map;
    const int64_t hkv = caches_[i].first.size(1), hq = map.numel();
    size_t same = i;
    for (size_t e = 0; e < i && same == i; ++e)
      if (caches_[e].first.size(1) == hkv && same_map(blocks_[e].kv_map, map)) same = plan_of_[e];
    if (same == i) {
      same = plans_.size();
      plans_.push_back(plan_attention(row_of_, map.data_ptr<int64_t>(), mask_, b_, hq, hkv, t_, team_.size()));
    }
    plan_of_.push_back(same);
  }
}

// The attention half of block i: norm, q/k/v, rotary and the cache writes, attention, o, then the residual.
template <typename W>
bool StackStep<W>::attention(size_t i, int64_t tid, Scratch& s) {
  const StackBlock& blk = blocks_[i];
  const int64_t team = team_.size(), nq = blk.q.out_rows();
  norm_input(xs_.data(), blk.ln1f, blk.eps1, blk.q, s);
  product_share<W>({{&blk.q, q_.data()}, {&blk.k, k_.data()}, {&blk.v, v_.data()}}, s.xn.data(), s.xq, dim_, b_,
                   false, tid, team);
  if (!team_.sync(tid, QKV)) return false;
  rotate_share(blk, i, tid);
  if (!team_.sync(tid, ROTARY)) return false;
  const AttnPlan& plan = plans_[plan_of_[i]];
  const torch::Tensor& kc = caches_[i].first;
  if (tid < plan.parts)
    attend_parts<W>(plan, tid, tid + 1, q_.data(), data<W>(kc), data<W>(caches_[i].second), mask_, heads_.data(),
                    nq / hd_, kc.size(1), hd_, kc.size(2), t_, s.p.data());
  if (!team_.sync(tid, ATTEND)) return false;
  output_share(blk.o, heads_.data(), nq, xs_.data(), blk.bo, hs_.data(), tid, s);
  return team_.sync(tid, OUT);
}

// This thread's share of the step's heads (row j's query heads, then its KV heads): the biases added, rotary
// applied, and a KV head's new key and value written to the cache at the row's position.
template <typename W>
void StackStep<W>::rotate_share(const StackBlock& blk, size_t i, int64_t tid) {
  const torch::Tensor &kc = caches_[i].first, &vc = caches_[i].second;
  const int64_t hq = blk.q.out_rows() / hd_, hkv = kc.size(1), max_len = kc.size(2), per_row = hq + hkv;
  const int64_t nq = hq * hd_, nk = hkv * hd_;
  const float *cs = cos_.data_ptr<float>(), *sn = sin_.data_ptr<float>();
  const float *bq = ptr_or_null(blk.bq), *bk = ptr_or_null(blk.bk), *bv = ptr_or_null(blk.bv);
  W *kcp = mutable_data<W>(const_cast<torch::Tensor&>(kc)), *vcp = mutable_data<W>(const_cast<torch::Tensor&>(vc));
  const auto [lo, hi] = share_of(b_ * per_row, tid, team_.size());
  for (int64_t u = lo; u < hi; ++u) {
    const int64_t j = u / per_row, h = u % per_row;
    if (h < hq) {  // a query head: bias, then rotary
      float* x = q_.data() + j * nq + h * hd_;
      if (bq) for (int64_t c = 0; c < hd_; ++c) x[c] += bq[h * hd_ + c];
      rotate_head(x, cs + j * hd_, sn + j * hd_, x, hd_);
      continue;
    }
    const int64_t kh = h - hq;
    float *kx = k_.data() + j * nk + kh * hd_, *vx = v_.data() + j * nk + kh * hd_;
    if (bk) for (int64_t c = 0; c < hd_; ++c) kx[c] += bk[kh * hd_ + c];
    if (bv) for (int64_t c = 0; c < hd_; ++c) vx[c] += bv[kh * hd_ + c];
    rotate_head(kx, cs + j * hd_, sn + j * hd_, kx, hd_);
    const int64_t slot = ((row_of_[j] * hkv + kh) * max_len + pos_of_[j]) * hd_;
    for (int64_t c = 0; c < hd_; ++c) {  // cache[rows[j], kh, positions[j], :] = the new key and value
      kcp[slot + c] = store<W>(kx[c]);
      vcp[slot + c] = store<W>(vx[c]);
    }
  }
}

// The MLP half: norm, gate and up (this thread's same rows of both), silu(gate) * up on those rows, down, residual.
template <typename W>
bool StackStep<W>::mlp(const StackBlock& blk, int64_t tid, Scratch& s) {
  const int64_t team = team_.size(), n = blk.gate.out_rows();
  norm_input(hs_.data(), blk.ln2f, blk.eps2, blk.gate, s);
  const auto [lo, hi] = share_of(units_of(blk.gate), tid, team, blk.gate.int4() ? 1 : 16);
  product_units<W>(blk.gate, s.xn.data(), s.xq, gate_.data(), dim_, b_, lo, hi, false);
  product_units<W>(blk.up, s.xn.data(), s.xq, act_.data(), dim_, b_, lo, hi, false);
  const auto [r0, r1] = unit_rows(blk.gate, lo, hi);
  const float *bg = ptr_or_null(blk.bg), *bu = ptr_or_null(blk.bu);
  for (int64_t j = 0; j < b_; ++j) {
    float *g = gate_.data() + j * n, *a = act_.data() + j * n;
    if (bg) for (int64_t c = r0; c < r1; ++c) g[c] += bg[c];
    if (bu) for (int64_t c = r0; c < r1; ++c) a[c] += bu[c];
    silu_mul(a + r0, g + r0, r1 - r0);
  }
  if (!team_.sync(tid, GATE_UP)) return false;
  output_share(blk.down, act_.data(), n, hs_.data(), blk.bd, xs_.data(), tid, s);
  return team_.sync(tid, DOWN);
}

}  // namespace shardlm
