// One SmolLM2 layer's linears (q, k, v, o, gate, up, down) for steps of 2 to 64 bf16 rows (a
// prefill chunk is 64; its remainders fewer) through backend/native/decode_linear.cpp
// (KERNEL_SOURCE: the file to include), one thread, each weight format a program stores: bf16, int8
// (a bf16 scale per row), int4 (groups of 32, a bf16 scale per group). Reports ms and GFLOP/s per
// step; the AVX-512 bf16 dot product's peak on one core is the ceiling (~230 GFLOP/s on an AMD EPYC
// Zen 4 at its clock). Built and run by benchmarks/cpu/native/run.sh.
#include KERNEL_SOURCE

#include "linear_weights.h"

#include <chrono>
#include <cstdio>
#include <random>

int main() {
  std::mt19937 g(0);
  const LinearWeights w = random_weights(smollm2_layer(), g);
  const int64_t hidden = kHidden, group = kGroup;
  const double macs_per_row = w.elements;
  const int64_t max_rows = 64;
  std::vector<Bf16> x(max_rows * hidden), y(max_rows * hidden);
  for (auto& e : x) from_float(uniform(g), &e);
  for (int64_t rows : {2, 4, 8, 16, 32, 64}) {
    auto time = [&](const char* name, auto step) {
      step();
      double best = 1e30;
      for (int i = 0; i < 7; ++i) {
        const auto t0 = std::chrono::steady_clock::now();
        step();
        best = std::min(best, std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
      }
      std::printf("  %2ld rows %-4s: %7.3f ms, %6.1f GFLOP/s\n", long(rows), name, best, 2 * macs_per_row * rows / best / 1e6);
    };
    time("bf16", [&] {
      for (size_t i = 0; i < 7; ++i)
        linear_rows(x.data(), w.nk[i].second, 1, rows, w.nk[i].second, w.nk[i].first, 0,
                    Dense<Bf16>{w.dense[i].data(), w.nk[i].second}, y.data());
    });
    time("int8", [&] {
      for (size_t i = 0; i < 7; ++i)
        linear_rows(x.data(), w.nk[i].second, 1, rows, w.nk[i].second, w.nk[i].first, 0,
                    Int8Rows<Bf16>{{w.int8[i].data(), w.nk[i].second}, w.row_scale[i].data()}, y.data());
    });
    time("int4", [&] {
      for (size_t i = 0; i < 7; ++i)
        linear_rows(x.data(), w.nk[i].second, 1, rows, w.nk[i].second, w.nk[i].first, group,
                    Int4Groups<Bf16>{w.nibbles[i].data(), w.group_scale[i].data(), nullptr, w.nk[i].second / group, group / 2},
                    y.data());
    });
  }
  return 0;
}
