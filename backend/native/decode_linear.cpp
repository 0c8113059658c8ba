// CPU decode linears: y[r, n] = sum_k x[r, k] * W[n, k] for the few rows of a
// decode step, over weights as the .pte stores them (fp32, bf16 or fp16; int8
// with a scale per output row; int4 two values a byte with a scale, and
// optionally a zero point, per group of inputs). Compiled into each CPU
// program's shared object at export (backend/cpu_kernels.py builds it) and
// called by AOTInductor's generated code as the C shims of
// offgraph_kv::linear_rows, int8_linear_rows and int4_linear_rows.
//
// Why a kernel of our own: a decode step is ~80 % matrix-vector products, which
// only stream the weights. ATen's one-row GEMM reads them at a third to a half
// of one core's bandwidth here, and inductor's reduction needs the activations
// widened per weight format in the graph. Here each weight row streams once,
// in order, in its stored format, against fp32 activations widened once per
// call (benchmarks/cpu/gemv.py measures it against both, per shape). How many
// rows share each activation load is the ISA's (kBlockRows below).
//
// Only the stable AOTI C shim is used (no ATen headers), as rows_attention.cpp.
// Accumulation is fp32, as a GEMM's; the output takes the activations' dtype.

#include <torch/csrc/inductor/aoti_torch/c/shim.h>

#include "float16.h"
#include "linear_call.h"
#include "shim_view.h"
#include "vec.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#ifdef _OPENMP
#include <omp.h>
#endif

namespace {

using offgraph_kv_native::Bf16;
using offgraph_kv_native::Half;
using offgraph_kv_native::from_float;
using offgraph_kv_native::widen;
using namespace offgraph_kv_native::vec;

// Outputs per pass over the activations (see above): on AVX-512 (an Intel Xeon,
// 2026-12-02) four rows side by side took 0.85-0.98x one row's time, per shape;
// on the AVX2 machine (AMD EPYC) four rows read 0.75-0.85x as fast as one
// sequential stream, two 0.8x (standalone probes, interleaved runs). On an AMD
// EPYC (Zen 4) with AVX-512, the 30 layers' bf16 weights of a SmolLM2 step from
// memory took 32-36 ms four or two rows at a time and 12-17 ms one row at a
// time (`benchmarks/cpu/native/run.sh decode_linear_from_memory`): AMD's
// prefetchers lose interleaved row streams, so AMD machines read one row at a time.
#if defined(__AVX512F__)
constexpr int64_t kBlockRows = 4;
#else
constexpr int64_t kBlockRows = 1;
#endif

inline bool rows_side_by_side() {
#if defined(__AVX512F__)  // x86 only: the vendor builtins exist there
  static const bool intel = [] {
    __builtin_cpu_init();
    return __builtin_cpu_is("intel") != 0;
  }();
  return intel;
#else
  return false;
#endif
}
constexpr int64_t kOutputsPerThread = 512;  // a thread below this costs more than it reads

// ----------------------------------------------------------------------------
// The weight formats: each computes a block of B outputs' dots with one row
// of fp32 activations (xf, K values; xsum[g]: the activations' sum per int4 group)
// ----------------------------------------------------------------------------

inline float widen(int8_t q) { return float(q); }

template <typename W>
struct Dense {  // fp32 / bf16 / fp16 weights [N, K] (and int8, whose scales Int8Rows applies)
  const W* w;
  int64_t k;
  template <int B>
  void dots(int64_t n, const float* __restrict xf, const float*, float* out) const {
    int64_t x = 0;
#ifdef OFFGRAPH_KV_VECTOR
    Vec acc[B];
    for (int b = 0; b < B; ++b) acc[b] = vzero();
    for (; x + kLanes <= k; x += kLanes) {
      const Vec xv = vload(xf + x);
      for (int b = 0; b < B; ++b) acc[b] = vfma(vload(w + (n + b) * k + x), xv, acc[b]);
    }
    for (int b = 0; b < B; ++b) out[b] = vsum(acc[b]);
#else
    for (int b = 0; b < B; ++b) out[b] = 0.f;
#endif
    for (; x < k; ++x)
      for (int b = 0; b < B; ++b) out[b] += widen(w[(n + b) * k + x]) * xf[x];
  }
};

template <typename S>
struct Int8Rows {  // int8 weights [N, K], one scale per output row
  Dense<int8_t> q;
  const S* scale;
  template <int B>
  void dots(int64_t n, const float* __restrict xf, const float* xsum, float* out) const {
    q.template dots<B>(n, xf, xsum, out);
    for (int b = 0; b < B; ++b) out[b] *= widen(scale[n + b]);
  }
};

template <typename S>
struct Int4Groups {  // packed [N, K/G, G/2] uint8 (low nibble: input j, high: j + G/2), q + 8 stored
  const uint8_t* packed;
  const S* scale;       // [N, K/G]
  const int8_t* zero;   // [N, K/G] or null (symmetric)
  int64_t groups, half;
  template <int B>
  void dots(int64_t n, const float* __restrict xf, const float* __restrict xsum, float* out) const {
    float total[B] = {};
#ifdef OFFGRAPH_KV_VECTOR
    Vec acc[B];
    for (int b = 0; b < B; ++b) acc[b] = vzero();
    const bool vector_groups = half % kLanes == 0;
#else
    const bool vector_groups = false;
#endif
    for (int64_t g = 0; g < groups; ++g) {
      const float* __restrict xlo = xf + g * 2 * half;
      const float* __restrict xhi = xlo + half;
      for (int b = 0; b < B; ++b) {
        const int64_t row = n + b;
        const uint8_t* p = packed + (row * groups + g) * half;
        const float s = widen(scale[row * groups + g]);
        // The stored nibble is q + 8 and w = (q - zero) * s: the offset's share, once per group.
        const float offset = 8.f + (zero ? float(zero[row * groups + g]) : 0.f);
        total[b] -= s * offset * xsum[g];
        if (vector_groups) {
#ifdef OFFGRAPH_KV_VECTOR
          Vec t = vzero();
          for (int64_t j = 0; j < half; j += kLanes) {
            Vec lo, hi;
            vnibbles(p + j, &lo, &hi);
            t = vfma(lo, vload(xlo + j), t);
            t = vfma(hi, vload(xhi + j), t);
          }
          acc[b] = vfma(t, vset(s), acc[b]);
#endif
        } else {
          float t = 0.f;
          for (int64_t j = 0; j < half; ++j) t += float(p[j] & 15) * xlo[j] + float(p[j] >> 4) * xhi[j];
          total[b] += s * t;
        }
      }
    }
#ifdef OFFGRAPH_KV_VECTOR
    for (int b = 0; b < B; ++b) out[b] = total[b] + vsum(acc[b]);
#else
    for (int b = 0; b < B; ++b) out[b] = total[b];
#endif
  }
};

// ----------------------------------------------------------------------------
// Rows of activations in, rows of outputs out
// ----------------------------------------------------------------------------

// out[r, n] for r < rows, n < outputs: each row's activations widened to fp32
// once (and summed per int4 group), the outputs split over the threads
// OpenMP allows (the runtime sets one per decode step unless asked otherwise).
template <typename X, typename Format>
void linear_rows(const X* x, int64_t x_row, int64_t x_col, int64_t rows, int64_t k, int64_t outputs, int64_t group,
                 const Format& format, X* y) {
  std::vector<float> xf(k), xsum(group ? k / group : 0);
  int64_t parts = 1;
#ifdef _OPENMP
  parts = std::max<int64_t>(1, std::min<int64_t>(omp_get_max_threads(), outputs / kOutputsPerThread));
#endif
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t i = 0; i < k; ++i) xf[i] = widen(x[r * x_row + i * x_col]);
    for (int64_t g = 0; g < int64_t(xsum.size()); ++g) {
      float s = 0.f;
      for (int64_t i = 0; i < group; ++i) s += xf[g * group + i];
      xsum[g] = s;
    }
    X* yr = y + r * outputs;
    const int64_t per = ((outputs + parts - 1) / parts + kBlockRows - 1) / kBlockRows * kBlockRows;
#pragma omp parallel for num_threads(parts) if (parts > 1) schedule(static, 1)
    for (int64_t p = 0; p < parts; ++p) {
      const int64_t begin = std::min(outputs, p * per), end = std::min(outputs, begin + per);
      float d[kBlockRows];
      int64_t n = begin;
      const bool side_by_side = rows_side_by_side();
      for (; side_by_side && n + kBlockRows <= end; n += kBlockRows) {
        format.template dots<kBlockRows>(n, xf.data(), xsum.data(), d);
        for (int64_t b = 0; b < kBlockRows; ++b) from_float(d[b], yr + n + b);
      }
      for (; n < end; ++n) {
        format.template dots<1>(n, xf.data(), xsum.data(), d);
        from_float(d[0], yr + n);
      }
    }
  }
}

// ----------------------------------------------------------------------------
// The C boundary
// ----------------------------------------------------------------------------

using offgraph_kv_native::activations;
using offgraph_kv_native::contiguous;
using offgraph_kv_native::finish;
using offgraph_kv_native::guarded;
using offgraph_kv_native::View;
using offgraph_kv_native::view_of;
using offgraph_kv_native::with_float_type;

AOTITorchError dense_linear(AtenTensorHandle x, AtenTensorHandle w, AtenTensorHandle* ret) {
  View wv, xv;
  if (!view_of(w, 2, &wv) || !contiguous(wv)) return AOTI_TORCH_FAILURE;
  const int64_t n = wv.sizes[0], k = wv.sizes[1];
  AtenTensorHandle out = nullptr;
  void* y = nullptr;
  if (!activations(x, k, n, &xv, &out, &y)) return AOTI_TORCH_FAILURE;
  bool ok = false;
  with_float_type(xv.dtype, [&](auto xt) {
    using X = decltype(xt);
    ok = with_float_type(wv.dtype, [&](auto wt) {
      using W = decltype(wt);
      linear_rows(static_cast<const X*>(xv.data), xv.strides[0], xv.strides[1], xv.sizes[0], k, n, 0,
                  Dense<W>{static_cast<const W*>(wv.data), k}, static_cast<X*>(y));
    });
  });
  return finish(ok, out, ret);
}

AOTITorchError int8_linear(AtenTensorHandle x, AtenTensorHandle q, AtenTensorHandle scale, AtenTensorHandle* ret) {
  View qv, sv, xv;
  if (!view_of(q, 2, &qv) || !contiguous(qv) || qv.dtype != aoti_torch_dtype_int8()) return AOTI_TORCH_FAILURE;
  const int64_t n = qv.sizes[0], k = qv.sizes[1];
  if (!view_of(scale, 1, &sv) || !contiguous(sv) || sv.sizes[0] != n) return AOTI_TORCH_FAILURE;
  AtenTensorHandle out = nullptr;
  void* y = nullptr;
  if (!activations(x, k, n, &xv, &out, &y)) return AOTI_TORCH_FAILURE;
  bool ok = false;
  with_float_type(xv.dtype, [&](auto xt) {
    using X = decltype(xt);
    ok = with_float_type(sv.dtype, [&](auto st) {
      using S = decltype(st);
      linear_rows(static_cast<const X*>(xv.data), xv.strides[0], xv.strides[1], xv.sizes[0], k, n, 0,
                  Int8Rows<S>{{static_cast<const int8_t*>(qv.data), k}, static_cast<const S*>(sv.data)},
                  static_cast<X*>(y));
    });
  });
  return finish(ok, out, ret);
}

AOTITorchError int4_linear(AtenTensorHandle x, AtenTensorHandle packed, AtenTensorHandle scale,
                           AtenTensorHandle zero, AtenTensorHandle* ret) {
  View pv, sv, zv, xv;
  if (!view_of(packed, 3, &pv) || !contiguous(pv) || pv.dtype != aoti_torch_dtype_uint8()) return AOTI_TORCH_FAILURE;
  const int64_t n = pv.sizes[0], groups = pv.sizes[1], half = pv.sizes[2], k = groups * 2 * half;
  if (half < 1 || !view_of(scale, 2, &sv) || !contiguous(sv) || sv.sizes[0] != n || sv.sizes[1] != groups)
    return AOTI_TORCH_FAILURE;
  const int8_t* zp = nullptr;
  if (zero != nullptr) {
    if (!view_of(zero, 2, &zv) || !contiguous(zv) || zv.dtype != aoti_torch_dtype_int8() || zv.sizes[0] != n ||
        zv.sizes[1] != groups)
      return AOTI_TORCH_FAILURE;
    zp = static_cast<const int8_t*>(zv.data);
  }
  AtenTensorHandle out = nullptr;
  void* y = nullptr;
  if (!activations(x, k, n, &xv, &out, &y)) return AOTI_TORCH_FAILURE;
  bool ok = false;
  with_float_type(xv.dtype, [&](auto xt) {
    using X = decltype(xt);
    ok = with_float_type(sv.dtype, [&](auto st) {
      using S = decltype(st);
      linear_rows(static_cast<const X*>(xv.data), xv.strides[0], xv.strides[1], xv.sizes[0], k, n, 2 * half,
                  Int4Groups<S>{static_cast<const uint8_t*>(pv.data), static_cast<const S*>(sv.data), zp, groups,
                                half},
                  static_cast<X*>(y));
    });
  });
  return finish(ok, out, ret);
}

}  // namespace

extern "C" AOTITorchError aoti_torch_cpu_linear_rows(AtenTensorHandle x, AtenTensorHandle w, AtenTensorHandle* ret0) {
  return guarded([&] { return dense_linear(x, w, ret0); });
}

extern "C" AOTITorchError aoti_torch_cpu_int8_linear_rows(AtenTensorHandle x, AtenTensorHandle q,
                                                          AtenTensorHandle scale, AtenTensorHandle* ret0) {
  return guarded([&] { return int8_linear(x, q, scale, ret0); });
}

extern "C" AOTITorchError aoti_torch_cpu_int4_linear_rows(AtenTensorHandle x, AtenTensorHandle packed,
                                                          AtenTensorHandle scale, AtenTensorHandle* ret0) {
  return guarded([&] { return int4_linear(x, packed, scale, nullptr, ret0); });
}

extern "C" AOTITorchError aoti_torch_cpu_int4z_linear_rows(AtenTensorHandle x, AtenTensorHandle packed,
                                                           AtenTensorHandle scale, AtenTensorHandle zero,
                                                           AtenTensorHandle* ret0) {
  return guarded([&] { return int4_linear(x, packed, scale, zero, ret0); });
}
