// The dynamic-activation linears (backend/native/dynamic_linear.cpp, KERNEL_SOURCE:
// the file to include) on SmolLM2's shapes, bf16 activations, one thread: one row
// (decode) with the weights in cache, the 49,152-output projection, and 64 rows
// (a prefill chunk). Built and run by benchmarks/cpu/native/run.sh.
#include KERNEL_SOURCE

#include <chrono>
#include <cstdio>
#include <random>

template <typename F>
double time_us(F&& f, int n) {
  f();
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < n; ++i) f();
  return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count() / n;
}

int main() {
  if (const char* h = std::getenv("HELPERS")) offgraph_kv_native::step_helpers = std::atoi(h);  // shared_rows.h
  std::mt19937 g(0);
  const int64_t shapes[][3] = {{1536, 576, 1}, {576, 1536, 1}, {49152, 576, 1}, {1536, 576, 64}};
  for (const auto& sh : shapes) {
    const int64_t n = sh[0], k = sh[1], rows = sh[2], blocks = n / 16, groups = k / 32;
    std::vector<uint8_t> p4(blocks * (k / 8) * 64);
    std::vector<int8_t> p8(blocks * (k / 4) * 64);
    for (auto& b : p4) b = uint8_t(g());
    for (auto& b : p8) b = int8_t(g());
    std::vector<Bf16> s4(blocks * groups * 16), s8(n), x(rows * k), y(rows * n);
    for (auto& s : s4) from_float(0.01f, &s);
    for (auto& s : s8) from_float(0.01f, &s);
    for (auto& v : x) from_float(float(g() % 1000) / 300.f - 1.f, &v);
    std::vector<float> rowsum(n, 0.1f);
    std::vector<int32_t> wsum(n, 3);
    const Int4Tiles<Bf16> w4{p4.data(), s4.data(), rowsum.data(), k, groups, 32};
    const Int8Tiles<Bf16> w8{p8.data(), s8.data(), wsum.data(), k, n};
    const int reps = rows > 1 ? 20 : 300;
    const double t4 = time_us([&] { linear(x.data(), k, 1, rows, n, 32, false, w4, y.data()); }, reps);
    const double t8 = time_us([&] { linear(x.data(), k, 1, rows, n, k, true, w8, y.data()); }, reps);
    std::printf("N=%5ld K=%4ld rows=%2ld: int4 %7.1f us (%5.1f Gmac/s), int8 %7.1f us (%5.1f Gmac/s)\n", long(n),
                long(k), long(rows), t4, n * k * rows / t4 / 1e3, t8, n * k * rows / t8 / 1e3);
  }
  return 0;
}
