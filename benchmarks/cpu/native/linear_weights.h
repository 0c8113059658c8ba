// Random weights of a list of [N, K] linears in each format a program stores: fp32; bf16; int8 with a bf16
// scale per output row; int4 two a byte in groups of kGroup with a bf16 scale per group. Shared by the
// linear harnesses; included after KERNEL_SOURCE (which brings Bf16 and from_float).
#pragma once

#include <cstdint>
#include <random>
#include <utility>
#include <vector>

constexpr int64_t kDim = 576, kHidden = 1536, kKv = 192, kVocab = 49152, kLayers = 30, kGroup = 32;

// One SmolLM2 layer's linears as [N, K]: q, k, v, o, gate, up, down.
inline std::vector<std::pair<int64_t, int64_t>> smollm2_layer() {
  return {{kDim, kDim}, {kKv, kDim}, {kKv, kDim}, {kDim, kDim}, {kHidden, kDim}, {kHidden, kDim}, {kDim, kHidden}};
}

struct LinearWeights {
  std::vector<std::pair<int64_t, int64_t>> nk;
  std::vector<std::vector<float>> dense32;  // the bf16 weights' values in fp32
  std::vector<std::vector<Bf16>> dense, row_scale, group_scale;
  std::vector<std::vector<int8_t>> int8;
  std::vector<std::vector<uint8_t>> nibbles;
  double elements = 0;  // weights in all
};

// Values in [-1, 1) from g.
inline float uniform(std::mt19937& g) { return float(g() % 1000) / 500.f - 1.f; }

inline LinearWeights random_weights(const std::vector<std::pair<int64_t, int64_t>>& nk, std::mt19937& g) {
  LinearWeights w;
  w.nk = nk;
  for (const auto& [n, k] : nk) {
    w.dense.emplace_back(n * k);
    for (auto& e : w.dense.back()) from_float(uniform(g), &e);
    w.dense32.emplace_back(n * k);
    for (int64_t i = 0; i < n * k; ++i) w.dense32.back()[i] = widen(w.dense.back()[i]);
    w.int8.emplace_back(n * k);
    for (auto& e : w.int8.back()) e = int8_t(g() % 255) - 127;
    w.row_scale.emplace_back(n);
    for (auto& e : w.row_scale.back()) from_float(uniform(g) / 100, &e);
    w.nibbles.emplace_back(n * k / 2);
    for (auto& e : w.nibbles.back()) e = uint8_t(g());
    w.group_scale.emplace_back(n * k / kGroup);
    for (auto& e : w.group_scale.back()) from_float(uniform(g) / 10, &e);
    w.elements += double(n) * k;
  }
  return w;
}
