// One SmolLM2 decode step's linears (30 layers of q, k, v, o, gate, up, down, then the
// 49,152-row vocabulary projection: more than the caches hold, as in a real step) through
// backend/native/decode_linear.cpp (KERNEL_SOURCE: the file to include), one thread, in each weight
// format a program stores: fp32 (fp32 activations), bf16, int8 (a bf16 scale per row) and int4
// (groups of 32, a bf16 scale per group; these three with bf16 activations), in turns. Each is
// beside the floor: the same bytes read once in order (fp32 and bf16 weights summed as integers).
// HELPERS=n shares the rows with n helper threads (shared_rows.h), as a decode step does. Built and
// run by benchmarks/cpu/native/run.sh.
#include KERNEL_SOURCE

#include "linear_weights.h"

#include <chrono>
#include <cstdio>
#include <random>

int main() {
  if (const char* h = std::getenv("HELPERS")) offgraph_kv_native::step_helpers = std::atoi(h);  // shared_rows.h
  std::mt19937 g(0);
  std::vector<std::pair<int64_t, int64_t>> shapes;
  for (int l = 0; l < kLayers; ++l)
    for (const auto& s : smollm2_layer()) shapes.push_back(s);
  shapes.push_back({kVocab, kDim});
  const LinearWeights w = random_weights(shapes, g);
  const auto& nk = w.nk;
  const auto& dense = w.dense;
  const auto& int8 = w.int8;
  const auto& row_scale = w.row_scale;
  const auto& nibbles = w.nibbles;
  const auto& group_scale = w.group_scale;
  const double elements = w.elements;
  const int64_t group = kGroup;
  std::vector<Bf16> x(kHidden), y(kVocab);
  for (auto& e : x) from_float(uniform(g), &e);
  std::vector<float> x32(kHidden), y32(kVocab);
  for (size_t i = 0; i < x.size(); ++i) x32[i] = widen(x[i]);
  const auto& dense32 = w.dense32;
  auto time = [&](const char* name, double bytes_per_weight, auto step) {
    step();
    const int n = 20;
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < n; ++i) step();
    const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count() / n;
    const double bytes = elements * bytes_per_weight;
    std::printf("  %-4s linears of a step (%4.0f MB): %6.2f ms, %5.1f GB/s\n", name, bytes / 1e6, ms, bytes / ms / 1e6);
  };
  // The floor: every byte of the fp32 (then bf16) weights once, in order, summed as 32-bit integers
  // (the compiler vectorizes the sum; `sink` keeps it).
  volatile uint32_t sink = 0;
  auto read = [&](const auto& weights) {
    uint32_t s = 0;
    for (const auto& v : weights) {
      const auto* u = reinterpret_cast<const uint32_t*>(v.data());
      const size_t words = v.size() * sizeof(v[0]) / 4;
      for (size_t i = 0; i < words; ++i) s += u[i];
    }
    sink = sink + s;
  };
  time("read", 4.0, [&] { read(dense32); });
  time("fp32", 4.0, [&] {
    for (size_t i = 0; i < nk.size(); ++i)
      linear_rows(x32.data(), nk[i].second, 1, 1, nk[i].second, nk[i].first, 0,
                  Dense<float>{dense32[i].data(), nk[i].second}, y32.data());
  });
  time("read", 2.0, [&] { read(dense); });
  time("bf16", 2.0, [&] {
    for (size_t i = 0; i < nk.size(); ++i)
      linear_rows(x.data(), nk[i].second, 1, 1, nk[i].second, nk[i].first, 0,
                  Dense<Bf16>{dense[i].data(), nk[i].second}, y.data());
  });
  time("int8", 1.0, [&] {
    for (size_t i = 0; i < nk.size(); ++i)
      linear_rows(x.data(), nk[i].second, 1, 1, nk[i].second, nk[i].first, 0,
                  Int8Rows<Bf16>{{int8[i].data(), nk[i].second}, row_scale[i].data()}, y.data());
  });
  time("int4", 0.5 + 2.0 / group, [&] {
    for (size_t i = 0; i < nk.size(); ++i) {
      const int64_t groups = nk[i].second / group;
      linear_rows(x.data(), nk[i].second, 1, 1, nk[i].second, nk[i].first, group,
                  Int4Groups<Bf16>{nibbles[i].data(), group_scale[i].data(), nullptr, groups, group / 2}, y.data());
    }
  });
  return 0;
}
