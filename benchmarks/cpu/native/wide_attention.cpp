// One SmolLM2 layer's attention for a 64-token prefill chunk (3 KV heads x 64, 3 queries a head per
// token, bf16 rows, lower-right causal) at 64-2,000 stored rows, through the kernel of
// backend/native/rows_attention.cpp (KERNEL_SOURCE: the file to include): its wide path.
// Built and run by benchmarks/cpu/native/run.sh.
#include KERNEL_SOURCE

#include <chrono>
#include <cstdio>
#include <random>

int main() {
  const int64_t heads = 3, t = 64, r = 3 * t, d = 64;
  for (int64_t rows : {64, 256, 512, 1024, 2000}) {
    std::mt19937 g(0);
    std::vector<Bf16> K(rows * heads * d), V(rows * heads * d);
    for (auto& e : K) offgraph_kv_native::from_float(float(g() % 1000) / 500.f - 1.f, &e);
    for (auto& e : V) offgraph_kv_native::from_float(float(g() % 1000) / 500.f - 1.f, &e);
    std::vector<float> q(heads * r * d), out(heads * r * d), lse(heads * r);
    for (auto& e : q) e = float(g() % 1000) / 500.f - 1.f;
    Rows<Bf16> kr{K.data(), heads * d, d}, vr{V.data(), heads * d, d};
    auto step = [&] {
      attend_rows<Bf16>(q.data(), r * d, d, heads, r, d, d, kr, vr, Visible{t, rows}, 0.125f, out.data(), lse.data());
    };
    step();
    const int n = 100;
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < n; ++i) step();
    const double us = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count() / n;
    // Query-key pairs the mask keeps, two FMAs' flops each (q.k and p*v) per head element.
    const double pairs = double(heads) * r * (rows - t) + double(heads) * 3 * t * (t + 1) / 2;
    std::printf("64-token step over %5ld rows: %8.1f us, %.1f GFLOP/s\n", long(rows), us, pairs * d * 4 / us / 1e3);
  }
  return 0;
}
