// Sampling's inverse-CDF draw (runtime/sampling.py `draw`) in one pass and a part, bit for bit as its torch ops give
// it: cdf = probs.double().cumsum(-1) (float64 sums from zero, in order), target = u * cdf[-1], the first index whose
// cdf exceeds the target (searchsorted, right=True; clamped to the last index), and where that token's probability
// is 0 (a target that rounded up to the total), the row's last token of positive probability. torch's ops widened the
// whole (rows, vocab) block to float64, summed it into a second block and searched it: ~0.4 ms of a 16-row float32
// decode step of the bundled model (49 152 tokens a row, in-process profile), where this reads each row once and
// then up to its token, rows split over the threads.
#pragma once
#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>

namespace shardlm {

// The draw of one row p[0, n) at uniform u; -1 where the row's total is not finite (a NaN or an infinity: the caller
// then draws with torch's ops, whose search order such a row depends on).
inline int64_t draw_row(const float* p, int64_t n, double u) {
  double total = 0;
  for (int64_t i = 0; i < n; ++i) total += static_cast<double>(p[i]);
  if (!std::isfinite(total)) return -1;
  const double target = u * total;
  int64_t idx = n - 1;
  double cdf = 0;
  for (int64_t i = 0; i < n; ++i) {  // the cdf rises (no negative probabilities): the first above the target
    cdf += static_cast<double>(p[i]);
    if (cdf > target) {
      idx = i;
      break;
    }
  }
  if (!(p[idx] <= 0)) return idx;
  for (int64_t i = n - 1; i >= 0; --i)
    if (p[i] > 0) return i;
  return n - 1;  // no positive probability: torch's formula gives the last index
}

// out[j] = draw_row of row j of probs (b, n) at u[j], for b rows.
inline void draw_rows(const float* probs, int64_t b, int64_t n, const double* u, int64_t* out) {
  at::parallel_for(0, b, 1, [&](int64_t j0, int64_t j1) {
    for (int64_t j = j0; j < j1; ++j) out[j] = draw_row(probs + j * n, n, u[j]);
  });
}

}  // namespace shardlm
