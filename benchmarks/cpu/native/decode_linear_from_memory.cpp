// One SmolLM2 decode step's linears (30 layers of q, k, v, o, gate, up, down, then the
// 49,152-row vocabulary projection: more than the caches hold, as in a real step) through
// backend/native/decode_linear.cpp (KERNEL_SOURCE: the file to include), bf16 activations, one
// thread, in each weight format a program stores: bf16, int8 (a bf16 scale per row) and int4
// (groups of 32, a bf16 scale per group), in turns. Built and run by benchmarks/cpu/native/run.sh.
#include KERNEL_SOURCE

#include <chrono>
#include <cstdio>
#include <random>

int main() {
  const int64_t dim = 576, hidden = 1536, kv = 192, vocab = 49152, layers = 30, group = 32;
  const int64_t shapes[][2] = {{dim, dim}, {kv, dim}, {kv, dim}, {dim, dim}, {hidden, dim}, {hidden, dim}, {dim, hidden}};
  std::mt19937 g(0);
  auto uniform = [&] { return float(g() % 1000) / 500.f - 1.f; };
  std::vector<std::pair<int64_t, int64_t>> nk;
  for (int l = 0; l < layers; ++l)
    for (const auto& s : shapes) nk.push_back({s[0], s[1]});
  nk.push_back({vocab, dim});
  std::vector<std::vector<Bf16>> dense, row_scale, group_scale;
  std::vector<std::vector<int8_t>> int8;
  std::vector<std::vector<uint8_t>> nibbles;
  double elements = 0;
  for (const auto& [n, k] : nk) {
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
    elements += double(n) * k;
  }
  std::vector<Bf16> x(hidden), y(vocab);
  for (auto& e : x) from_float(uniform(), &e);
  auto time = [&](const char* name, double bytes_per_weight, auto step) {
    step();
    const int n = 20;
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < n; ++i) step();
    const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count() / n;
    const double bytes = elements * bytes_per_weight;
    std::printf("  %-4s linears of a step (%4.0f MB): %6.2f ms, %5.1f GB/s\n", name, bytes / 1e6, ms, bytes / ms / 1e6);
  };
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
