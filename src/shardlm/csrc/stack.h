// Every block of a one-rank model in one call per decode step.
//
// The fused halves (decode.h) cut a block to two calls, but a step still crossed from Python into C++ 60 times
// for the bundled model's 30 blocks, each call converting its lists of weights and optional biases and the
// Python around it (the block's module call, argument checks, reshapes) running in between: `perf` put about a
// third of an int4 batch-1 step there. A DecodeStack is built once per rank with each block's weights (they never
// change on a rank where nothing streams), checked then; `step` takes the layers' KV caches at each call (so the
// stack holds no cache past its run) and runs every block in one parallel region (StackStep, stack_step.h): the
// same arithmetic per value as the fused halves, in the same order, with the residual added inside (one rank:
// nothing to all-reduce), so its output is the per-block path's bit for bit.
#pragma once
#include <torch/extension.h>

#include <optional>
#include <utility>
#include <vector>

#include "decode.h"
#include "stack_step.h"

namespace shardlm {

class DecodeStack {
 public:
  // weights[i]: block i's seven weights (q, k, v, o, gate, up, down), with scales and int4 (pad_left, rows) as
  // the fused halves take them; biases[i]: its seven optional biases in the same order; norms[i]: (input norm,
  // post-attention norm); eps[i]: their epsilons.
  DecodeStack(const std::vector<std::vector<torch::Tensor>>& weights,
              const std::vector<std::optional<std::vector<torch::Tensor>>>& scales,
              const std::vector<std::optional<std::vector<std::pair<int64_t, int64_t>>>>& pads,
              const std::vector<std::vector<std::optional<torch::Tensor>>>& biases,
              const std::vector<std::pair<torch::Tensor, torch::Tensor>>& norms,
              const std::vector<std::pair<double, double>>& eps, const std::vector<torch::Tensor>& kv_maps) {
    const size_t n = weights.size();
    TORCH_CHECK(scales.size() == n && pads.size() == n && biases.size() == n && norms.size() == n && eps.size() == n &&
                    kv_maps.size() == n,
                "decode stack: ", n, " blocks of weights but other lists of another length");
    for (size_t i = 0; i < n; ++i) {
      TORCH_CHECK(weights[i].size() == 7 && biases[i].size() == 7, "decode stack: block ", i,
                  " needs 7 weights and 7 biases, got ", weights[i].size(), " and ", biases[i].size());
      StackBlock b;
      Linear* ls[7] = {&b.q, &b.k, &b.v, &b.o, &b.gate, &b.up, &b.down};
      for (size_t j = 0; j < 7; ++j) *ls[j] = linear_of(weights[i], scales[i], pads[i], j);
      b.ln1 = norms[i].first;
      b.ln2 = norms[i].second;
      b.eps1 = static_cast<float>(eps[i].first);
      b.eps2 = static_cast<float>(eps[i].second);
      b.kv_map = kv_maps[i];
      check_block(b, biases[i], i);
      blocks_.push_back(std::move(b));
    }
  }

  // x (b, dim) through every block for one new token per row; cos/sin (b, hd), rows and positions (b,) int64,
  // mask (b, t) bool as the fused attention half takes them; caches[i]: block i's (keys, values), written at each
  // row's position. Returns (b, dim) in x's dtype.
  torch::Tensor step(torch::Tensor x, torch::Tensor cos, torch::Tensor sin, torch::Tensor rows,
                     torch::Tensor positions, torch::Tensor mask,
                     const std::vector<std::pair<torch::Tensor, torch::Tensor>>& caches) const {
    TORCH_CHECK(caches.size() == blocks_.size(), "decode stack: ", blocks_.size(), " blocks but ", caches.size(),
                " caches");
    TORCH_CHECK(!blocks_.empty(), "decode stack: no blocks");
    const int64_t threads = at::in_parallel_region() ? 1 : at::get_num_threads();
    if (float_model(x))
      return StackStep<float>(blocks_, x, cos, sin, rows, positions, mask, caches, threads).run();
    return StackStep<uint16_t>(blocks_, x, cos, sin, rows, positions, mask, caches, threads).run();
  }

  int64_t size() const { return static_cast<int64_t>(blocks_.size()); }

 private:
  // The block's weights, norms and biases checked once (they do not change), the norms and biases kept in float32.
  static void check_block(StackBlock& b, const std::vector<std::optional<torch::Tensor>>& biases, size_t i) {
    const auto dtype = b.ln1.scalar_type();
    TORCH_CHECK(dtype == torch::kFloat || dtype == torch::kBFloat16, "decode stack: block ", i,
                " norm weights must be float32 or bfloat16, got ", dtype);
    check(b.ln1, dtype, "norm weight");
    check(b.ln2, dtype, "norm weight");
    const int64_t dim = b.ln1.numel(), nq = b.q.out_rows(), nk = b.k.out_rows(), inter = b.gate.out_rows();
    TORCH_CHECK(b.ln2.numel() == dim, "decode stack: block ", i, " norms of ", dim, " and ", b.ln2.numel());
    check_linear(b.q, dtype, "q weight", nq, dim);
    check_linear(b.k, dtype, "k weight", nk, dim);
    check_linear(b.v, dtype, "v weight", nk, dim);
    check_linear(b.o, dtype, "o weight", dim, nq);
    check_linear(b.gate, dtype, "gate weight", inter, dim);
    check_linear(b.up, dtype, "up weight", inter, dim);
    check_linear(b.down, dtype, "down weight", dim, inter);
    const bool quantized = b.q.quantized();
    for (const Linear* l : {&b.k, &b.v, &b.o, &b.gate, &b.up, &b.down})
      TORCH_CHECK(l->quantized() == quantized && l->int4() == b.q.int4(), "decode stack: block ", i,
                  " mixes quantized and float (or int8 and int4) weights");
    for (const Linear* l : {&b.q, &b.k, &b.v, &b.gate, &b.up})
      TORCH_CHECK(!l->interleaved, "decode stack: block ", i, " has interleaved int8 codes in a weight summed in "
                  "float (only the o and down projections, summed exact, take them)");
    for (const Linear* l : {&b.o, &b.down})
      TORCH_CHECK(!l->paired, "decode stack: block ", i, " has paired int8 codes in a weight summed exact (only the "
                  "weights summed in float lanes take them)");
    TORCH_CHECK(b.kv_map.scalar_type() == torch::kLong && b.kv_map.is_contiguous() && b.kv_map.dim() == 1,
                "decode stack: block ", i, " kv_map must be a contiguous (hq,) int64 tensor");
    b.ln1f = f32(b.ln1);
    b.ln2f = f32(b.ln2);
    const int64_t sizes[7] = {nq, nk, nk, dim, inter, inter, dim};
    const char* names[7] = {"q bias", "k bias", "v bias", "o bias", "gate bias", "up bias", "down bias"};
    torch::Tensor* out[7] = {&b.bq, &b.bk, &b.bv, &b.bo, &b.bg, &b.bu, &b.bd};
    for (size_t j = 0; j < 7; ++j) *out[j] = bias_f32(biases[j], sizes[j], names[j]);
  }

  std::vector<StackBlock> blocks_;
};

}  // namespace shardlm
