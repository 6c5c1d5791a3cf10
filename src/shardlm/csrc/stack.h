// Every block of a one-rank model in one call per decode step.
//
// The fused halves (decode.h) cut a block to two calls, but a step still crossed from Python into C++ 60 times
// for the bundled model's 30 blocks, each call converting its lists of weights and optional biases and the
// Python around it (the block's module call, argument checks, reshapes) running in between: `perf` put about a
// third of an int4 batch-1 step there. A DecodeStack is built once per rank with each block's weights (they never
// change on a rank where nothing streams); `step` takes the layers' KV caches at each call (so the stack holds no
// cache past its run) and runs the same two functions per block, in the same order, with the residual added inside
// (one rank: nothing to all-reduce), so its output is the per-block path's bit for bit.
#pragma once
#include <torch/extension.h>

#include <optional>
#include <utility>
#include <vector>

#include "decode.h"

namespace shardlm {

// One block's fixed tensors: norms, the seven linear weights (see Linear), biases and the query heads' KV map.
struct StackBlock {
  torch::Tensor ln1, ln2, kv_map;
  double eps1 = 0.0, eps2 = 0.0;
  Linear q, k, v, o, gate, up, down;
  std::optional<torch::Tensor> bq, bk, bv, bo, bg, bu, bd;
};

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
      std::optional<torch::Tensor>* bs[7] = {&b.bq, &b.bk, &b.bv, &b.bo, &b.bg, &b.bu, &b.bd};
      for (size_t j = 0; j < 7; ++j) *bs[j] = biases[i][j];
      b.ln1 = norms[i].first;
      b.ln2 = norms[i].second;
      b.eps1 = eps[i].first;
      b.eps2 = eps[i].second;
      b.kv_map = kv_maps[i];
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
    return float_model(x) ? run<float>(x, cos, sin, rows, positions, mask, caches)
                          : run<uint16_t>(x, cos, sin, rows, positions, mask, caches);
  }

  int64_t size() const { return static_cast<int64_t>(blocks_.size()); }

 private:
  template <typename W>
  torch::Tensor run(torch::Tensor x, const torch::Tensor& cos, const torch::Tensor& sin, const torch::Tensor& rows,
                    const torch::Tensor& positions, const torch::Tensor& mask,
                    const std::vector<std::pair<torch::Tensor, torch::Tensor>>& caches) const {
    for (size_t i = 0; i < blocks_.size(); ++i) {
      const StackBlock& b = blocks_[i];
      auto h = attn_decode_t<W>(x, b.ln1, b.eps1, b.q, b.k, b.v, b.bq, b.bk, b.bv, cos, sin, caches[i].first,
                                caches[i].second, rows, positions, b.kv_map, mask, b.o, b.bo, true);
      x = mlp_decode_t<W>(h, b.ln2, b.eps2, b.gate, b.up, b.bg, b.bu, b.down, b.bd, true);
    }
    return x;
  }

  std::vector<StackBlock> blocks_;
};

}  // namespace shardlm
