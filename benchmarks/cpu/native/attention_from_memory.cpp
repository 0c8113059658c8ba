// One SmolLM2 decode step's attention (30 layers, 3 KV heads x 64, 3 queries a head,
// bf16 rows) with every layer's K and V in memory of its own (46 MB at 2,000 rows:
// more than the caches hold, as in a real step), through the kernel of
// backend/native/decode_attention.cpp (KERNEL_SOURCE: the file to include).
// Built and run by benchmarks/cpu/native/run.sh.
#include KERNEL_SOURCE

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <random>

int main(int argc, char** argv) {
  const int64_t heads = 3, r = 3, d = 64, layers = 30;
  const int64_t rows = argc > 1 ? std::atoll(argv[1]) : 2000;
  std::mt19937 g(0);
  std::vector<std::vector<Bf16>> K(layers), V(layers);
  for (int l = 0; l < layers; ++l) {
    K[l].resize(rows * heads * d);
    V[l].resize(rows * heads * d);
    for (auto& e : K[l]) offgraph_kv_native::from_float(float(g() % 1000) / 500.f - 1.f, &e);
    for (auto& e : V[l]) offgraph_kv_native::from_float(float(g() % 1000) / 500.f - 1.f, &e);
  }
  std::vector<float> q(heads * r * d), out(heads * r * d), lse(heads * r);
  for (auto& e : q) e = float(g() % 1000) / 500.f - 1.f;
  auto step = [&] {
    for (int l = 0; l < layers; ++l) {
      Rows<Bf16> kr{K[l].data(), heads * d, d}, vr{V[l].data(), heads * d, d};
      attend<Bf16, 64, 64>(q.data(), r * d, d, heads, r, d, d, kr, vr, rows, 0.125f, out.data(), lse.data());
    }
  };
  step();
  const int n = 100;
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < n; ++i) step();
  const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count() / n;
  std::printf("attention, 30 layers x %ld rows (%.0f MB): %.2f ms a step, %.1f GB/s\n", long(rows),
              layers * rows * heads * d * 4 / 1e6, ms, layers * rows * heads * d * 4 / ms / 1e6);
  return 0;
}
