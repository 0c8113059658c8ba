// CPU decode attention over the store as it lies in memory, compiled into
// each CPU program's shared object at export (backend/cpu_kernels.py builds it) and
// called by AOTInductor's generated code as the C shim of
// offgraph_kv::rows_attend_with_lse.
//
// Why a kernel of our own: the store keeps K and V as [S, H_kv, D] rows. ATen's
// fused CPU attention walks that history head by head (each head's D elements
// H_kv * D apart) and runs GEMM machinery on a decode step's few query rows;
// inductor's reductions over 16-bit rows vectorise poorly. Reading each stored
// row once, every head of it together, with a blocked online softmax, takes
// 0.75x ATen's time in fp32 and 0.39x the reductions' in bf16 at 2,000 rows
// (benchmarks/results/cpu_attention_bandwidth.md).
//
// Only the stable AOTI C shim is used (no ATen headers): the object is built
// in seconds and links into the program like inductor's own kernels.

#include <torch/csrc/inductor/aoti_torch/c/shim.h>

#include "float16.h"
#include "shim_view.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#ifdef __AVX512F__
#include <immintrin.h>
#endif

#ifdef _OPENMP
#include <omp.h>
#endif

namespace {

constexpr int64_t kBlock = 64;           // rows per softmax block
constexpr int64_t kRowsPerThread = 512;  // a thread below this costs more than it reads

using offgraph_kv_native::Bf16;
using offgraph_kv_native::Half;
using offgraph_kv_native::widen;

// n stored elements widened into dst. The 16-bit rows go 16 at a time through
// the ISA's conversions where the program's ISA has them (AVX-512: vcvtph2ps,
// and bf16 as a shift); the compiler does not vectorise the scalar forms.
template <typename T>
inline void widen_row(const T* __restrict src, float* __restrict dst, int64_t n) {
  int64_t x = 0;
#ifdef __AVX512F__
  if constexpr (std::is_same_v<T, Bf16>) {
    for (; x + 16 <= n; x += 16) {
      const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + x)));
      _mm512_storeu_ps(dst + x, _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16)));
    }
  } else if constexpr (std::is_same_v<T, Half>) {
    for (; x + 16 <= n; x += 16)
      _mm512_storeu_ps(dst + x, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + x))));
  }
#endif
#pragma omp simd
  for (int64_t i = x; i < n; ++i) dst[i] = widen(src[i]);
}

// One head's row as fp32: fp32 rows are read in place, 16-bit ones widened into scratch.
template <typename T>
inline const float* row_as_float(const T* src, float* scratch, int64_t n) {
  if constexpr (std::is_same_v<T, float>) {
    return src;
  } else {
    widen_row(src, scratch, n);
    return scratch;
  }
}

// Where one operand's rows lie: element (row s, head h, x) at base[s*row + h*head + x].
template <typename T>
struct Rows {
  const T* base;
  int64_t row, head;
};

// One query's running softmax over the rows seen so far (unnormalised).
struct Partial {
  std::vector<float> peak, total, acc;
  Partial(int64_t queries, int64_t vd) : peak(queries, -INFINITY), total(queries, 0.f), acc(queries * vd, 0.f) {}
};

// Rows [begin, end) of every head into `part`. Queries are [H_kv, R, kd] at q
// (head stride q_head, row stride q_row, elements dense). KD / VD fix the head
// dims at compile time (0: read kd / vd), so the common ones are fixed-length loops.
template <typename T, int64_t KD, int64_t VD>
void attend_span(const float* q, int64_t q_head, int64_t q_row, int64_t heads, int64_t r, int64_t kd_rt,
                 int64_t vd_rt, Rows<T> k, Rows<T> v, int64_t begin, int64_t end, float scale, Partial& part) {
  const int64_t kd = KD ? KD : kd_rt, vd = VD ? VD : vd_rt, queries = heads * r;
  std::vector<float> logits(queries * kBlock), k_any(KD ? 0 : kd), v_any(VD ? 0 : vd);
  // One widened row of one head; on the stack where the head dim is fixed.
  alignas(64) float k_fixed[KD ? KD : 1], v_fixed[VD ? VD : 1];
  float* __restrict kf = KD ? k_fixed : k_any.data();
  float* __restrict vf = VD ? v_fixed : v_any.data();
  for (int64_t s0 = begin; s0 < end; s0 += kBlock) {
    const int64_t n = std::min(kBlock, end - s0);
    for (int64_t j = 0; j < n; ++j) {
      for (int64_t h = 0; h < heads; ++h) {
        const float* __restrict kr = row_as_float(k.base + (s0 + j) * k.row + h * k.head, kf, kd);
        for (int64_t g = 0; g < r; ++g) {
          const float* __restrict qq = q + h * q_head + g * q_row;
          float d = 0.f;
#pragma omp simd reduction(+ : d)
          for (int64_t x = 0; x < kd; ++x) d += qq[x] * kr[x];
          logits[(h * r + g) * kBlock + j] = d * scale;
        }
      }
    }
    for (int64_t i = 0; i < queries; ++i) {
      float* l = logits.data() + i * kBlock;
      float m = part.peak[i];
      for (int64_t j = 0; j < n; ++j) m = std::max(m, l[j]);
      // A row of -inf logits (a query that sees nothing yet) keeps weight 0, not NaN.
      const float rescale = part.peak[i] == -INFINITY ? 0.f : std::exp(part.peak[i] - m);
      part.total[i] *= rescale;
      float* a = part.acc.data() + i * vd;
      for (int64_t x = 0; x < vd; ++x) a[x] *= rescale;
      part.peak[i] = m;
      float sum = 0.f;
      for (int64_t j = 0; j < n; ++j) {
        const float e = m == -INFINITY ? 0.f : std::exp(l[j] - m);
        l[j] = e;
        sum += e;
      }
      part.total[i] += sum;
    }
    for (int64_t j = 0; j < n; ++j) {
      for (int64_t h = 0; h < heads; ++h) {
        const float* __restrict vr = row_as_float(v.base + (s0 + j) * v.row + h * v.head, vf, vd);
        for (int64_t g = 0; g < r; ++g) {
          const float p = logits[(h * r + g) * kBlock + j];
          float* __restrict a = part.acc.data() + (h * r + g) * vd;
#pragma omp simd
          for (int64_t x = 0; x < vd; ++x) a[x] += p * vr[x];
        }
      }
    }
  }
}

// Splits the rows over the threads the caller's OpenMP setting allows (the
// runtime sets it per step: one for a decode step unless asked otherwise),
// then merges the parts by their log-sum-exp.
template <typename T, int64_t KD, int64_t VD>
void attend(const float* q, int64_t q_head, int64_t q_row, int64_t heads, int64_t r, int64_t kd, int64_t vd,
            Rows<T> k, Rows<T> v, int64_t rows, float scale, float* out, float* lse) {
  const int64_t queries = heads * r;
  int64_t parts = 1;
#ifdef _OPENMP
  parts = std::max<int64_t>(1, std::min<int64_t>(omp_get_max_threads(), rows / kRowsPerThread));
#endif
  std::vector<Partial> partial(parts, Partial(queries, vd));
  const int64_t per = (rows + parts - 1) / parts;
#pragma omp parallel for num_threads(parts) if (parts > 1) schedule(static, 1)
  for (int64_t p = 0; p < parts; ++p) {
    const int64_t begin = std::min(rows, p * per), end = std::min(rows, begin + per);
    attend_span<T, KD, VD>(q, q_head, q_row, heads, r, kd, vd, k, v, begin, end, scale, partial[p]);
  }
  for (int64_t i = 0; i < queries; ++i) {
    float m = -INFINITY;
    for (const Partial& part : partial) m = std::max(m, part.peak[i]);
    float total = 0.f;
    float* o = out + i * vd;
    std::fill(o, o + vd, 0.f);
    if (m != -INFINITY) {
      for (const Partial& part : partial) {
        const float c = part.peak[i] == -INFINITY ? 0.f : std::exp(part.peak[i] - m);
        total += part.total[i] * c;
        const float* a = part.acc.data() + i * vd;
        for (int64_t x = 0; x < vd; ++x) o[x] += a[x] * c;
      }
    }
    if (total > 0.f) {
      for (int64_t x = 0; x < vd; ++x) o[x] /= total;
      lse[i] = m + std::log(total);
    } else {
      lse[i] = -INFINITY;  // no rows: output zeros, as a fully masked row
    }
  }
}

template <typename T>
void dispatch_dims(const float* q, int64_t q_head, int64_t q_row, int64_t heads, int64_t r, int64_t kd, int64_t vd,
                   Rows<T> k, Rows<T> v, int64_t rows, float scale, float* out, float* lse) {
  if (kd == 64 && vd == 64)
    attend<T, 64, 64>(q, q_head, q_row, heads, r, kd, vd, k, v, rows, scale, out, lse);
  else if (kd == 128 && vd == 128)
    attend<T, 128, 128>(q, q_head, q_row, heads, r, kd, vd, k, v, rows, scale, out, lse);
  else
    attend<T, 0, 0>(q, q_head, q_row, heads, r, kd, vd, k, v, rows, scale, out, lse);
}

// q [1, H_kv, R, kd] fp32 (R query rows per KV head); k [1, H_kv, S, kd] and
// v [1, H_kv, S, vd] of one dtype (fp32, bf16 or fp16), any row and head
// strides, elements dense. Returns out [1, H_kv, R, vd] fp32 and each query
// row's log-sum-exp [1, H_kv, R] fp32, both new and contiguous. Attention is
// unmasked: every query sees all S rows. Returns AOTI_TORCH_FAILURE on inputs
// it does not take; the generated code then fails the step.
AOTITorchError rows_attend_with_lse(AtenTensorHandle q, AtenTensorHandle k, AtenTensorHandle v, double scale,
                                    AtenTensorHandle* ret0, AtenTensorHandle* ret1) {
  offgraph_kv_native::View qv, kv, vv;
  if (!offgraph_kv_native::view_of(q, 4, &qv) || !offgraph_kv_native::view_of(k, 4, &kv) ||
      !offgraph_kv_native::view_of(v, 4, &vv))
    return AOTI_TORCH_FAILURE;
  const int64_t *qs = qv.sizes, *qt = qv.strides, *ks = kv.sizes, *kt = kv.strides, *vs = vv.sizes, *vt = vv.strides;
  const int32_t qtype = qv.dtype, ktype = kv.dtype, vtype = vv.dtype;
  const int64_t heads = ks[1], rows = ks[2], kd = ks[3], r = qs[2], vd = vs[3];
  const bool shapes_agree = qs[0] == 1 && ks[0] == 1 && vs[0] == 1 && qs[1] == heads && vs[1] == heads &&
                            vs[2] == rows && qs[3] == kd && kd > 0 && vd > 0;
  const bool dense = qt[3] == 1 && kt[3] == 1 && vt[3] == 1;
  if (!shapes_agree || !dense || qtype != aoti_torch_dtype_float32() || ktype != vtype) return AOTI_TORCH_FAILURE;

  const int64_t out_sizes[4] = {1, heads, r, vd}, out_strides[4] = {heads * r * vd, r * vd, vd, 1};
  const int64_t lse_sizes[3] = {1, heads, r}, lse_strides[3] = {heads * r, r, 1};
  const int32_t f32 = aoti_torch_dtype_float32(), cpu = aoti_torch_device_type_cpu();
  AtenTensorHandle out = nullptr, lse = nullptr;
  if (aoti_torch_empty_strided(4, out_sizes, out_strides, f32, cpu, 0, &out)) return AOTI_TORCH_FAILURE;
  if (aoti_torch_empty_strided(3, lse_sizes, lse_strides, f32, cpu, 0, &lse)) {
    aoti_torch_delete_tensor_object(out);
    return AOTI_TORCH_FAILURE;
  }
  void *qp = qv.data, *kp = kv.data, *vp = vv.data, *op = nullptr, *lp = nullptr;
  if (aoti_torch_get_data_ptr(out, &op) || aoti_torch_get_data_ptr(lse, &lp)) {
    aoti_torch_delete_tensor_object(out);
    aoti_torch_delete_tensor_object(lse);
    return AOTI_TORCH_FAILURE;
  }
  const float* qf = static_cast<const float*>(qp);
  float *of = static_cast<float*>(op), *lf = static_cast<float*>(lp);
  const float sc = float(scale);
  bool known = true;
  if (ktype == aoti_torch_dtype_float32()) {
    dispatch_dims<float>(qf, qt[1], qt[2], heads, r, kd, vd, {static_cast<const float*>(kp), kt[2], kt[1]},
                         {static_cast<const float*>(vp), vt[2], vt[1]}, rows, sc, of, lf);
  } else if (ktype == aoti_torch_dtype_bfloat16()) {
    dispatch_dims<Bf16>(qf, qt[1], qt[2], heads, r, kd, vd, {static_cast<const Bf16*>(kp), kt[2], kt[1]},
                        {static_cast<const Bf16*>(vp), vt[2], vt[1]}, rows, sc, of, lf);
  } else if (ktype == aoti_torch_dtype_float16()) {
    dispatch_dims<Half>(qf, qt[1], qt[2], heads, r, kd, vd, {static_cast<const Half*>(kp), kt[2], kt[1]},
                        {static_cast<const Half*>(vp), vt[2], vt[1]}, rows, sc, of, lf);
  } else {
    known = false;
  }
  if (!known) {
    aoti_torch_delete_tensor_object(out);
    aoti_torch_delete_tensor_object(lse);
    return AOTI_TORCH_FAILURE;
  }
  *ret0 = out;
  *ret1 = lse;
  return AOTI_TORCH_SUCCESS;
}

}  // namespace

extern "C" AOTITorchError aoti_torch_cpu_rows_attend_with_lse(AtenTensorHandle q, AtenTensorHandle k,
                                                               AtenTensorHandle v, double scale,
                                                               AtenTensorHandle* ret0, AtenTensorHandle* ret1) {
  // No exception crosses the C boundary (a failed allocation of the softmax's
  // scratch fails the step instead).
  try {
    return rows_attend_with_lse(q, k, v, scale, ret0, ret1);
  } catch (...) {
    return AOTI_TORCH_FAILURE;
  }
}
