// The element-wise work of a float32 prefill block, each step one pass over its rows in parallel: the norms (with
// the residual add before the second one), the rotary embedding (which also lays q and k out by head) and the
// MLP's gating.
//
// A prefill pass of the bundled model spent ~20 % of its time in these as torch ops (a 512-token pass: 67 of 306 ms,
// torch.profiler): the rotary multiplies ran on transposed views, each norm took five passes and its weight a sixth.
// Every value here is computed alike whatever the rows beside it, so a token's result does not depend on the batch
// or on the chunk around it. The norm, the gating and the rotation are decode's (rows.h rms_norm_rows, attend.h
// silu_mul, decode.h rotate_head), so a prefill and a decode of the same hidden state norm and gate it alike; the
// rotation rounds as the module path's torch ops do (each product rounded, then the sum), so its bits equal theirs.
#pragma once
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <optional>
#include <vector>

#include "attend.h"
#include "decode.h"
#include "rows.h"

namespace shardlm {

inline void check_f32(const torch::Tensor& t, const char* who, const char* name) {
  TORCH_CHECK(t.scalar_type() == torch::kFloat && t.is_contiguous() && t.device().is_cpu(), who, ": ", name,
              " must be a contiguous float32 CPU tensor, got ", t.scalar_type(), " ", t.sizes());
}

// x (..., d) float32 -> [h, w * rms_norm(h)] with h = x + residual (or x itself without one), both (..., d).
inline std::vector<torch::Tensor> prefill_norm(torch::Tensor x, std::optional<torch::Tensor> residual,
                                               torch::Tensor weight, double eps) {
  check_f32(x, "prefill_norm", "x");
  check_f32(weight, "prefill_norm", "norm weight");
  const int64_t d = x.size(-1), rows = x.numel() / std::max<int64_t>(d, 1);
  TORCH_CHECK(weight.numel() == d, "prefill_norm: norm weight has ", weight.numel(), " values, rows have ", d);
  torch::Tensor h = x;
  if (residual.has_value()) {
    check_f32(*residual, "prefill_norm", "residual");
    TORCH_CHECK(residual->sizes() == x.sizes(), "prefill_norm: residual ", residual->sizes(), " and x ", x.sizes(),
                " differ");
    h = torch::empty_like(x);
  }
  auto out = torch::empty_like(x);
  const float *xp = x.data_ptr<float>(), *rp = residual.has_value() ? residual->data_ptr<float>() : nullptr;
  const float* wp = weight.data_ptr<float>();
  float *hp = h.data_ptr<float>(), *op = out.data_ptr<float>();
  at::parallel_for(0, rows, 16, [&](int64_t lo, int64_t hi) {
    if (rp != nullptr)
      for (int64_t i = lo * d; i < hi * d; ++i) hp[i] = xp[i] + rp[i];
    rms_norm_rows(hp + lo * d, wp, static_cast<float>(eps), op + lo * d, hi - lo, d);
  });
  return {h, out};
}

// x (b, s, heads * hd) float32, cos and sin (b, 1, s, hd) -> (b, heads, s, hd): each head rotated (half-split
// convention) and laid out by head, as apply_rope(x.view(b, s, heads, hd).transpose(1, 2), cos, sin) computes it.
inline torch::Tensor rope_heads(torch::Tensor x, torch::Tensor cos, torch::Tensor sin, int64_t hd) {
  for (auto [t, name] : {std::pair{&x, "x"}, {&cos, "cos"}, {&sin, "sin"}}) check_f32(*t, "rope_heads", name);
  TORCH_CHECK(x.dim() == 3 && hd > 0 && hd % 2 == 0 && x.size(2) % hd == 0, "rope_heads: x (b, s, heads * ", hd,
              ") expected, got ", x.sizes());
  const int64_t b = x.size(0), s = x.size(1), heads = x.size(2) / hd;
  TORCH_CHECK(cos.numel() == b * s * hd && sin.numel() == b * s * hd, "rope_heads: cos and sin (", b, ", 1, ", s,
              ", ", hd, ") expected, got ", cos.sizes(), " and ", sin.sizes());
  auto out = torch::empty({b, heads, s, hd}, x.options());
  const float *xp = x.data_ptr<float>(), *cp = cos.data_ptr<float>(), *sp = sin.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, b * heads, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t g = lo; g < hi; ++g) {
      const int64_t j = g / heads, h = g % heads;
      for (int64_t p = 0; p < s; ++p)  // position p of head h: from (j, p, h) to (j, h, p)
        rotate_head(xp + ((j * s + p) * heads + h) * hd, cp + (j * s + p) * hd, sp + (j * s + p) * hd,
                    op + ((j * heads + h) * s + p) * hd, hd);
    }
  });
  return out;
}

// up = silu(gate) * up in place, gate and up (..., n) float32 alike; returns up.
inline torch::Tensor silu_mul_(torch::Tensor up, torch::Tensor gate) {
  check_f32(up, "silu_mul_", "up");
  check_f32(gate, "silu_mul_", "gate");
  TORCH_CHECK(up.sizes() == gate.sizes(), "silu_mul_: gate ", gate.sizes(), " and up ", up.sizes(), " differ");
  const int64_t n = up.size(-1), rows = up.numel() / std::max<int64_t>(n, 1);
  float* ap = up.data_ptr<float>();
  const float* gp = gate.data_ptr<float>();
  at::parallel_for(0, rows, 4, [&](int64_t lo, int64_t hi) {
    for (int64_t r = lo; r < hi; ++r) silu_mul(ap + r * n, gp + r * n, n);  // every value alike (attend.h)
  });
  return up;
}

}  // namespace shardlm
