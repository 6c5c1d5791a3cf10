// The compiled CPU decode kernels (one extension module, built once per machine by shardlm.kernels):
// `gemv` here, and the fused attention / MLP halves of a block in decode.h.
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
#include <cstdint>

#include "decode.h"

// x (..., k) float32 or bfloat16; w (n, k) float32 or bfloat16 contiguous -> (..., n) in x's dtype.
// Accumulates in float32. One call per linear layer keeps the per-layer Python overhead small.
torch::Tensor gemv(torch::Tensor x_in, torch::Tensor w) {
  TORCH_CHECK(w.dim() == 2 && x_in.size(-1) == w.size(1), "gemv: shapes (..., k) and (n, k) expected");
  TORCH_CHECK(w.is_contiguous(), "gemv: contiguous weight expected");
  auto lead = x_in.sizes().vec();
  lead.pop_back();
  auto x = x_in.reshape({-1, x_in.size(-1)}).to(torch::kFloat).contiguous();
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
  lead.push_back(n);
  return y.view(lead).to(x_in.scalar_type());
}

// x (..., k) float32 or bfloat16; q (n, kq) int8 codes, kq >= k (zero columns past k are skipped); scale (n,)
// -> (..., n) in x's dtype: x @ (q * scale)^T, accumulated in float32 (activations stay float32).
torch::Tensor gemv_int8(torch::Tensor x_in, torch::Tensor q, torch::Tensor scale) {
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == torch::kChar && q.is_contiguous(), "gemv_int8: contiguous int8 (n, kq)");
  TORCH_CHECK(x_in.size(-1) <= q.size(1) && scale.numel() == q.size(0), "gemv_int8: shapes (..., k), (n, kq >= k), (n,)");
  auto lead = x_in.sizes().vec();
  lead.pop_back();
  auto x = x_in.reshape({-1, x_in.size(-1)}).to(torch::kFloat).contiguous();
  const int64_t n = q.size(0), k = x.size(1), b = x.size(0);
  auto y = torch::empty({b, n}, x.options());
  shardlm::gemv_segments<int8_t>({{q.data_ptr<int8_t>(), y.data_ptr<float>(), n}}, x.data_ptr<float>(), k, b,
                                 q.size(1));
  y.mul_(scale.to(torch::kFloat));  // (b, n) * (n,): each output row's scale
  lead.push_back(n);
  return y.view(lead).to(x_in.scalar_type());
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("gemv", &gemv, "decode matrix-vector product");
  m.def("gemv_int8", &gemv_int8, "decode matrix-vector product with int8 weights and per-row scales");
  m.def("attn_decode", &shardlm::attn_decode, "attention half of a block for one new token per row");
  m.def("mlp_decode", &shardlm::mlp_decode, "MLP half of a block up to the down projection");
}
