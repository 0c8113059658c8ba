// One SmolLM2 decode step's linears (30 layers of q, k, v, o, gate, up, down, then the
// 49,152-row vocabulary projection; bf16 weights, 257 MB: more than the caches hold, as in a
// real step) through the dense kernel of backend/native/decode_linear.cpp (KERNEL_SOURCE: the
// file to include), bf16 activations, one thread. Built and run by benchmarks/cpu/native/run.sh.
#include KERNEL_SOURCE

#include <chrono>
#include <cstdio>
#include <random>

int main() {
  const int64_t dim = 576, hidden = 1536, kv = 192, vocab = 49152, layers = 30;
  const int64_t shapes[][2] = {{dim, dim}, {kv, dim}, {kv, dim}, {dim, dim}, {hidden, dim}, {hidden, dim}, {dim, hidden}};
  std::mt19937 g(0);
  std::vector<std::vector<Bf16>> w;
  std::vector<std::pair<int64_t, int64_t>> nk;
  for (int l = 0; l < layers; ++l)
    for (const auto& s : shapes) nk.push_back({s[0], s[1]});
  nk.push_back({vocab, dim});
  double bytes = 0;
  for (const auto& [n, k] : nk) {
    w.emplace_back(n * k);
    for (auto& e : w.back()) from_float(float(g() % 1000) / 500.f - 1.f, &e);
    bytes += 2.0 * n * k;
  }
  std::vector<Bf16> x(hidden), y(vocab);
  for (auto& e : x) from_float(float(g() % 1000) / 500.f - 1.f, &e);
  auto step = [&] {
    for (size_t i = 0; i < nk.size(); ++i)
      linear_rows(x.data(), nk[i].second, 1, 1, nk[i].second, nk[i].first, 0, Dense<Bf16>{w[i].data(), nk[i].second},
                  y.data());
  };
  step();
  const int n = 20;
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < n; ++i) step();
  const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count() / n;
  std::printf("bf16 linears of a step (%.0f MB): %.2f ms, %.1f GB/s\n", bytes / 1e6, ms, bytes / ms / 1e6);
  return 0;
}
