// One SmolLM2 layer's linears (q, k, v, o, gate, up, down) for steps of 2 to 64 bf16 rows (a
// prefill chunk is 64; its remainders fewer) through backend/native/decode_linear.cpp
// (KERNEL_SOURCE: the file to include), one thread, each weight format a program stores: bf16, int8
// (a bf16 scale per row), int4 (groups of 32, a bf16 scale per group). Reports ms and GFLOP/s per
// step; the AVX-512 bf16 dot product's peak on one core is the ceiling (~230 GFLOP/s on an AMD EPYC
// Zen 4 at its clock). Built and run by benchmarks/cpu/native/run.sh.
#include KERNEL_SOURCE

#include <chrono>
#include <cstdio>
#include <random>

int main() {
  const int64_t dim = 576, hidden = 1536, kv = 192, group = 32;
  const int64_t shapes[][2] = {{dim, dim}, {kv, dim}, {kv, dim}, {dim, dim}, {hidden, dim}, {hidden, dim}, {dim, hidden}};
  std::mt19937 g(0);
  auto uniform = [&] { return float(g() % 1000) / 500.f - 1.f; };
  std::vector<std::vector<Bf16>> dense, row_scale, group_scale;
  std::vector<std::vector<int8_t>> int8;
  std::vector<std::vector<uint8_t>> nibbles;
  double macs_per_row = 0;
  for (const auto& [n, k] : shapes) {
    dense.emplace_back(n * k);
    for (auto& e : dense.back()) from_float(uniform(), &e);
    int8.emplace_back(n * k);
    for (auto& e : int8.back()) e = int8_t(g() % 255) - 127;
    row_scale.emplace_back(n);
    for (auto& e : row_scale.back()) from_float(uniform() / 100, &e);
    nibbles.emplace_back(n * k / 2);
    for (auto& e : nibbles.back()) e = uint8_t(g());
    group_scale.emplace_back(n * k / group);
    for (auto& e : group_scale.back()) from_float(uniform() / 10, &e);
    macs_per_row += double(n) * k;
  }
  const int64_t max_rows = 64;
  std::vector<Bf16> x(max_rows * hidden), y(max_rows * hidden);
  for (auto& e : x) from_float(uniform(), &e);
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
        linear_rows(x.data(), shapes[i][1], 1, rows, shapes[i][1], shapes[i][0], 0,
                    Dense<Bf16>{dense[i].data(), shapes[i][1]}, y.data());
    });
    time("int8", [&] {
      for (size_t i = 0; i < 7; ++i)
        linear_rows(x.data(), shapes[i][1], 1, rows, shapes[i][1], shapes[i][0], 0,
                    Int8Rows<Bf16>{{int8[i].data(), shapes[i][1]}, row_scale[i].data()}, y.data());
    });
    time("int4", [&] {
      for (size_t i = 0; i < 7; ++i)
        linear_rows(x.data(), shapes[i][1], 1, rows, shapes[i][1], shapes[i][0], group,
                    Int4Groups<Bf16>{nibbles[i].data(), group_scale[i].data(), nullptr, shapes[i][1] / group, group / 2},
                    y.data());
    });
  }
  return 0;
}
