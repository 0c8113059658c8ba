// One SmolLM2 decode step's attention (30 layers, 3 KV heads x 64, 3 queries a head) with every
// layer's K and V in memory of its own, through the kernel of backend/native/rows_attention.cpp
// (KERNEL_SOURCE: the file to include), for bf16 and fp32 rows. A real step streams ~76-538 MB of
// weights between two layers' attention, so its rows come from memory at any context: where one
// step's rows fit the caches (200 rows: 4.6 MB of bf16), the steps take turns over enough copies
// (64 MB or more in all) that each finds its rows evicted. Built and run by
// benchmarks/cpu/native/run.sh; argument: the rows (default 2,000).
#include KERNEL_SOURCE

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <random>

constexpr int64_t kHeads = 3, kQueries = 3, kDim = 64, kLayers = 30;
constexpr double kEvictBytes = 64e6;  // above this machine's L3 (32 MB)

template <typename T>
void run(const char* name, int64_t rows) {
  std::mt19937 g(0);
  const double step_bytes = 2.0 * kLayers * rows * kHeads * kDim * sizeof(T);
  const int64_t copies = std::max<int64_t>(1, int64_t(kEvictBytes / step_bytes + 1));
  std::vector<std::vector<T>> K(kLayers * copies), V(kLayers * copies);
  for (auto* kv : {&K, &V})
    for (auto& layer : *kv) {
      layer.resize(rows * kHeads * kDim);
      for (auto& e : layer) offgraph_kv_native::from_float(float(g() % 1000) / 500.f - 1.f, &e);
    }
  std::vector<float> q(kHeads * kQueries * kDim), out(q.size()), lse(kHeads * kQueries);
  for (auto& e : q) e = float(g() % 1000) / 500.f - 1.f;
  auto step = [&](int64_t copy) {
    for (int64_t l = 0; l < kLayers; ++l) {
      const int64_t at = copy * kLayers + l;
      Rows<T> kr{K[at].data(), kHeads * kDim, kDim}, vr{V[at].data(), kHeads * kDim, kDim};
      attend<T, 64, 64>(q.data(), kQueries * kDim, kDim, kHeads, kQueries, kDim, kDim, kr, vr, rows, 0.125f,
                        out.data(), lse.data());
    }
  };
  for (int64_t c = 0; c < copies; ++c) step(c);
  const int n = 100;
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < n; ++i) step(i % copies);
  const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count() / n;
  std::printf("attention %s, 30 layers x %ld rows (%.1f MB, %ld copies): %.3f ms a step, %.1f GB/s\n", name,
              long(rows), step_bytes / 1e6, long(copies), ms, step_bytes / ms / 1e6);
}

int main(int argc, char** argv) {
  const int64_t rows = argc > 1 ? std::atoll(argv[1]) : 2000;
  run<Bf16>("bf16", rows);
  run<float>("fp32", rows);
  return 0;
}
