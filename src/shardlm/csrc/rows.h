// Row-streaming helpers shared by the decode kernels: dot products over contiguous float rows.
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>

namespace shardlm {

inline float bf16_to_float(uint16_t v) {
  uint32_t bits = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

template <typename W>
inline float load(const W* p, int64_t i);
template <>
inline float load<float>(const float* p, int64_t i) { return p[i]; }
template <>
inline float load<uint16_t>(const uint16_t* p, int64_t i) { return bf16_to_float(p[i]); }

// sum_i w[i] * x[i] over k elements, accumulated in float32.
template <typename W>
inline float dot(const W* w, const float* x, int64_t k) {
  float acc = 0.f;
#pragma omp simd reduction(+ : acc)
  for (int64_t i = 0; i < k; ++i) acc += load<W>(w, i) * x[i];
  return acc;
}

// y[j, r] = dot(w[r, :], x[j, :]) for rows r in [lo, hi) and the b rows j of x (y has n columns).
template <typename W>
void rows(const W* w, const float* x, float* y, int64_t n, int64_t k, int64_t b, int64_t lo, int64_t hi) {
  for (int64_t r = lo; r < hi; ++r) {
    const W* row = w + r * k;
    for (int64_t j = 0; j < b; ++j) y[j * n + r] = dot<W>(row, x + j * k, k);
  }
}

// out[j, :] = weight * (x[j, :] / sqrt(mean(x[j, :]^2) + eps)) for b rows of d elements.
inline void rms_norm_rows(const float* x, const float* weight, float eps, float* out, int64_t b, int64_t d) {
  for (int64_t j = 0; j < b; ++j) {
    const float* xj = x + j * d;
    float ss = 0.f;
#pragma omp simd reduction(+ : ss)
    for (int64_t i = 0; i < d; ++i) ss += xj[i] * xj[i];
    const float r = 1.f / std::sqrt(ss / static_cast<float>(d) + eps);
    float* oj = out + j * d;
    for (int64_t i = 0; i < d; ++i) oj[i] = weight[i] * (xj[i] * r);
  }
}

}  // namespace shardlm
