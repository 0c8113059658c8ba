// A probe, not the shipped runtime: one-token attention that reads the KV
// history in storage order ([S, H_kv, D] rows, every head of a row at once),
// blocks of rows at a time with a vectorised softmax per block. It measures how
// much of the machine's read bandwidth a decode attention can reach on these
// shapes (benchmarks/cpu/attention_bandwidth.py), against ATen's fused kernel
// that the compiled program calls today, which walks the history head by head.
#include <torch/extension.h>

#include <algorithm>
#include <cstring>
#include <type_traits>
#include <cmath>
#include <vector>

namespace {

constexpr int kBlock = 64;  // rows per softmax block

// Widened to fp32 in place of a copy: bf16 is the top half of an fp32.
inline float widen(float x) { return x; }
inline float widen(c10::BFloat16 x) {
  uint32_t bits = uint32_t(x.x) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}
inline float widen(c10::Half x) { return float(x); }

// q: [H_kv, G, D] fp32; k, v: [S, H_kv, D] rows of any row stride, fp32/bf16/fp16.
// The head dim is a template parameter so the inner loops are fixed-length vectors.
template <typename T, int64_t dim>
void attend_rows(const float* q, const T* k, const T* v, int64_t rows, int64_t row_stride, int64_t heads,
                 int64_t groups, float scale, float* out) {
  const int64_t qn = heads * groups;
  std::vector<float> peak(qn, -INFINITY), total(qn, 0.f), acc(qn * dim, 0.f), logits(qn * kBlock);
  alignas(64) float kf[dim], vf[dim];
  for (int64_t s0 = 0; s0 < rows; s0 += kBlock) {
    const int64_t n = std::min<int64_t>(kBlock, rows - s0);
    for (int64_t j = 0; j < n; ++j) {
      const T* kr = k + (s0 + j) * row_stride;
      for (int64_t h = 0; h < heads; ++h) {
#pragma omp simd
        for (int64_t x = 0; x < dim; ++x) kf[x] = widen(kr[h * dim + x]);
        for (int64_t g = 0; g < groups; ++g) {
          const float* qq = q + (h * groups + g) * dim;
          float d = 0.f;
#pragma omp simd reduction(+ : d)
          for (int64_t x = 0; x < dim; ++x) d += qq[x] * kf[x];
          logits[(h * groups + g) * kBlock + j] = d * scale;
        }
      }
    }
    for (int64_t i = 0; i < qn; ++i) {
      float* l = logits.data() + i * kBlock;
      float m = peak[i];
      for (int64_t j = 0; j < n; ++j) m = std::max(m, l[j]);
      const float c = std::exp(peak[i] - m);
      total[i] *= c;
      for (int64_t x = 0; x < dim; ++x) acc[i * dim + x] *= c;
      peak[i] = m;
      float sum = 0.f;
#pragma omp simd reduction(+ : sum)
      for (int64_t j = 0; j < n; ++j) {
        const float e = std::exp(l[j] - m);
        l[j] = e;
        sum += e;
      }
      total[i] += sum;
    }
    for (int64_t j = 0; j < n; ++j) {
      const T* vr = v + (s0 + j) * row_stride;
      for (int64_t h = 0; h < heads; ++h) {
#pragma omp simd
        for (int64_t x = 0; x < dim; ++x) vf[x] = widen(vr[h * dim + x]);
        for (int64_t g = 0; g < groups; ++g) {
          const float p = logits[(h * groups + g) * kBlock + j];
          float* a = acc.data() + (h * groups + g) * dim;
#pragma omp simd
          for (int64_t x = 0; x < dim; ++x) a[x] += p * vf[x];
        }
      }
    }
  }
  for (int64_t i = 0; i < qn; ++i)
    for (int64_t x = 0; x < dim; ++x) out[i * dim + x] = acc[i * dim + x] / total[i];
}

// q [1, H_kv, G, D] fp32; k, v [1, S, H_kv, D] (a store's first S rows). Returns [1, H_kv, G, D].
torch::Tensor decode_attention_rows(torch::Tensor q, torch::Tensor k, torch::Tensor v, double scale) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, "expected 4-D q, k, v");
  TORCH_CHECK(k.stride(3) == 1 && k.stride(2) == k.size(3) && k.strides() == v.strides(), "rows must be dense");
  auto qc = q.contiguous();
  auto out = torch::empty_like(qc);
  const int64_t heads = k.size(2), dim = k.size(3), groups = q.size(2), rows = k.size(1);
  TORCH_CHECK(dim == 64 || dim == 128, "the probe is built for head dims 64 and 128");
  auto run = [&](auto* kd, auto* vd) {
    if (dim == 64)
      attend_rows<std::remove_const_t<std::remove_pointer_t<decltype(kd)>>, 64>(
          qc.data_ptr<float>(), kd, vd, rows, k.stride(1), heads, groups, float(scale), out.data_ptr<float>());
    else
      attend_rows<std::remove_const_t<std::remove_pointer_t<decltype(kd)>>, 128>(
          qc.data_ptr<float>(), kd, vd, rows, k.stride(1), heads, groups, float(scale), out.data_ptr<float>());
  };
  if (k.scalar_type() == at::kFloat) run(k.data_ptr<float>(), v.data_ptr<float>());
  else if (k.scalar_type() == at::kBFloat16) run(k.data_ptr<c10::BFloat16>(), v.data_ptr<c10::BFloat16>());
  else if (k.scalar_type() == at::kHalf) run(k.data_ptr<c10::Half>(), v.data_ptr<c10::Half>());
  else TORCH_CHECK(false, "the probe reads fp32, bf16 or fp16 rows");
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("decode_attention_rows", &decode_attention_rows); }
