// The compiled CPU decode kernels (one extension module, built once per machine by shardlm.kernels):
// `gemv` here, the fused attention / MLP halves of a block in decode.h (every block in one call: stack.h), the
// integer decode products with int8 and int4 weights in qrows.h and their prefill products (dequantized panels)
// in qgemm.h.
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

#include "argmax.h"
#include "decode.h"
#include "fewrows.h"
#include "prefill_attn.h"
#include "prefill_ops.h"
#include "qgemm.h"
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

// x (..., k) float32 or bfloat16; q (n, kq) int8 codes, kq = k rounded up to 32 (zero columns past k); scale (n,)
// -> (..., n) in x's dtype: x @ (q * scale)^T. The rows of x are quantized to int16 in blocks of 32 and meet the
// codes in integer dot products (qrows.h). `exact`: summed in double (a row-parallel kind of weight); `wide`:
// summed in double and returned as float64 (a row-parallel rank's partial sums, all-reduced in float64);
// otherwise returned in x's dtype.
torch::Tensor gemv_int8(torch::Tensor x_in, torch::Tensor q, torch::Tensor scale, bool exact, bool wide) {
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == torch::kChar && q.is_contiguous(), "gemv_int8: contiguous int8 (n, kq)");
  const int64_t n = q.size(0), k = x_in.size(-1), kq = q.size(1);
  TORCH_CHECK(kq == (k + shardlm::QBLOCK - 1) / shardlm::QBLOCK * shardlm::QBLOCK && scale.numel() == n,
              "gemv_int8: shapes (..., k), (n, k rounded up to 32), (n,) expected; got k = ", k, ", codes ", q.sizes(),
              ", ", scale.numel(), " scales");
  const auto x = float_rows(x_in), scale32 = scale.to(torch::kFloat).contiguous();
  const int64_t b = x.size(0);
  shardlm::QuantRows xq;
  shardlm::quantize_rows(x.data_ptr<float>(), b, k, kq, xq);
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
  at::parallel_for(0, n, 16, [&](int64_t lo, int64_t hi) { shardlm::qrows<float>(w, kq, s, xq, yp, n, b, lo, hi, exact); });
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

// The prefill products (qgemm.h) for x (..., k) float32 or bfloat16 whose k columns sit at [pad_left, pad_left + k)
// of a kp-wide weight: x copied into zero-padded float rows, then `widen`'s panels; `exact` and `wide` as above
// (`wide` sums by blocks in double, as `exact` does).
template <typename Widen>
torch::Tensor panel_product(const torch::Tensor& x_in, int64_t kp, int64_t pad_left, int64_t n, bool exact, bool wide,
                            const Widen& widen) {
  const int64_t k = x_in.size(-1);
  const auto lead = out_shape(x_in, n);
  torch::Tensor x;
  if (pad_left == 0 && kp == k) {  // no padding: float rows as they are
    x = float_rows(x_in);
  } else {
    x = torch::zeros({x_in.numel() / std::max<int64_t>(k, 1), kp}, x_in.options().dtype(torch::kFloat));
    x.narrow(1, pad_left, k).copy_(x_in.reshape({-1, k}));  // (b, kp): zeros meet the weight's zero columns
  }
  const int64_t b = x.size(0);
  if (wide) {
    auto y = torch::empty({b, n}, x.options().dtype(torch::kDouble));
    shardlm::panel_gemm<double>(x.data_ptr<float>(), b, kp, n, true, y.data_ptr<double>(), widen);  // wide: exact
    return y.view(lead);
  }
  auto y = torch::empty({b, n}, x.options());
  shardlm::panel_gemm<float>(x.data_ptr<float>(), b, kp, n, exact, y.data_ptr<float>(), widen);
  return y.view(lead).to(x_in.scalar_type());
}

// Prefill with an int8 weight: the arguments of gemv_int8, computed by dequantized panels (qgemm.h).
torch::Tensor prefill_int8(torch::Tensor x_in, torch::Tensor q, torch::Tensor scale, bool exact, bool wide) {
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == torch::kChar && q.is_contiguous(), "prefill_int8: contiguous int8 (n, kq)");
  const int64_t n = q.size(0), k = x_in.size(-1), kq = q.size(1);
  TORCH_CHECK(kq == (k + shardlm::QBLOCK - 1) / shardlm::QBLOCK * shardlm::QBLOCK && scale.numel() == n,
              "prefill_int8: shapes (..., k), (n, k rounded up to 32), (n,) expected; got k = ", k, ", codes ",
              q.sizes(), ", ", scale.numel(), " scales");
  const auto scale32 = scale.to(torch::kFloat).contiguous();
  const int8_t* w = q.data_ptr<int8_t>();
  const float* s = scale32.data_ptr<float>();
  return panel_product(x_in, kq, 0, n, exact, wide,
                       [&](int64_t r0, float* out) { shardlm::widen_panel_int8(w, kq, s, n, r0, out); });
}

// Prefill with an int4 weight: the arguments of gemm_int4, computed by dequantized panels (qgemm.h).
torch::Tensor prefill_int4(torch::Tensor x_in, torch::Tensor codes, torch::Tensor sz, int64_t pad_left, int64_t n,
                           bool exact, bool wide) {
  const shardlm::Int4Tiles w = shardlm::int4_tiles(codes, sz, n, x_in.size(-1), pad_left, "prefill_int4");
  return panel_product(x_in, w.groups * shardlm::QBLOCK, pad_left, n, exact, wide,
                       [&](int64_t r0, float* out) { shardlm::widen_panel_int4(w, r0, out); });
}

// Prefill with a float32 or bfloat16 weight (n, k): x (..., k) -> (..., n) in x's dtype, each output one FMA chain
// over k in order, whatever the rows around it: passes of up to `few_rows` rows read the weight in place
// (fewrows.h), larger ones through widened panels (qgemm.h); both give the same bits.
template <typename W>
torch::Tensor prefill_float_t(const torch::Tensor& x_in, const torch::Tensor& w, int64_t few_rows) {
  const int64_t n = w.size(0), k = w.size(1), kp = (k + 7) / 8 * 8;
  const W* wp = shardlm::data<W>(w);
  if (x_in.numel() / std::max<int64_t>(k, 1) > few_rows)
    return panel_product(x_in, kp, 0, n, false, false,
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

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("gemv", &gemv, "decode matrix-vector product");
  m.def("argmax_rows", &argmax_rows, "each row's argmax, as torch.argmax(dim=-1)", py::arg("logits"));
  m.def("gemv_int8", &gemv_int8, "matrix product with int8 weights and per-row scales (wide: float64 out)",
        py::arg("x"), py::arg("q"), py::arg("scale"), py::arg("exact") = false, py::arg("wide") = false);
  m.def("gemm_int4", &gemm_int4, "matrix product with int4 weights in groups of 32 (wide: float64 out)",
        py::arg("x"), py::arg("codes"), py::arg("sz"), py::arg("pad_left"), py::arg("n"), py::arg("exact") = false,
        py::arg("wide") = false);
  m.def("prefill_float", &prefill_float, "many-row product with float32 or bfloat16 weights (in place for a few rows, "
        "else through panels)", py::arg("x"), py::arg("w"), py::arg("few_rows") = shardlm::FEW_ROWS);
  m.def("prefill_int8", &prefill_int8, "many-row product with int8 weights through dequantized panels",
        py::arg("x"), py::arg("q"), py::arg("scale"), py::arg("exact") = false, py::arg("wide") = false);
  m.def("prefill_int4", &prefill_int4, "many-row product with int4 weights through dequantized panels",
        py::arg("x"), py::arg("codes"), py::arg("sz"), py::arg("pad_left"), py::arg("n"), py::arg("exact") = false,
        py::arg("wide") = false);
  m.def("int8_units", &shardlm::int8_units, "the instructions the int8 dot products use on this build");
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
}
