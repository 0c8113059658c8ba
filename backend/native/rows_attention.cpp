// CPU attention over the store as it lies in memory, any step width, compiled
// into each CPU program's shared object at export (backend/cpu_kernels.py builds
// it) and called by AOTInductor's generated code as the C shims of
// offgraph_kv::rows_attend_causal (a flat layer's whole step) and
// offgraph_kv::rows_attend_with_lse (unmasked, with each query's log-sum-exp).
//
// Why a kernel of our own: the store keeps K and V as [S, H_kv, D] rows. ATen's
// fused CPU attention walks that history head by head (each head's D elements
// H_kv * D apart) and runs GEMM machinery on a decode step's few query rows;
// inductor's reductions over 16-bit rows vectorise poorly. Two paths:
//
// - Decode (one query row per head of a group, no mask): a block of 64 stored
//   rows is read once for every query of its KV head, widened in registers
//   (vec.h), with an online softmax over the block. A decode step's arithmetic
//   is small but not free: at 2,000 rows the first form of this kernel (one dot
//   per query and key, each with its own horizontal sum; a scalar expf per
//   weight; each value row added into accumulators in memory) took longer than
//   reading the rows. So the dots go four keys by up to three (AVX2) or four
//   (AVX-512) queries in registers, with the four keys' sums taken together;
//   the weights' exp is vectorised; each value register of every query's
//   accumulator stays in a register while the block's rows pass
//   (benchmarks/results/cpu_attention_bandwidth.md).
// - Wide (a prefill chunk: many query rows, lower-right causal): every query of
//   a KV head reuses each block, so the block is widened once into fp32
//   scratch, K transposed, and the dots and the weighted sums become register
//   tiles of queries x 16-lane vectors with no horizontal sums (a small GEMM).
//   This replaced ATen's fused kernel, which needed the 16-bit rows converted to
//   fp32 copies first (a transient of the history's size each layer) and a
//   second pass for the step's own rows.
//
// Only the stable AOTI C shim is used (no ATen headers): the object is built
// in seconds and links into the program like inductor's own kernels.

#include <torch/csrc/inductor/aoti_torch/c/shim.h>

#include "float16.h"
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

constexpr int64_t kBlock = 64;           // rows per softmax block
constexpr int64_t kRowsPerThread = 512;  // a thread below this costs more than it reads
constexpr int64_t kKeysPerPass = 4;      // keys whose dots share each query load
constexpr int64_t kRun = 16;             // rows taken for every head before the next rows
// Queries whose dots share each key load: kKeysPerPass x this accumulators
// stay in registers (16 on AVX2, 32 on AVX-512).
#if defined(__AVX512F__)
constexpr int kQueriesPerPass = 4;
#else
constexpr int kQueriesPerPass = 3;
#endif

using offgraph_kv_native::Bf16;
using offgraph_kv_native::Half;
using offgraph_kv_native::widen;
using namespace offgraph_kv_native::vec;

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

// logits[g * kBlock + j] = scale * q_g . k_j for NQ queries (row stride q_row)
// and n keys (row stride k_row), d elements each. Each key row is read once for
// all NQ queries, kKeysPerPass keys at a time, and their sums taken together.
template <int NQ, int64_t D, typename T>
void dots(const float* q, int64_t q_row, const T* k, int64_t k_row, int64_t n, int64_t d_rt, float scale,
          float* logits) {
  static_assert(kKeysPerPass == 4, "vsum4 takes four keys' sums");
  const int64_t d = D ? D : d_rt;
  int64_t j = 0;
#ifdef OFFGRAPH_KV_VECTOR
  const int64_t dv = d / kLanes * kLanes;
  for (; j + kKeysPerPass <= n; j += kKeysPerPass) {
    Vec acc[NQ][kKeysPerPass];
    for (int g = 0; g < NQ; ++g)
      for (int b = 0; b < kKeysPerPass; ++b) acc[g][b] = vzero();
    for (int64_t x = 0; x < dv; x += kLanes) {
      for (int b = 0; b < kKeysPerPass; ++b) {
        const Vec kv = vload(k + (j + b) * k_row + x);
        for (int g = 0; g < NQ; ++g) acc[g][b] = vfma(vload(q + g * q_row + x), kv, acc[g][b]);
      }
    }
    for (int g = 0; g < NQ; ++g) {
      alignas(16) float s[4];
      _mm_store_ps(s, vsum4(acc[g][0], acc[g][1], acc[g][2], acc[g][3]));
      for (int b = 0; b < kKeysPerPass; ++b) {
        float t = s[b];
        for (int64_t x = dv; x < d; ++x) t += q[g * q_row + x] * widen(k[(j + b) * k_row + x]);
        logits[g * kBlock + j + b] = t * scale;
      }
    }
  }
#endif
  for (; j < n; ++j) {
    for (int g = 0; g < NQ; ++g) {
      float t = 0.f;
#pragma omp simd reduction(+ : t)
      for (int64_t x = 0; x < d; ++x) t += q[g * q_row + x] * widen(k[j * k_row + x]);
      logits[g * kBlock + j] = t * scale;
    }
  }
}

// acc_g = acc_g * rescale[g] + sum_j p[g * kBlock + j] v_j for NQ queries (each
// acc d wide, dense) and n value rows (rescale null: acc_g is taken as it is):
// a register of every query's acc stays put while the rows stream past it.
template <int NQ, int64_t D, typename T>
void weigh(const float* p, const float* rescale, const T* v, int64_t v_row, int64_t n, int64_t d_rt, float* acc,
           int64_t acc_row) {
  const int64_t d = D ? D : d_rt;
  int64_t x = 0;
#ifdef OFFGRAPH_KV_VECTOR
  for (const int64_t dv = d / kLanes * kLanes; x < dv; x += kLanes) {
    Vec a[NQ];
    for (int g = 0; g < NQ; ++g)
      a[g] = rescale ? vmul(vload(acc + g * acc_row + x), vset(rescale[g])) : vload(acc + g * acc_row + x);
    for (int64_t j = 0; j < n; ++j) {
      const Vec vv = vload(v + j * v_row + x);
      for (int g = 0; g < NQ; ++g) a[g] = vfma(vset(p[g * kBlock + j]), vv, a[g]);
    }
    for (int g = 0; g < NQ; ++g) vstore(acc + g * acc_row + x, a[g]);
  }
#endif
  // The elements past the vector loop (all of them without a vector ISA), row by row.
  if (x == d) return;
  for (int g = 0; rescale && g < NQ; ++g)
    for (int64_t e = x; e < d; ++e) acc[g * acc_row + e] *= rescale[g];
  for (int64_t j = 0; j < n; ++j) {
    const T* __restrict vr = v + j * v_row;
    for (int g = 0; g < NQ; ++g) {
      const float pg = p[g * kBlock + j];
      float* __restrict a = acc + g * acc_row;
#pragma omp simd
      for (int64_t e = x; e < d; ++e) a[e] += pg * widen(vr[e]);
    }
  }
}

// Calls fn(integral_constant<N>) for n in [1, Max] (Max <= 4): a register
// tile's row count fixed at compile time.
template <int Max, typename Fn>
void with_count(int64_t n, Fn&& fn) {
  static_assert(Max >= 1 && Max <= 4, "tiles of one to four rows");
  if (n == 1) fn(std::integral_constant<int, 1>{});
  if constexpr (Max >= 2) if (n == 2) fn(std::integral_constant<int, 2>{});
  if constexpr (Max >= 3) if (n == 3) fn(std::integral_constant<int, 3>{});
  if constexpr (Max >= 4) if (n == 4) fn(std::integral_constant<int, 4>{});
}

// Calls fn(integral_constant<NQ>, g0) for the r queries of a head in passes of
// at most kQueriesPerPass.
template <typename Fn>
void in_passes(int64_t r, Fn&& fn) {
  for (int64_t g = 0; g < r; g += kQueriesPerPass)
    with_count<kQueriesPerPass>(std::min<int64_t>(kQueriesPerPass, r - g), [&](auto nq) { fn(nq, g); });
}

// One query row's result from its unnormalised sums: out = acc / total and its
// log-sum-exp; a row that saw nothing gives zeros and -inf, as a fully masked
// row (acc may be out itself).
inline void normalise(const float* acc, float peak, float total, int64_t vd, float* out, float* lse) {
  if (total > 0.f) {
    for (int64_t x = 0; x < vd; ++x) out[x] = acc[x] / total;
    *lse = peak + std::log(total);
  } else {
    std::fill(out, out + vd, 0.f);
    *lse = -INFINITY;
  }
}

// The block's logits l[0, n) of one query become its softmax weights against
// the running peak; returns the factor the query's earlier sums take.
inline float softmax_block(float* l, int64_t n, float* peak, float* total) {
  int64_t j = 0;
  float m = *peak;
#ifdef OFFGRAPH_KV_VECTOR
  if (n >= kLanes) {
    Vec mv = vload(l);
    for (j = kLanes; j + kLanes <= n; j += kLanes) mv = vmax(vload(l + j), mv);
    m = std::max(m, vhmax(mv));
  }
#endif
  for (; j < n; ++j) m = std::max(m, l[j]);
  // A row of -inf logits (a query that sees nothing yet) keeps weight 0, not NaN.
  const float rescale = *peak == -INFINITY ? 0.f : std::exp(*peak - m);
  *peak = m;
  float sum = 0.f;
  j = 0;
  if (m == -INFINITY) {
    std::fill(l, l + n, 0.f);
  } else {
#ifdef OFFGRAPH_KV_VECTOR
    const Vec mv = vset(m);
    Vec sv = vzero();
    for (; j + kLanes <= n; j += kLanes) {
      const Vec e = vexp(vsub(vload(l + j), mv));
      vstore(l + j, e);
      sv = vadd(sv, e);
    }
    sum = vsum(sv);
#endif
    for (; j < n; ++j) {
      l[j] = std::exp(l[j] - m);
      sum += l[j];
    }
  }
  *total = *total * rescale + sum;
  return rescale;
}

// The head slices (bytes long) of rows [s, s + n) into the outer caches ahead of their use (the next
// block's rows while this block's are read). From memory the kernel read at a third of one core's
// stream bandwidth without it: 30 layers x 2,000 SmolLM2 rows (46 MB) took 8.8-10.7 ms, 4.3-5.3
// GB/s against 16.5 GB/s for a plain read, on an AMD EPYC (Zen 4). Prefetching into L1 (locality 3)
// gained only 10-15 %; into L2 / L3 (locality 1): 3.3-3.5 ms, 13-14 GB/s. Rows 32 ahead with the
// first 32 asked for up front took 0.83x the time over 200 rows in that harness (every layer's rows
// evicted), but 1.04-1.07x in the bf16 program @200 in turns (fp32 alike), so the lead stays a block.
// Always inlined: GCC 12 takes a function whose only effect is a prefetch for a const one and drops
// calls that it does not inline (a helper between this and the loop left the kernel without prefetches
// and at half speed from memory).
template <typename T>
__attribute__((always_inline)) inline void prefetch_rows(const T* p, int64_t row, int64_t n, int64_t bytes) {
  for (int64_t j = 0; j < n; ++j)
    for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(reinterpret_cast<const char*>(p + j * row) + b, 0, 1);
}

// Rows [begin, end) of every head into `part`. Queries are [H_kv, R, kd] at q
// (head stride q_head, row stride q_row, elements dense). KD / VD fix the head
// dims at compile time (0: read kd / vd), so the common ones are fixed-length loops.
template <typename T, int64_t KD, int64_t VD>
void attend_span(const float* q, int64_t q_head, int64_t q_row, int64_t heads, int64_t r, int64_t kd, int64_t vd,
                 Rows<T> k, Rows<T> v, int64_t begin, int64_t end, float scale, Partial& part) {
  const int64_t queries = heads * r;
  std::vector<float> logits(queries * kBlock), rescale(queries);
  for (int64_t s0 = begin; s0 < end; s0 += kBlock) {
    const int64_t n = std::min(kBlock, end - s0);
    // Every head of kRun rows before the next rows: the block streams through
    // memory in order (head by head over all 64 rows, the hardware prefetchers
    // fell behind: 8,000 rows from DRAM took 1.1x as long).
    // The next block's rows, run by run, as this block's are read.
    const int64_t ahead = std::min(kBlock, std::max<int64_t>(0, end - s0 - kBlock));
    for (int64_t j = 0; j < n; j += kRun)
      for (int64_t h = 0; h < heads; ++h) {
        if (j < ahead)
          prefetch_rows(k.base + (s0 + kBlock + j) * k.row + h * k.head, k.row, std::min(kRun, ahead - j),
                        kd * int64_t(sizeof(T)));
        in_passes(r, [&](auto nq, int64_t g) {
          dots<decltype(nq)::value, KD>(q + h * q_head + g * q_row, q_row, k.base + (s0 + j) * k.row + h * k.head,
                                        k.row, std::min(kRun, n - j), kd, scale,
                                        logits.data() + (h * r + g) * kBlock + j);
        });
      }
    for (int64_t i = 0; i < queries; ++i)
      rescale[i] = softmax_block(logits.data() + i * kBlock, n, &part.peak[i], &part.total[i]);
    for (int64_t j = 0; j < n; j += kRun)
      for (int64_t h = 0; h < heads; ++h) {
        if (j < ahead)
          prefetch_rows(v.base + (s0 + kBlock + j) * v.row + h * v.head, v.row, std::min(kRun, ahead - j),
                        vd * int64_t(sizeof(T)));
        in_passes(r, [&](auto nq, int64_t g) {
          const int64_t i = h * r + g;
          // The earlier rows' factor applies once per block, at its first run.
          weigh<decltype(nq)::value, VD>(logits.data() + i * kBlock + j, j == 0 ? rescale.data() + i : nullptr,
                                         v.base + (s0 + j) * v.row + h * v.head, v.row, std::min(kRun, n - j), vd,
                                         part.acc.data() + i * vd, vd);
        });
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
    normalise(o, m, total, vd, o, lse + i);
  }
}

// Which stored rows each query row sees. A flat layer's step of width t holds
// the last t of the S rows; with R = groups * t query rows per KV head (row
// r = g * t + i, query i of group member g), query i sees rows [0, S - t + i]:
// lower-right causal. t == 0: every query sees every row (no mask).
struct Visible {
  int64_t t = 0, rows = 0;
  int64_t count(int64_t r) const { return t ? rows - t + r % t + 1 : rows; }
};

// The wide path's register tiles: kTile queries x kTileVecs vectors (of keys
// for the dots, of value elements for the weighted sums): 16 accumulators on
// AVX-512 (32 registers), 8 on AVX2 (16).
#if defined(__AVX512F__)
constexpr int kTile = 4;
#else
constexpr int kTile = 2;
#endif
constexpr int kTileVecs = 4;

// logits[g * kBlock + j] = scale * q_g . k_j for NQ queries (row stride q_row)
// and the block's kBlock keys, from kt [d][kBlock]: the block's keys
// transposed to fp32, so each query element is broadcast against 16 keys at
// once and no sum is horizontal.
template <int NQ>
void tile_dots(const float* q, int64_t q_row, const float* kt, int64_t d, float scale, float* logits) {
#ifdef OFFGRAPH_KV_VECTOR
  static_assert(kBlock % (kTileVecs * kLanes) == 0, "a block is whole tiles of keys");
  for (int64_t c = 0; c < kBlock; c += kTileVecs * kLanes) {
    Vec acc[NQ][kTileVecs];
    for (int g = 0; g < NQ; ++g)
      for (int b = 0; b < kTileVecs; ++b) acc[g][b] = vzero();
    for (int64_t x = 0; x < d; ++x) {
      Vec kv[kTileVecs];
      for (int b = 0; b < kTileVecs; ++b) kv[b] = vload(kt + x * kBlock + c + b * kLanes);
      for (int g = 0; g < NQ; ++g) {
        const Vec qx = vset(q[g * q_row + x]);
        for (int b = 0; b < kTileVecs; ++b) acc[g][b] = vfma(qx, kv[b], acc[g][b]);
      }
    }
    const Vec sc = vset(scale);
    for (int g = 0; g < NQ; ++g)
      for (int b = 0; b < kTileVecs; ++b) vstore(logits + g * kBlock + c + b * kLanes, vmul(acc[g][b], sc));
  }
#else
  for (int g = 0; g < NQ; ++g)
    for (int64_t j = 0; j < kBlock; ++j) {
      float t = 0.f;
      for (int64_t x = 0; x < d; ++x) t += q[g * q_row + x] * kt[x * kBlock + j];
      logits[g * kBlock + j] = t * scale;
    }
#endif
}

#ifdef OFFGRAPH_KV_VECTOR
// Value elements [x, x + NV * kLanes) of tile_weigh: NQ x NV accumulators stay
// in registers while the block's n value rows pass.
template <int NQ, int NV>
void weigh_columns(const float* p, const float* rescale, const float* vb, int64_t n, int64_t dv, float* acc,
                   int64_t x) {
  Vec a[NQ][NV];
  for (int g = 0; g < NQ; ++g) {
    const Vec f = vset(rescale[g]);
    for (int b = 0; b < NV; ++b) a[g][b] = vmul(vload(acc + g * dv + x + b * kLanes), f);
  }
  for (int64_t j = 0; j < n; ++j) {
    Vec vv[NV];
    for (int b = 0; b < NV; ++b) vv[b] = vload(vb + j * dv + x + b * kLanes);
    for (int g = 0; g < NQ; ++g) {
      const Vec w = vset(p[g * kBlock + j]);
      for (int b = 0; b < NV; ++b) a[g][b] = vfma(w, vv[b], a[g][b]);
    }
  }
  for (int g = 0; g < NQ; ++g)
    for (int b = 0; b < NV; ++b) vstore(acc + g * dv + x + b * kLanes, a[g][b]);
}
#endif

// acc_g = acc_g * rescale[g] + sum_{j < n} p[g * kBlock + j] v_j for NQ queries
// (acc rows dv apart), from vb [n][dv]: the block's values widened to fp32.
template <int NQ>
void tile_weigh(const float* p, const float* rescale, const float* vb, int64_t n, int64_t dv, float* acc) {
  int64_t x = 0;
#ifdef OFFGRAPH_KV_VECTOR
  for (; x + kTileVecs * kLanes <= dv; x += kTileVecs * kLanes) weigh_columns<NQ, kTileVecs>(p, rescale, vb, n, dv, acc, x);
  for (; x + kLanes <= dv; x += kLanes) weigh_columns<NQ, 1>(p, rescale, vb, n, dv, acc, x);
#endif
  for (int g = 0; g < NQ && x < dv; ++g) {
    float* a = acc + g * dv;
    for (int64_t e = x; e < dv; ++e) a[e] *= rescale[g];
    for (int64_t j = 0; j < n; ++j) {
      const float w = p[g * kBlock + j];
      for (int64_t e = x; e < dv; ++e) a[e] += w * vb[j * dv + e];
    }
  }
}

// Floats of scratch one unit of the wide path takes (see wide_unit).
inline int64_t wide_scratch(int64_t queries, int64_t kd, int64_t vd) {
  return kd * kBlock + kBlock * vd + kTile * kBlock + queries * (vd + 2);
}

// Query rows [r0, r1) of one KV head over the rows they see: each block of
// rows is widened once (K transposed) into scratch and serves every query.
// q, out, lse: the head's own (rows q_row / vd / 1 apart); k, v: the head's rows.
template <typename T>
void wide_unit(const float* q, int64_t q_row, int64_t r0, int64_t r1, int64_t kd, int64_t vd, const T* k,
               int64_t k_row, const T* v, int64_t v_row, Visible vis, float scale, float* scratch, float* out,
               float* lse) {
  const int64_t nq_all = r1 - r0;
  float* kt = scratch;
  float* vb = kt + kd * kBlock;
  float* logits = vb + kBlock * vd;
  float* peak = logits + kTile * kBlock;
  float* total = peak + nq_all;
  float* acc = total + nq_all;
  std::fill(peak, peak + nq_all, -INFINITY);
  std::fill(total, total + nq_all, 0.f);
  std::fill(acc, acc + nq_all * vd, 0.f);
  int64_t end = 0;  // rows any of these queries sees
  for (int64_t r = r0; r < r1; ++r) end = std::max(end, vis.count(r));
  float rescale[kTile];
  for (int64_t s0 = 0; s0 < end; s0 += kBlock) {
    const int64_t n = std::min(kBlock, end - s0);
    for (int64_t j = 0; j < n; ++j) {
      const T* kr = k + (s0 + j) * k_row;
      const T* vr = v + (s0 + j) * v_row;
      for (int64_t x = 0; x < kd; ++x) kt[x * kBlock + j] = widen(kr[x]);
      for (int64_t x = 0; x < vd; ++x) vb[j * vd + x] = widen(vr[x]);
    }
    for (int64_t x = 0; n < kBlock && x < kd; ++x) std::fill(kt + x * kBlock + n, kt + (x + 1) * kBlock, 0.f);
    for (int64_t g0 = r0; g0 < r1; g0 += kTile) {
      const int64_t nq = std::min<int64_t>(kTile, r1 - g0), i0 = g0 - r0;
      int64_t seen[kTile];
      bool any = false;
      for (int64_t g = 0; g < nq; ++g) {
        seen[g] = std::max<int64_t>(0, std::min(n, vis.count(g0 + g) - s0));
        any = any || seen[g] > 0;
      }
      if (!any) continue;  // past every one of these queries' last row: nothing changes
      with_count<kTile>(nq, [&](auto c) {
        constexpr int NQ = decltype(c)::value;
        tile_dots<NQ>(q + g0 * q_row, q_row, kt, kd, scale, logits);
        for (int g = 0; g < NQ; ++g) {
          float* l = logits + g * kBlock;
          rescale[g] = softmax_block(l, seen[g], &peak[i0 + g], &total[i0 + g]);
          std::fill(l + seen[g], l + n, 0.f);  // rows the query does not see weigh exactly 0
        }
        tile_weigh<NQ>(logits, rescale, vb, n, vd, acc + i0 * vd);
      });
    }
  }
  for (int64_t i = 0; i < nq_all; ++i)
    normalise(acc + i * vd, peak[i], total[i], vd, out + (r0 + i) * vd, lse + r0 + i);
}

// The wide path: every KV head's queries in chunks, as many as the caller's
// OpenMP setting has threads for; each chunk reads its head's rows once for
// all of its queries and owns its outputs (nothing to merge).
template <typename T>
void attend_wide(const float* q, int64_t q_head, int64_t q_row, int64_t heads, int64_t r, int64_t kd, int64_t vd,
                 Rows<T> k, Rows<T> v, Visible vis, float scale, float* out, float* lse) {
  int64_t threads = 1;
#ifdef _OPENMP
  threads = omp_get_max_threads();
#endif
  const int64_t tiles = (r + kTile - 1) / kTile;
  const int64_t chunks = std::max<int64_t>(1, std::min<int64_t>(tiles, (threads + heads - 1) / heads));
  const int64_t per = (tiles + chunks - 1) / chunks * kTile;
  const int64_t units = heads * chunks, each = wide_scratch(per, kd, vd);
  std::vector<float> scratch(units * each);  // before the parallel region: a failed allocation throws here
  const int64_t team = std::min(threads, units);
#pragma omp parallel for num_threads(team) if (team > 1) schedule(static, 1)
  for (int64_t u = 0; u < units; ++u) {
    const int64_t h = u / chunks, r0 = (u % chunks) * per, r1 = std::min(r, r0 + per);
    if (r0 < r1)
      wide_unit<T>(q + h * q_head, q_row, r0, r1, kd, vd, k.base + h * k.head, k.row, v.base + h * v.head, v.row,
                   vis, scale, scratch.data() + u * each, out + h * r * vd, lse + h * r);
  }
}

// A decode step's few queries that all see every row take the decode path
// (rows split over threads); anything else, the wide path.
template <typename T>
void attend_rows(const float* q, int64_t q_head, int64_t q_row, int64_t heads, int64_t r, int64_t kd, int64_t vd,
                 Rows<T> k, Rows<T> v, Visible vis, float scale, float* out, float* lse) {
  if (vis.t <= 1 && r <= 2 * kQueriesPerPass) {
    if (kd == 64 && vd == 64)
      attend<T, 64, 64>(q, q_head, q_row, heads, r, kd, vd, k, v, vis.rows, scale, out, lse);
    else if (kd == 128 && vd == 128)
      attend<T, 128, 128>(q, q_head, q_row, heads, r, kd, vd, k, v, vis.rows, scale, out, lse);
    else
      attend<T, 0, 0>(q, q_head, q_row, heads, r, kd, vd, k, v, vis.rows, scale, out, lse);
  } else {
    attend_wide<T>(q, q_head, q_row, heads, r, kd, vd, k, v, vis, scale, out, lse);
  }
}

// q [1, H_kv, R, kd] fp32 (R query rows per KV head); k [1, H_kv, S, kd] and
// v [1, H_kv, S, vd] of one dtype (fp32, bf16 or fp16), any row and head
// strides, elements dense. Writes out [1, H_kv, R, vd] fp32 and, when ret1 is
// given, each query row's log-sum-exp [1, H_kv, R] fp32, both new and
// contiguous. groups == 0: unmasked, every query sees all S rows; otherwise R =
// groups * t for a step of width t <= S, lower-right causal (Visible). Returns
// AOTI_TORCH_FAILURE on inputs it does not take; the generated code then fails
// the step.
AOTITorchError rows_attend(AtenTensorHandle q, AtenTensorHandle k, AtenTensorHandle v, double scale, int64_t groups,
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
  Visible vis{0, rows};
  if (groups != 0) {  // a step of width t = R / groups, its rows the last t of S
    if (groups < 0 || r % groups != 0 || r / groups > rows) return AOTI_TORCH_FAILURE;
    vis.t = r / groups;
  }

  const int64_t out_sizes[4] = {1, heads, r, vd}, out_strides[4] = {heads * r * vd, r * vd, vd, 1};
  const int64_t lse_sizes[3] = {1, heads, r}, lse_strides[3] = {heads * r, r, 1};
  const int32_t f32 = aoti_torch_dtype_float32(), cpu = aoti_torch_device_type_cpu();
  AtenTensorHandle out = nullptr, lse = nullptr;
  auto drop = [&] {
    if (out) aoti_torch_delete_tensor_object(out);
    if (lse) aoti_torch_delete_tensor_object(lse);
  };
  void *op = nullptr, *lp = nullptr;
  std::vector<float> lse_scratch;  // the causal form returns no log-sum-exp
  if (aoti_torch_empty_strided(4, out_sizes, out_strides, f32, cpu, 0, &out) ||
      aoti_torch_get_data_ptr(out, &op)) {
    drop();
    return AOTI_TORCH_FAILURE;
  }
  if (ret1 != nullptr) {
    if (aoti_torch_empty_strided(3, lse_sizes, lse_strides, f32, cpu, 0, &lse) || aoti_torch_get_data_ptr(lse, &lp)) {
      drop();
      return AOTI_TORCH_FAILURE;
    }
  } else {
    lse_scratch.resize(heads * r);
    lp = lse_scratch.data();
  }
  const float* qf = static_cast<const float*>(qv.data);
  float *of = static_cast<float*>(op), *lf = static_cast<float*>(lp);
  const float sc = float(scale);
  if (ktype == aoti_torch_dtype_float32()) {
    attend_rows<float>(qf, qt[1], qt[2], heads, r, kd, vd, {static_cast<const float*>(kv.data), kt[2], kt[1]},
                       {static_cast<const float*>(vv.data), vt[2], vt[1]}, vis, sc, of, lf);
  } else if (ktype == aoti_torch_dtype_bfloat16()) {
    attend_rows<Bf16>(qf, qt[1], qt[2], heads, r, kd, vd, {static_cast<const Bf16*>(kv.data), kt[2], kt[1]},
                      {static_cast<const Bf16*>(vv.data), vt[2], vt[1]}, vis, sc, of, lf);
  } else if (ktype == aoti_torch_dtype_float16()) {
    attend_rows<Half>(qf, qt[1], qt[2], heads, r, kd, vd, {static_cast<const Half*>(kv.data), kt[2], kt[1]},
                      {static_cast<const Half*>(vv.data), vt[2], vt[1]}, vis, sc, of, lf);
  } else {
    drop();
    return AOTI_TORCH_FAILURE;
  }
  *ret0 = out;
  if (ret1 != nullptr) *ret1 = lse;
  return AOTI_TORCH_SUCCESS;
}

}  // namespace

// No exception crosses the C boundary (a failed allocation of the softmax's
// scratch fails the step instead).
extern "C" AOTITorchError aoti_torch_cpu_rows_attend_with_lse(AtenTensorHandle q, AtenTensorHandle k,
                                                               AtenTensorHandle v, double scale,
                                                               AtenTensorHandle* ret0, AtenTensorHandle* ret1) {
  try {
    return ret1 == nullptr ? AOTI_TORCH_FAILURE : rows_attend(q, k, v, scale, 0, ret0, ret1);
  } catch (...) {
    return AOTI_TORCH_FAILURE;
  }
}

extern "C" AOTITorchError aoti_torch_cpu_rows_attend_causal(AtenTensorHandle q, AtenTensorHandle k,
                                                             AtenTensorHandle v, double scale, int64_t groups,
                                                             AtenTensorHandle* ret0) {
  try {
    return groups <= 0 ? AOTI_TORCH_FAILURE : rows_attend(q, k, v, scale, groups, ret0, nullptr);
  } catch (...) {
    return AOTI_TORCH_FAILURE;
  }
}
