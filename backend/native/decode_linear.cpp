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
#include "shared_rows.h"
#include "shim_view.h"
#include "vec.h"
#include "wide_rows.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <type_traits>
#include <utility>
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

// Outputs are computed in blocks of kBlockRows, their horizontal sums taken together; whether a
// block's rows stream side by side (one sweep over the activations for all) or one after another is
// the CPU's: on AVX-512 (an Intel Xeon, 2026-12-02) four rows side by side took 0.85-0.98x one row's
// time, per shape; on an AVX2 AMD EPYC four rows read 0.75-0.85x as fast as one sequential stream,
// two 0.8x (standalone probes, interleaved runs). On an AMD EPYC (Zen 4) with AVX-512, the 30
// layers' bf16 weights of a SmolLM2 step from memory took 29-36 ms four rows side by side and 13-16 ms
// one row after another (`benchmarks/cpu/native/run.sh decode_linear_from_memory`); int8 19-22 ms
// against 8-12 ms: AMD's prefetchers lose interleaved row streams, so AMD machines read one row
// after another. (The int4 bf16 path, bound by its arithmetic, reads four rows side by side everywhere.)
#ifdef OFFGRAPH_KV_VECTOR
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
// Outputs of a chunk that decode's helpers share (shared_rows.h): a multiple of kBlockRows, so every
// block of outputs is the one a single thread computes (the same bits); 64 bf16 rows of SmolLM2's
// 576 inputs are 72 KiB, a few microseconds from memory.
constexpr int64_t kSharedChunk = 64;
constexpr int64_t kSharedFrom = 4 * kSharedChunk;  // fewer outputs: one thread, as before

using offgraph_kv_native::step_helpers;

// ----------------------------------------------------------------------------
// The weight formats: each computes a block of B outputs' dots with one row
// of activations (Row) into out[0..B)
// ----------------------------------------------------------------------------

inline float widen(int8_t q) { return float(q); }

// One row of activations, in the forms the formats read: fp32 (K values), the sum of each int4
// group's, and, for a bf16 row of finite values only (else null): its values as bf16 in the order Int4Groups' bf16
// path reads them with that path's offsets (quad_bf16), or as int16 blocks with their scales (and, for
// int4 groups, each group's sum of them) for the integer paths (int16_blocks).
struct Row {
  const float* __restrict f;
  const float* __restrict group_sums;
  const uint16_t* __restrict bf16_quads;
  const float* __restrict quad_offsets;
  const int16_t* __restrict int16;
  const float* __restrict int16_scales;
  const float* __restrict int16_group_offsets;  // per int4 group: its block's scale x its int16 values' sum
};

// Whether bf16 rows may take the paths made for them (Int4Groups' bf16 dot products, Int8Rows' int16
// blocks): OFFGRAPH_KV_CPU_BF16_ROWS=fp32 sends them down the fp32 path instead, for A/B runs and for
// tests of both paths on one machine. Read once per call.
inline bool bf16_row_paths() {
  const char* how = std::getenv("OFFGRAPH_KV_CPU_BF16_ROWS");
  return !(how && std::strcmp(how, "fp32") == 0);
}

// Independent accumulator chains per pass where the arithmetic bounds a format (int4 through fp32:
// a nibble split, two conversions and FMAs per pair of weights), since one chain waits on the FMA's
// latency (4 cycles); each output of a block of B keeps kChains / B chains. Dense rows keep one chain a
// row: from memory, four chains a row took 1.1-1.25x one chain's time for a SmolLM2 step's bf16
// linears on an AMD EPYC (Zen 4) (the loads issued in bursts; in cache four were 1.3x faster).
constexpr int kChains = 4;
template <int B>
constexpr int chains_per_output() {
  return B >= kChains ? 1 : kChains / B;
}

#ifdef OFFGRAPH_KV_VECTOR
// out[b] = the sum of sums[b]'s lanes; four at a time in one transposing sum. Inlined into each
// format's dots: left a call of its own, a profile of int4 decode put 5 % of the step in it (its
// arithmetic included; the kernel alone from memory measured the same either way).
template <int B>
__attribute__((always_inline)) inline void horizontal_sums(const Vec* sums, float* out) {
  if constexpr (B == 4) {
    alignas(16) float four[4];
    _mm_store_ps(four, vsum4(sums[0], sums[1], sums[2], sums[3]));
    for (int b = 0; b < 4; ++b) out[b] = four[b];
  } else {
    for (int b = 0; b < B; ++b) out[b] = vsum(sums[b]);
  }
}
#endif

// Rows ask for their bytes ahead into L2, once a cache line: fp32 rows 1 KB ahead, 16-bit rows (and
// the int4 bf16 path's groups, kQuadPrefetchBytes) 8 KB. From memory, a SmolLM2 step's fp32 linears
// took 1.35-1.40x the time of reading the same bytes in order without it and 1.07-1.10x with it (0.5
// to 2 KB alike; 8 KB 1.15x; into L1 instead, 1.15-1.25x); its bf16 linears 1.13-1.39x without (the
// runs were bimodal), 1.37-1.39x 2 KB ahead, 1.04-1.05x 8 KB ahead, 1.02-1.07x 16 KB (AMD EPYC Zen 4,
// `benchmarks/cpu/native/run.sh decode_linear_from_memory`, medians of 4-6 runs in turns).
template <typename W>
constexpr int64_t dense_prefetch_bytes() {
  return sizeof(W) == 4 ? 1024 : 8192;
}

template <typename W>
struct Dense {  // fp32 / bf16 / fp16 weights [N, K] (and int8, whose scales Int8Rows applies)
  const W* w;
  int64_t k;

  // Which of a bf16 row's own forms the format reads (Row::bf16_quads, Row::int16): here neither.
  bool takes_bf16_quads() const { return false; }
  bool takes_int16_blocks() const { return false; }
  // Wide steps of bf16 rows (wide_rows.h) read bf16 weights as stored; from 4 rows a step the GEMM
  // was 1.2x the per-row paths' speed, from 8 3x (`benchmarks/cpu/native/run.sh wide_linear_rows`).
  bool takes_wide() const { return std::is_same<W, Bf16>::value; }
  int64_t wide_from_rows() const { return 4; }
  const uint16_t* bf16_rows(int64_t n0, int64_t, uint16_t*) const {
    return reinterpret_cast<const uint16_t*>(w + n0 * k);
  }

  // out[b] for the B rows from n: on machines that read rows side by side (rows_side_by_side) one
  // sweep over the activations for all B; elsewhere one row after another, their horizontal sums
  // still taken together (a sum and a store a row cost SmolLM2's 576-input rows ~10 %).
  template <int B>
  void dots(int64_t n, const Row& row, float* out) const {
#ifdef OFFGRAPH_KV_VECTOR
    Vec sums[B];
    float tails[B];
    if (B > 1 && !rows_side_by_side())
      for (int b = 0; b < B; ++b) sweep<1>(n + b, row.f, &sums[b], &tails[b]);
    else
      sweep<B>(n, row.f, sums, tails);
    horizontal_sums<B>(sums, out);
    for (int b = 0; b < B; ++b) out[b] += tails[b];
#else
    for (int b = 0; b < B; ++b) {
      out[b] = 0.f;
      for (int64_t x = 0; x < k; ++x) out[b] += widen(w[(n + b) * k + x]) * row.f[x];
    }
#endif
  }

#ifdef OFFGRAPH_KV_VECTOR
  // The B rows' dots from n as vectors (sums) and the inputs past the last whole vector (tails).
  template <int B>
  void sweep(int64_t n, const float* __restrict xf, Vec* sums, float* tails) const {
    for (int b = 0; b < B; ++b) sums[b] = vzero();
    int64_t x = 0;
    for (; x + kLanes <= k; x += kLanes) {
      const Vec xv = vload(xf + x);
      for (int b = 0; b < B; ++b) {
        const W* at = w + (n + b) * k + x;
        if (sizeof(W) > 1 && (x * int64_t(sizeof(W))) % 64 == 0)  // once a cache line (int8: as found)
          _mm_prefetch(reinterpret_cast<const char*>(at) + dense_prefetch_bytes<W>(), _MM_HINT_T1);
        sums[b] = vfma(vload(at), xv, sums[b]);
      }
    }
    for (int b = 0; b < B; ++b) {
      tails[b] = 0.f;
      for (int64_t i = x; i < k; ++i) tails[b] += widen(w[(n + b) * k + i]) * xf[i];
    }
  }
#endif
};

// int8 weights against a bf16 row held as int16 blocks (AVX-512 BW; VNNI's vpdpwssd where present):
// per block of 64 inputs, the row's values as int16 multiples of a power of two, 2^(E - 14) for E the
// exponent of the block's largest |x|. bf16 carries 8 significant bits, so every value within 2^7 of
// the block's largest is exact; smaller ones are rounded to the nearest multiple (error below 2^-15 of
// the block's largest: 2^6 below the rounding of its largest to bf16). The int8 x int16 products and
// their sums in a block are exact in int32; each block's sum meets its scale in fp32. Against the fp32
// path (a widening and a conversion per weight) a SmolLM2 step's int8 linears from memory took 0.7-0.85x
// the time (`benchmarks/cpu/native/run.sh decode_linear_from_memory`; the memory's rate bounds it).
// AVX2 has the same int16 products (vpmaddwd) at half the width; there the fp32 path's widening,
// conversion and FMA per 8 weights bound int8 decode at ~2.4x its read floor (an AMD EPYC, 2026-12-07),
// and Int4Groups takes the blocks too (AVX2 has no bf16 dot product).
constexpr int64_t kInt16Block = 64;
inline int64_t int16_padded(int64_t k) { return (k + kInt16Block - 1) / kInt16Block * kInt16Block; }
// How far ahead of a pass each row's bytes are asked for where the arithmetic keeps the hardware
// prefetcher behind (from memory, 2-3 KB ahead took 0.8-0.85x the time of none; 0.5 KB no gain).
constexpr int64_t kPrefetchBytes = 2048;

#if defined(__AVX512BW__)
#define OFFGRAPH_KV_INT16_BLOCKS 1

// Row::int16 (padded with zeros to whole blocks) and Row::int16_scales from one row's fp32 values
// `f` (k of them, all finite). Positive floats order as their bit patterns do, so the largest |x| is
// one integer max; multiplying by the scale's inverse (a power of two) is exact, and the conversion
// rounds to nearest.
inline void int16_blocks(const float* f, int64_t k, int16_t* q, float* scales) {
  const __m512i magnitude = _mm512_set1_epi32(0x7FFFFFFF);
  for (int64_t b = 0; b * kInt16Block < k; ++b) {
    const int64_t begin = b * kInt16Block, n = std::min(kInt16Block, k - begin);
    __m512i v[4], largest = _mm512_setzero_si512();
    for (int c = 0; c < 4; ++c) {
      const int64_t here = std::max<int64_t>(0, std::min<int64_t>(16, n - 16 * c));
      v[c] = _mm512_maskz_loadu_epi32(__mmask16((1u << here) - 1), f + begin + 16 * c);
      largest = _mm512_max_epu32(largest, _mm512_and_si512(v[c], magnitude));
    }
    const uint32_t bits = uint32_t(_mm512_reduce_max_epu32(largest));
    // largest in [2^e, 2^(e+1)); scale 2^(e - 14) (tiny blocks: 2^-114, where every value rounds to 0)
    const int e = std::max(-100, int(bits >> 23) - 127);
    scales[b] = std::ldexp(1.f, e - 14);
    const __m512 inverse = _mm512_set1_ps(std::ldexp(1.f, 14 - e));
    for (int c = 0; c < 4; ++c) {
      const __m512i r = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_castsi512_ps(v[c]), inverse));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + begin + 16 * c), _mm512_cvtsepi32_epi16(r));
    }
  }
}

inline __m512i int16_products(__m512i acc, __m512i w, __m512i x) {
#ifdef __AVX512VNNI__
  return _mm512_dpwssd_epi32(acc, w, x);
#else
  return _mm512_add_epi32(acc, _mm512_madd_epi16(w, x));
#endif
}

// One block of 64 weights; `n` < 64: a short last block, masked, against zero padding.
template <bool kWhole>
inline Vec int16_block(const int8_t* w, const int16_t* x, float scale, int64_t n, Vec acc) {
  __m256i a, b;
  if (kWhole) {
    a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w));
    b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 32));
  } else {
    a = _mm256_maskz_loadu_epi8(n >= 32 ? ~__mmask32(0) : (__mmask32(1) << n) - 1, w);
    b = _mm256_maskz_loadu_epi8(n <= 32 ? 0 : (__mmask32(1) << (n - 32)) - 1, w + 32);
  }
  const __m512i s = int16_products(int16_products(_mm512_setzero_si512(), _mm512_cvtepi8_epi16(a), _mm512_loadu_si512(x)),
                                   _mm512_cvtepi8_epi16(b), _mm512_loadu_si512(x + 32));
  return _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_set1_ps(scale), acc);
}
#elif defined(__AVX2__) && defined(__FMA__)
#define OFFGRAPH_KV_INT16_BLOCKS 1
#define OFFGRAPH_KV_INT4_INT16_BLOCKS 1  // AVX2 only: AVX-512 machines take the bf16 dot product or fp32

// As the AVX-512 form above, a value at a time: once per row of a call, against the N x K weights.
inline void int16_blocks(const float* f, int64_t k, int16_t* q, float* scales) {
  for (int64_t b = 0; b * kInt16Block < k; ++b) {
    const int64_t begin = b * kInt16Block, n = std::min(kInt16Block, k - begin);
    uint32_t bits = 0;
    for (int64_t i = 0; i < n; ++i) {
      uint32_t u;
      std::memcpy(&u, f + begin + i, sizeof u);
      bits = std::max(bits, u & 0x7FFFFFFFu);
    }
    const int e = std::max(-100, int(bits >> 23) - 127);
    scales[b] = std::ldexp(1.f, e - 14);
    const float inverse = std::ldexp(1.f, 14 - e);
    for (int64_t i = 0; i < kInt16Block; ++i)  // nearest, ties to even, saturated (as vpmovsdw)
      q[begin + i] = i < n ? int16_t(std::min(32767.f, std::max(-32768.f, std::nearbyint(f[begin + i] * inverse)))) : 0;
  }
}

inline __m256i int16_products(__m256i acc, __m256i w, const int16_t* x) {
  return _mm256_add_epi32(acc, _mm256_madd_epi16(w, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x))));
}

// One block of 64 weights; `n` < 64: a short last block, its bytes copied beside zeros (a row's last
// bytes may end the buffer), against zero padding.
template <bool kWhole>
inline Vec int16_block(const int8_t* w, const int16_t* x, float scale, int64_t n, Vec acc) {
  alignas(16) int8_t part[kInt16Block];
  if (!kWhole) {
    std::memset(part, 0, sizeof part);
    std::memcpy(part, w, size_t(n));
    w = part;
  }
  else
    _mm_prefetch(reinterpret_cast<const char*>(w + kPrefetchBytes), _MM_HINT_T0);
  __m256i s = _mm256_setzero_si256();
  for (int c = 0; c < 4; ++c)
    s = int16_products(s, _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + 16 * c))),
                       x + 16 * c);
  return _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_set1_ps(scale), acc);
}
#endif

#ifdef OFFGRAPH_KV_WIDE_ROWS
// Weight rows dequantized to bf16 for wide steps (wide_rows.h), as torchao's dequantize computes them:
// the value times its scale in fp32, then rounded to bf16.
OFFGRAPH_KV_BF16_TARGET inline void int8_bf16_row(const int8_t* q, int64_t k, float scale, uint16_t* out) {
  const __m512 s = _mm512_set1_ps(scale);
  for (int64_t i = 0; i < k; i += 16) {
    const __mmask16 m = k - i >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (k - i)) - 1);
    const __m512 v = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(m, q + i)));
    offgraph_kv_native::bf16_store(out + i, _mm512_mul_ps(v, s), m);
  }
}

// One int4 group (its `half` bytes: inputs j in the low nibbles, j + half in the high ones).
OFFGRAPH_KV_BF16_TARGET inline void int4_bf16_group(
    const uint8_t* p, int64_t half, int32_t offset, float scale, uint16_t* out) {
  const __m512 s = _mm512_set1_ps(scale);
  const __m512i off = _mm512_set1_epi32(offset), low = _mm512_set1_epi32(15);
  for (int64_t i = 0; i < half; i += 16) {
    const __mmask16 m = half - i >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (half - i)) - 1);
    const __m512i b = _mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(m, p + i));
    const __m512 lo = _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_and_si512(b, low), off));
    const __m512 hi = _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_srli_epi32(b, 4), off));
    offgraph_kv_native::bf16_store(out + i, _mm512_mul_ps(lo, s), m);
    offgraph_kv_native::bf16_store(out + half + i, _mm512_mul_ps(hi, s), m);
  }
}
#endif

template <typename S>
struct Int8Rows {  // int8 weights [N, K], one scale per output row
  Dense<int8_t> q;
  const S* scale;

  bool takes_bf16_quads() const { return false; }
  bool takes_int16_blocks() const {
#ifdef OFFGRAPH_KV_INT16_BLOCKS
    return true;
#else
    return false;
#endif
  }
  // The dequantization costs the GEMM its lead below 16 rows (8: int8 as fast, int4 0.75x the
  // per-row paths' speed; 16: 1.8-1.9x; 64: 2.9-3.2x).
  bool takes_wide() const { return true; }
  int64_t wide_from_rows() const { return 16; }
#ifdef OFFGRAPH_KV_WIDE_ROWS
  const uint16_t* bf16_rows(int64_t n0, int64_t count, uint16_t* out) const {
    for (int64_t j = 0; j < count; ++j) int8_bf16_row(q.w + (n0 + j) * q.k, q.k, widen(scale[n0 + j]), out + j * q.k);
    return out;
  }
#endif

  template <int B>
  void dots(int64_t n, const Row& row, float* out) const {
#ifdef OFFGRAPH_KV_INT16_BLOCKS
    if (row.int16) {
      // the B rows one after another, their horizontal sums together (as Dense)
      Vec sums[B];
      const int64_t k = q.k;
      for (int b = 0; b < B; ++b) {
        const int8_t* w = q.w + (n + b) * k;
        Vec acc = vzero(), other = vzero();  // two chains
        int64_t i = 0;
        for (; i + 2 * kInt16Block <= k; i += 2 * kInt16Block) {
          acc = int16_block<true>(w + i, row.int16 + i, row.int16_scales[i / kInt16Block], kInt16Block, acc);
          other = int16_block<true>(w + i + kInt16Block, row.int16 + i + kInt16Block,
                                    row.int16_scales[i / kInt16Block + 1], kInt16Block, other);
        }
        for (; i + kInt16Block <= k; i += kInt16Block)
          acc = int16_block<true>(w + i, row.int16 + i, row.int16_scales[i / kInt16Block], kInt16Block, acc);
        if (i < k) acc = int16_block<false>(w + i, row.int16 + i, row.int16_scales[i / kInt16Block], k - i, acc);
        sums[b] = vadd(acc, other);
      }
      horizontal_sums<B>(sums, out);
    } else
#endif
    q.template dots<B>(n, row, out);
    for (int b = 0; b < B; ++b) out[b] *= widen(scale[n + b]);
  }
};

// bf16 activations against int4 groups of 32 with the AVX-512 bf16 dot product (vdpbf16ps: a pair
// of products a lane, fp32 sums). A nibble n becomes the bf16 of 16 + n by bit operations alone
// (exponent 2^4, mantissa n << 3: 0x4180 | n << 3), so the products are exact; a group's dot is then
// dot(x, n - 8) + 24 * sum(x), and the first dot product of each pass starts from -24 * sum(x)
// (Row::quad_offsets). Its fp32 sums carry at most ~4x the rounding of a direct dot (|16 + n| <= 31 against
// |n - 8| <= 8), far below the bf16 output's.
// Four groups a pass, one per 128-bit lane: 64 packed bytes split into low and high nibbles, the
// bytes widened to bf16 words by in-lane unpacks with the constant high byte 0x41, four dot-product
// instructions, one scale vector (a group's scale in its lane's four floats). The activations are
// laid out once per row in the unpacks' order (quad_bf16). On an AMD EPYC (Zen 4) a SmolLM2 step's
// int4 linears from memory took 0.45-0.55x the fp32 path's time (`benchmarks/cpu/native/run.sh
// decode_linear_from_memory`).
#if defined(__AVX512F__) && defined(__GNUC__)
#define OFFGRAPH_KV_BF16_DOTS 1
constexpr int64_t kQuadGroup = 32;                 // the group width the bf16 path takes
// The bf16 path asks for each row's bytes 8 KB ahead into L2, as 16-bit rows do (Dense): from memory
// a SmolLM2 step's int4 linears took 0.035 ns a weight this way against 0.040 with kPrefetchBytes
// into L1 (1 KB: 0.045; 4 KB: 0.038; 12-32 KB: 0.036-0.038; AMD EPYC Zen 4, medians of 4 runs in turns).
constexpr int64_t kQuadPrefetchBytes = dense_prefetch_bytes<Bf16>();
constexpr int64_t kQuadWords = 4 * kQuadGroup;     // activations a pass (four groups)
constexpr int64_t kQuadFloats = 16;                // the offset's share a pass, one per fp32 lane
constexpr float kNibbleOffset = 24.f;              // (16 + n) - (n - 8)

inline bool has_bf16_dots() {
  static const bool cpu = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512bf16") != 0;
  }();
  return cpu;
}

inline int64_t quads(int64_t groups) { return (groups + 3) / 4; }

// Row::bf16_quads from a bf16 row of `groups` groups of 32 and their fp32 sums: per pass (groups
// 4q .. 4q+3, group 4q+L in lane L), the activations as four registers of words, register c lane L
// holding inputs 8c .. 8c+7 of group 4q+L; then 16 floats, lane L's four each -24 * sum / 4 (the four
// lanes are summed in the end). Groups past the last: zeros.
template <typename X>
void quad_bf16(const X* x, int64_t x_col, int64_t groups, const float* sums, uint16_t* words, float* offsets) {
  for (int64_t q = 0; q < quads(groups); ++q, words += kQuadWords, offsets += kQuadFloats)
    for (int64_t lane = 0; lane < 4; ++lane) {
      const int64_t g = 4 * q + lane;
      for (int64_t c = 0; c < 4; ++c)
        for (int64_t j = 0; j < 8; ++j) {
          const int64_t i = g * kQuadGroup + 8 * c + j;
          words[c * 32 + lane * 8 + j] = g < groups ? reinterpret_cast<const uint16_t&>(x[i * x_col]) : 0;
        }
      for (int64_t f = 0; f < 4; ++f) offsets[lane * 4 + f] = g < groups ? -kNibbleOffset * sums[g] / 4 : 0.f;
    }
}

// The scales of `n` <= 4 groups, group i's in lane i's four floats (in registers: a vector load
// after scalar stores stalls on store forwarding, which took 40 % of the time here).
inline __m128 four_scales(const Bf16* s) {
  return _mm_castsi128_ps(_mm_slli_epi32(_mm_cvtepu16_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(s))), 16));
}
inline __m128 four_scales(const float* s) { return _mm_loadu_ps(s); }
inline __m128 four_scales(const Half* s) { return _mm_setr_ps(widen(s[0]), widen(s[1]), widen(s[2]), widen(s[3])); }
OFFGRAPH_KV_BF16_TARGET inline __m512 quad_scales(const Bf16* s, int64_t n) {
  const __m512i four = _mm512_broadcastq_epi64(n == 4 ? _mm_loadl_epi64(reinterpret_cast<const __m128i*>(s))
                                                       : _mm_maskz_loadu_epi16(__mmask8((1u << n) - 1), s));
  // the four in every lane, then lane L's dwords take bytes 2L, 2L + 1 as their high half, zeros
  // below: two instructions where the widening and a cross-lane permute took four
  const __m512i pick = _mm512_set_epi32(0x0706FFFF, 0x0706FFFF, 0x0706FFFF, 0x0706FFFF, 0x0504FFFF, 0x0504FFFF,
                                        0x0504FFFF, 0x0504FFFF, 0x0302FFFF, 0x0302FFFF, 0x0302FFFF, 0x0302FFFF,
                                        0x0100FFFF, 0x0100FFFF, 0x0100FFFF, 0x0100FFFF);
  return _mm512_castsi512_ps(_mm512_shuffle_epi8(four, pick));
}
template <typename S>
OFFGRAPH_KV_BF16_TARGET inline __m512 quad_scales(const S* s, int64_t n) {
  const __m128 four = n == 4 ? four_scales(s)
                             : _mm_setr_ps(widen(s[0]), n > 1 ? widen(s[1]) : 0.f, n > 2 ? widen(s[2]) : 0.f, 0.f);
  const __m512i lanes = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
  return _mm512_permutexvar_ps(lanes, _mm512_castps128_ps512(four));
}

// A pass's vector operations at two widths: 512 bits (up to four groups, one per 128-bit lane) and
// 256 bits (lanes 0-1, the registers' low halves: rows of 576 inputs, 18 groups, end with one or two
// groups, and a half-width pass costs half a 512-bit one on Zen 4). The layouts of Row::bf16_quads
// and the packed bytes are lane-wise, so a 256-bit load reads the first two groups' share.
struct Lanes4 {
  using I = __m512i;
  using F = __m512;
  static constexpr int64_t kGroups = 4;
  OFFGRAPH_KV_BF16_TARGET static I splat(char c) { return _mm512_set1_epi8(c); }
  OFFGRAPH_KV_BF16_TARGET static I words(const uint16_t* x) { return _mm512_loadu_si512(x); }
  OFFGRAPH_KV_BF16_TARGET static F floats(const float* x) { return _mm512_loadu_ps(x); }
  OFFGRAPH_KV_BF16_TARGET static I bytes(const uint8_t* p) { return _mm512_loadu_si512(p); }
  OFFGRAPH_KV_BF16_TARGET static I bytes(const uint8_t* p, int64_t groups) {
    return _mm512_maskz_loadu_epi8((__mmask64(1) << (groups * kQuadGroup / 2)) - 1, p);
  }
  OFFGRAPH_KV_BF16_TARGET static I shl3(I b) { return _mm512_slli_epi16(b, 3); }
  OFFGRAPH_KV_BF16_TARGET static I shr1(I b) { return _mm512_srli_epi16(b, 1); }
  OFFGRAPH_KV_BF16_TARGET static I select(I a, I m, I c) { return _mm512_ternarylogic_epi32(a, m, c, 0xEA); }
  OFFGRAPH_KV_BF16_TARGET static I unpacklo(I a, I b) { return _mm512_unpacklo_epi8(a, b); }
  OFFGRAPH_KV_BF16_TARGET static I unpackhi(I a, I b) { return _mm512_unpackhi_epi8(a, b); }
  OFFGRAPH_KV_BF16_TARGET static F zero() { return _mm512_setzero_ps(); }
  OFFGRAPH_KV_BF16_TARGET static F dot(F acc, I w, I x) { return _mm512_dpbf16_ps(acc, (__m512bh)w, (__m512bh)x); }
  OFFGRAPH_KV_BF16_TARGET static F add(F a, F b) { return _mm512_add_ps(a, b); }
  OFFGRAPH_KV_BF16_TARGET static __m512 add_scaled(__m512 acc, F dots, __m512 scales) {
    return _mm512_fmadd_ps(dots, scales, acc);
  }
};
struct Lanes2 {
  using I = __m256i;
  using F = __m256;
  static constexpr int64_t kGroups = 2;
  OFFGRAPH_KV_BF16_TARGET static I splat(char c) { return _mm256_set1_epi8(c); }
  OFFGRAPH_KV_BF16_TARGET static I words(const uint16_t* x) { return _mm256_loadu_si256(reinterpret_cast<const I*>(x)); }
  OFFGRAPH_KV_BF16_TARGET static F floats(const float* x) { return _mm256_loadu_ps(x); }
  OFFGRAPH_KV_BF16_TARGET static I bytes(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const I*>(p)); }
  OFFGRAPH_KV_BF16_TARGET static I bytes(const uint8_t* p, int64_t groups) {
    return _mm256_maskz_loadu_epi8(__mmask32((uint64_t(1) << (groups * kQuadGroup / 2)) - 1), p);
  }
  OFFGRAPH_KV_BF16_TARGET static I shl3(I b) { return _mm256_slli_epi16(b, 3); }
  OFFGRAPH_KV_BF16_TARGET static I shr1(I b) { return _mm256_srli_epi16(b, 1); }
  OFFGRAPH_KV_BF16_TARGET static I select(I a, I m, I c) { return _mm256_ternarylogic_epi32(a, m, c, 0xEA); }
  OFFGRAPH_KV_BF16_TARGET static I unpacklo(I a, I b) { return _mm256_unpacklo_epi8(a, b); }
  OFFGRAPH_KV_BF16_TARGET static I unpackhi(I a, I b) { return _mm256_unpackhi_epi8(a, b); }
  OFFGRAPH_KV_BF16_TARGET static F zero() { return _mm256_setzero_ps(); }
  OFFGRAPH_KV_BF16_TARGET static F dot(F acc, I w, I x) { return _mm256_dpbf16_ps(acc, (__m256bh)w, (__m256bh)x); }
  OFFGRAPH_KV_BF16_TARGET static F add(F a, F b) { return _mm256_add_ps(a, b); }
  OFFGRAPH_KV_BF16_TARGET static __m512 add_scaled(__m512 acc, F dots, __m512 scales) {
    return _mm512_add_ps(acc, _mm512_zextps256_ps512(_mm256_mul_ps(dots, _mm512_castps512_ps256(scales))));
  }
};

// One pass (V::kGroups groups) of R rows into acc; a last pass of `here` groups (Full false) reads
// zero bytes past them, against zero activations, offsets and scales. Full passes are their own
// loop, without a branch on `here` per row. With the offsets folded into the first dot, the scales'
// two instructions and the 256-bit last pass, a SmolLM2 step's int4 linears in cache took 0.025 ns a
// weight against 0.030 before.
template <typename V, int R, bool Full, typename S>
OFFGRAPH_KV_BF16_TARGET inline void int4_bf16_pass(const uint8_t* __restrict p, int64_t row_bytes,
                                                   const S* __restrict scale, int64_t groups,
                                                   const uint16_t* __restrict xw, const float* __restrict xo,
                                                   int64_t here, __m512* acc) {
  using I = typename V::I;
  using F = typename V::F;
  const I mantissa = V::splat(0x78), high = V::splat(0x41), top = V::splat(char(0x80));
  const I x0 = V::words(xw), x1 = V::words(xw + 32), x2 = V::words(xw + 64), x3 = V::words(xw + 96);
  const F offsets = V::floats(xo);
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) {
    const uint8_t* pr = p + r * row_bytes;
    _mm_prefetch(reinterpret_cast<const char*>(pr + kQuadPrefetchBytes), _MM_HINT_T1);
    const I b = Full ? V::bytes(pr) : V::bytes(pr, here);
    // low bytes of the words: 0x80 | n << 3 (0xEA: (a & b) | c)
    const I lo = V::select(V::shl3(b), mantissa, top), hi = V::select(V::shr1(b), mantissa, top);
    F t = V::dot(offsets, V::unpacklo(lo, high), x0);
    F u = V::dot(V::zero(), V::unpackhi(lo, high), x1);
    t = V::dot(t, V::unpacklo(hi, high), x2);
    u = V::dot(u, V::unpackhi(hi, high), x3);
    acc[r] = V::add_scaled(acc[r], V::add(t, u), quad_scales(scale + r * groups, Full ? V::kGroups : here));
  }
}

// The dots of R consecutive rows (`p`: the first's packed groups, `scale` its scales; R <= 4) with
// one row of activations (xw / xo, quad_bf16) into out[0..R). The rows share each pass's activation
// loads, and one transposing sum ends all four: on rows as short as SmolLM2's (576 inputs, 4.5
// passes), one row at a time spent ~40 % of its time on the horizontal sum and the per-row work.
template <int R, typename S>
OFFGRAPH_KV_BF16_TARGET void int4_bf16_dots(
    const uint8_t* __restrict p, const S* __restrict scale, const uint16_t* __restrict xw,
    const float* __restrict xo, int64_t groups, float* out) {
  const int64_t row_bytes = groups * kQuadGroup / 2;
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  int64_t g = 0;
  for (; g + 4 <= groups; g += 4, p += 2 * kQuadGroup, xw += kQuadWords, xo += kQuadFloats)
    int4_bf16_pass<Lanes4, R, true>(p, row_bytes, scale + g, groups, xw, xo, 4, acc);
  if (groups - g > Lanes2::kGroups)
    int4_bf16_pass<Lanes4, R, false>(p, row_bytes, scale + g, groups, xw, xo, groups - g, acc);
  else if (g < groups)
    int4_bf16_pass<Lanes2, R, false>(p, row_bytes, scale + g, groups, xw, xo, groups - g, acc);
  horizontal_sums<R>(acc, out);
}
#endif

template <typename S>
struct Int4Groups {  // packed [N, K/G, G/2] uint8 (low nibble: input j, high: j + G/2), q + 8 stored
  const uint8_t* packed;
  const S* scale;       // [N, K/G]
  const int8_t* zero;   // [N, K/G] or null (symmetric)
  int64_t groups, half;

  // The stored nibble less this is q - zero: w = (nibble - offset) * scale.
  int32_t offset(int64_t row, int64_t g) const { return 8 + (zero ? int32_t(zero[row * groups + g]) : 0); }

  // The integer path: each 16-input run of a group's halves in one int16 block (groups of 32 or 64).
  bool takes_int16_blocks() const {
#ifdef OFFGRAPH_KV_INT4_INT16_BLOCKS
    return half % 16 == 0 && kInt16Block % (2 * half) == 0;
#else
    return false;
#endif
  }
  bool takes_wide() const { return true; }
  int64_t wide_from_rows() const { return 16; }  // as Int8Rows
#ifdef OFFGRAPH_KV_WIDE_ROWS
  const uint16_t* bf16_rows(int64_t n0, int64_t count, uint16_t* out) const {
    const int64_t k = groups * 2 * half;
    for (int64_t j = 0; j < count; ++j)
      for (int64_t g = 0; g < groups; ++g) {
        const int64_t row = n0 + j;
        int4_bf16_group(packed + (row * groups + g) * half, half, offset(row, g), widen(scale[row * groups + g]),
                        out + j * k + g * 2 * half);
      }
    return out;
  }
#endif
  // Whether the bf16 path serves a bf16 row (prepare then fills Row::bf16_quads).
  bool takes_bf16_quads() const {
#ifdef OFFGRAPH_KV_BF16_DOTS
    return 2 * half == kQuadGroup && has_bf16_dots();
#else
    return false;
#endif
  }

  template <int B>
  void dots(int64_t n, const Row& x, float* out) const {
#ifdef OFFGRAPH_KV_BF16_DOTS
    if (x.bf16_quads) {
      int4_bf16_dots<B>(packed + n * groups * half, scale + n * groups, x.bf16_quads, x.quad_offsets, groups, out);
      for (int b = 0; b < B; ++b) {
        const int64_t row = n + b;
        if (zero)  // the offset took 8 off; the zero point's share, once per group
          for (int64_t g = 0; g < groups; ++g)
            out[b] -= widen(scale[row * groups + g]) * float(zero[row * groups + g]) * x.group_sums[g];
      }
      return;
    }
#endif
#ifdef OFFGRAPH_KV_INT4_INT16_BLOCKS
    if (x.int16) return half == 16 ? int16_dots<B, 16>(n, x, out) : int16_dots<B, 32>(n, x, out);
#endif
#ifdef OFFGRAPH_KV_VECTOR
    if (half % kLanes == 0) return vector_dots<B>(n, x.f, out);
#endif
    for (int b = 0; b < B; ++b) {
      const int64_t row = n + b;
      float total = 0.f;
      for (int64_t g = 0; g < groups; ++g) {
        const float* xlo = x.f + g * 2 * half;
        const float* xhi = xlo + half;
        const uint8_t* p = packed + (row * groups + g) * half;
        float t = 0.f;
        for (int64_t j = 0; j < half; ++j) t += float(p[j] & 15) * xlo[j] + float(p[j] >> 4) * xhi[j];
        // the offset's share, once per group
        total += widen(scale[row * groups + g]) * (t - float(offset(row, g)) * x.group_sums[g]);
      }
      out[b] = total;
    }
  }

#ifdef OFFGRAPH_KV_INT4_INT16_BLOCKS
  // The stored nibbles against the row's int16 blocks (vpmaddwd: exact int32 sums, a group's within one
  // block), each group's sum meeting its scale times its block's in fp32. Those products and the
  // offset's share (offset x scale x the group's int16 sum x its block's scale) come first for a piece
  // of groups at a time, in loops of their own (per group in the main loop they were scalar work
  // beside its dozen vector instructions). The B rows side by side: they share each group's
  // activation loads and loop, which on rows as short as SmolLM2's (18 groups) cost as much as the
  // products.
  template <int B, int64_t H>  // H: half, as a constant (the inner loops unrolled)
  void int16_dots(int64_t n, const Row& x, float* out) const {
    constexpr int64_t kPiece = 32;
    const __m256i nibble = _mm256_set1_epi16(15);
    alignas(32) float scales[B][kPiece];
    Vec acc[B];
    float offsets[B];
    for (int b = 0; b < B; ++b) acc[b] = vzero(), offsets[b] = 0.f;
    for (int64_t g0 = 0; g0 < groups; g0 += kPiece) {
      const int64_t m = std::min(kPiece, groups - g0);
      for (int b = 0; b < B; ++b) {
        const int64_t row = n + b;
        const S* sw = scale + row * groups + g0;
        float off = 0.f;
        for (int64_t i = 0; i < m; ++i) {
          scales[b][i] = widen(sw[i]) * x.int16_scales[(g0 + i) * 2 * H / kInt16Block];
          off += widen(sw[i]) * float(offset(row, g0 + i)) * x.int16_group_offsets[g0 + i];
        }
        offsets[b] += off;
      }
      for (int64_t i = 0; i < m; ++i) {
        const int64_t g = g0 + i;
        const int16_t* xlo = x.int16 + g * 2 * H;
        __m256i t[B];
        for (int b = 0; b < B; ++b) t[b] = _mm256_setzero_si256();
        for (int64_t j = 0; j < H; j += 16) {
          const __m256i lo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xlo + j));
          const __m256i hi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xlo + H + j));
#pragma GCC unroll 4
          for (int b = 0; b < B; ++b) {
            const uint8_t* p = packed + ((n + b) * groups + g) * H + j;
            if (j == 0 && (g * H) % 64 == 0) _mm_prefetch(reinterpret_cast<const char*>(p + kPrefetchBytes), _MM_HINT_T0);
            const __m256i v = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
            t[b] = _mm256_add_epi32(t[b], _mm256_add_epi32(_mm256_madd_epi16(_mm256_and_si256(v, nibble), lo),
                                                           _mm256_madd_epi16(_mm256_srli_epi16(v, 4), hi)));
          }
        }
#pragma GCC unroll 4
        for (int b = 0; b < B; ++b) acc[b] = vfma(_mm256_cvtepi32_ps(t[b]), _mm256_broadcast_ss(scales[b] + i), acc[b]);
      }
    }
    horizontal_sums<B>(acc, out);
    for (int b = 0; b < B; ++b) out[b] -= offsets[b];
  }
#endif

#ifdef OFFGRAPH_KV_VECTOR
  // Whole groups of vectors: the offset taken off in integers, each group's dot scaled into one of
  // U accumulators in turn, so that consecutive groups do not wait on each other.
  template <int B>
  void vector_dots(int64_t n, const float* __restrict xf, float* out) const {
    if (B > 1 && !rows_side_by_side()) {  // as Dense: one row after another there
      for (int b = 0; b < B; ++b) vector_dots<1>(n + b, xf, out + b);
      return;
    }
    constexpr int U = chains_per_output<B>();
    Vec acc[B][U];
    for (int b = 0; b < B; ++b)
      for (int u = 0; u < U; ++u) acc[b][u] = vzero();
    auto group = [&](int64_t g, int b, Vec& into) {
      const int64_t row = n + b;
      const float* __restrict xlo = xf + g * 2 * half;
      const float* __restrict xhi = xlo + half;
      const uint8_t* p = packed + (row * groups + g) * half;
      const int32_t o = offset(row, g);
      Vec lo, hi;
      vnibbles(p, o, &lo, &hi);
      Vec t = vfma(hi, vload(xhi), vmul(lo, vload(xlo)));
      for (int64_t j = kLanes; j < half; j += kLanes) {
        vnibbles(p + j, o, &lo, &hi);
        t = vfma(hi, vload(xhi + j), vfma(lo, vload(xlo + j), t));
      }
      into = vfma(t, vset(widen(scale[row * groups + g])), into);
    };
    int64_t g = 0;
    for (; g + U <= groups; g += U)
#pragma GCC unroll 4  // whole: the accumulators stay in registers
      for (int u = 0; u < U; ++u)
#pragma GCC unroll 4
        for (int b = 0; b < B; ++b) group(g + u, b, acc[b][u]);
    for (; g < groups; ++g)
      for (int b = 0; b < B; ++b) group(g, b, acc[b][0]);
    for (int b = 0; b < B; ++b) {
      for (int u = 1; u < U; ++u) acc[b][0] = vadd(acc[b][0], acc[b][u]);
      out[b] = vsum(acc[b][0]);
    }
  }
#endif
};

// ----------------------------------------------------------------------------
// Rows of activations in, rows of outputs out
// ----------------------------------------------------------------------------

// The activations of all a call's rows, in every form the format reads (Row), prepared once.
struct Rows {
  std::vector<float> f, group_sums, quad_offsets, int16_scales, int16_group_offsets;
  std::vector<uint16_t> quad_words;
  std::vector<int16_t> int16;
  std::vector<char> finite;  // per row: all its values are (else the fp32 path carries Inf / NaN through)
  int64_t k = 0, groups = 0, quad_stride = 0, offset_stride = 0, int16_stride = 0, scale_stride = 0;
  // Inlined: called per row and block of outputs (a call of its own showed ~1 % of an int4 decode step).
  __attribute__((always_inline)) Row row(int64_t r) const {
    const bool own = !finite.empty() && finite[r];
    const bool quads = own && !quad_words.empty(), blocks = own && !int16.empty();
    return {f.data() + r * k,
            group_sums.data() + r * groups,
            quads ? quad_words.data() + r * quad_stride : nullptr,
            quads ? quad_offsets.data() + r * offset_stride : nullptr,
            blocks ? int16.data() + r * int16_stride : nullptr,
            blocks ? int16_scales.data() + r * scale_stride : nullptr,
            blocks && groups ? int16_group_offsets.data() + r * groups : nullptr};
  }
};

template <typename X, typename Format>
Rows prepare(const X* x, int64_t x_row, int64_t x_col, int64_t rows, int64_t k, int64_t group, const Format& format) {
  Rows a;
  a.k = k;
  a.groups = group ? k / group : 0;
  a.f.resize(rows * k);
  a.group_sums.resize(rows * a.groups);
  for (int64_t r = 0; r < rows; ++r) {
    float* f = a.f.data() + r * k;
    for (int64_t i = 0; i < k; ++i) f[i] = widen(x[r * x_row + i * x_col]);
    for (int64_t g = 0; g < a.groups; ++g) {
      float s = 0.f;
      for (int64_t i = 0; i < group; ++i) s += f[g * group + i];
      a.group_sums[r * a.groups + g] = s;
    }
  }
  // The bf16 rows' own paths (their values reach the bf16 products unchanged, or the int16 blocks
  // exactly within 2^7 of a block's largest; fp32 or fp16 rows would lose more).
  if (!std::is_same<X, Bf16>::value || !bf16_row_paths()) return a;
  a.finite.resize(rows);
  for (int64_t r = 0; r < rows; ++r)
    a.finite[r] = std::all_of(a.f.begin() + r * k, a.f.begin() + (r + 1) * k, [](float v) { return std::isfinite(v); });
#ifdef OFFGRAPH_KV_BF16_DOTS
  if (format.takes_bf16_quads()) {
    a.quad_stride = quads(a.groups) * kQuadWords;
    a.offset_stride = quads(a.groups) * kQuadFloats;
    a.quad_words.resize(rows * a.quad_stride);
    a.quad_offsets.resize(rows * a.offset_stride);
    for (int64_t r = 0; r < rows; ++r)
      quad_bf16(x + r * x_row, x_col, a.groups, a.group_sums.data() + r * a.groups,
                a.quad_words.data() + r * a.quad_stride, a.quad_offsets.data() + r * a.offset_stride);
  }
#endif
#ifdef OFFGRAPH_KV_INT16_BLOCKS
  if (format.takes_int16_blocks()) {
    a.int16_stride = int16_padded(k);
    a.scale_stride = a.int16_stride / kInt16Block;
    a.int16.resize(rows * a.int16_stride);
    a.int16_scales.resize(rows * a.scale_stride);
    for (int64_t r = 0; r < rows; ++r)
      if (a.finite[r])
        int16_blocks(a.f.data() + r * k, k, a.int16.data() + r * a.int16_stride,
                     a.int16_scales.data() + r * a.scale_stride);
    if (a.groups) {
      a.int16_group_offsets.resize(rows * a.groups);
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t g = 0; g < a.groups; ++g) {
          int32_t sum = 0;  // at most 64 x 2^15: exact in an int32 and in a float
          for (int64_t i = 0; i < group; ++i) sum += a.int16[r * a.int16_stride + g * group + i];
          const float block = a.int16_scales[r * a.scale_stride + g * group / kInt16Block];
          a.int16_group_offsets[r * a.groups + g] = block * float(sum);  // a power of two: exact
        }
    }
  }
#endif
  return a;
}

// Outputs [n0, n1) of every row into dst (row r at dst + r * stride): the one loop over blocks of
// weight rows that every thread count runs.
template <typename X, typename Format>
void rows_block(const Rows& a, const Format& format, int64_t rows, int64_t n0, int64_t n1, X* dst, int64_t stride) {
  float d[kBlockRows];
  int64_t n = n0;
  for (; n + kBlockRows <= n1; n += kBlockRows)
    for (int64_t r = 0; r < rows; ++r) {
      format.template dots<kBlockRows>(n, a.row(r), d);
      for (int64_t b = 0; b < kBlockRows; ++b) from_float(d[b], dst + r * stride + (n - n0) + b);
    }
  for (; n < n1; ++n)
    for (int64_t r = 0; r < rows; ++r) {
      format.template dots<1>(n, a.row(r), d);
      from_float(d[0], dst + r * stride + (n - n0));
    }
}

// A decode linear's chunks of kSharedChunk outputs, for the step's helpers (shared_rows.h). Holds
// its own prepared activations: a helper may still read them after the call has returned.
template <typename X, typename Format>
class SharedLinear final : public offgraph_kv_native::SharedCall {
 public:
  SharedLinear(Rows a, const Format& format, int64_t rows, int64_t outputs, X* y)
      : SharedCall((outputs + kSharedChunk - 1) / kSharedChunk), a_(std::move(a)), format_(format), rows_(rows),
        outputs_(outputs), y_(y) {}
  void compute_into_outputs(int64_t c) override {
    rows_block(a_, format_, rows_, begin(c), end(c), y_ + begin(c), outputs_);
  }
  size_t scratch_bytes() const override { return size_t(rows_ * kSharedChunk) * sizeof(X); }
  void compute_into_scratch(int64_t c, void* scratch) override {
    rows_block(a_, format_, rows_, begin(c), end(c), static_cast<X*>(scratch), kSharedChunk);
  }
  void publish(int64_t c, const void* scratch) override {
    const X* s = static_cast<const X*>(scratch);
    for (int64_t r = 0; r < rows_; ++r)
      std::memcpy(y_ + r * outputs_ + begin(c), s + r * kSharedChunk, size_t(end(c) - begin(c)) * sizeof(X));
  }

 private:
  int64_t begin(int64_t c) const { return c * kSharedChunk; }
  int64_t end(int64_t c) const { return std::min(outputs_, begin(c) + kSharedChunk); }
  const Rows a_;
  const Format format_;
  const int64_t rows_, outputs_;
  X* const y_;
};

// out[r, n] for r < rows, n < outputs. The outputs are split over the threads OpenMP allows (the
// runtime sets one per decode step unless asked otherwise), in blocks of kBlockRows weight rows;
// every row of activations meets a block while its weights are in L1, so a wide step reads the
// weights from memory once, not once per row.
template <typename X, typename Format>
void linear_rows(const X* x, int64_t x_row, int64_t x_col, int64_t rows, int64_t k, int64_t outputs, int64_t group,
                 const Format& format, X* y) {
#ifdef OFFGRAPH_KV_WIDE_ROWS
  if constexpr (std::is_same<X, Bf16>::value) {
    if (rows >= format.wide_from_rows() && k % 2 == 0 && format.takes_wide() && has_bf16_dots() &&
        bf16_row_paths()) {
      offgraph_kv_native::wide_rows(offgraph_kv_native::row_pairs(x, x_row, x_col, rows, k), rows, k, outputs,
                                    [&](int64_t n0, int64_t count, uint16_t* scratch) {
                                      return format.bf16_rows(n0, count, scratch);
                                    },
                                    y);
      return;
    }
  }
#endif
  if (step_helpers > 0 && outputs >= kSharedFrom) {
    offgraph_kv_native::HelperPool::get().run(
        std::make_shared<SharedLinear<X, Format>>(prepare(x, x_row, x_col, rows, k, group, format), format, rows,
                                                  outputs, y),
        step_helpers);
    return;
  }
  const Rows a = prepare(x, x_row, x_col, rows, k, group, format);
  int64_t parts = 1;
#ifdef _OPENMP
  parts = std::max<int64_t>(1, std::min<int64_t>(omp_get_max_threads(), outputs / kOutputsPerThread));
#endif
  const int64_t per = ((outputs + parts - 1) / parts + kBlockRows - 1) / kBlockRows * kBlockRows;
#pragma omp parallel for num_threads(parts) if (parts > 1) schedule(static, 1)
  for (int64_t p = 0; p < parts; ++p) {
    const int64_t begin = std::min(outputs, p * per), end = std::min(outputs, begin + per);
    rows_block(a, format, rows, begin, end, y + begin, outputs);
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

// The output for `x` [.., k] against n weight rows, then every activation
// row through linear_rows over the rows `rows_for` makes: it is called with a
// function to hand its rows to (its own dtype dispatch inside) and returns
// false for a dtype it does not take.
template <typename RowsFor>
AOTITorchError run_linear(AtenTensorHandle x, int64_t k, int64_t n, int64_t group, AtenTensorHandle* ret,
                          RowsFor&& rows_for) {
  View xv;
  AtenTensorHandle out = nullptr;
  void* y = nullptr;
  if (!activations(x, k, n, &xv, &out, &y)) return AOTI_TORCH_FAILURE;
  bool ok = false;
  with_float_type(xv.dtype, [&](auto xt) {
    using X = decltype(xt);
    ok = rows_for([&](const auto& rows) {
      linear_rows(static_cast<const X*>(xv.data), xv.strides[0], xv.strides[1], xv.sizes[0], k, n, group, rows,
                  static_cast<X*>(y));
    });
  });
  return finish(ok, out, ret);
}

AOTITorchError dense_linear(AtenTensorHandle x, AtenTensorHandle w, AtenTensorHandle* ret) {
  View wv;
  if (!view_of(w, 2, &wv) || !contiguous(wv)) return AOTI_TORCH_FAILURE;
  const int64_t n = wv.sizes[0], k = wv.sizes[1];
  return run_linear(x, k, n, 0, ret, [&](auto&& run) {
    return with_float_type(wv.dtype, [&](auto wt) {
      using W = decltype(wt);
      run(Dense<W>{static_cast<const W*>(wv.data), k});
    });
  });
}

AOTITorchError int8_linear(AtenTensorHandle x, AtenTensorHandle q, AtenTensorHandle scale, AtenTensorHandle* ret) {
  View qv, sv;
  if (!view_of(q, 2, &qv) || !contiguous(qv) || qv.dtype != aoti_torch_dtype_int8()) return AOTI_TORCH_FAILURE;
  const int64_t n = qv.sizes[0], k = qv.sizes[1];
  if (!view_of(scale, 1, &sv) || !contiguous(sv) || sv.sizes[0] != n) return AOTI_TORCH_FAILURE;
  return run_linear(x, k, n, 0, ret, [&](auto&& run) {
    return with_float_type(sv.dtype, [&](auto st) {
      using S = decltype(st);
      run(Int8Rows<S>{{static_cast<const int8_t*>(qv.data), k}, static_cast<const S*>(sv.data)});
    });
  });
}

AOTITorchError int4_linear(AtenTensorHandle x, AtenTensorHandle packed, AtenTensorHandle scale,
                           AtenTensorHandle zero, AtenTensorHandle* ret) {
  View pv, sv, zv;
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
  return run_linear(x, k, n, 2 * half, ret, [&](auto&& run) {
    return with_float_type(sv.dtype, [&](auto st) {
      using S = decltype(st);
      run(Int4Groups<S>{static_cast<const uint8_t*>(pv.data), static_cast<const S*>(sv.data), zp, groups, half});
    });
  });
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

// The runtime's face (dlsym'd in the program's library: runtime/src/step_threads.cpp).
// Helper threads this thread's decode linears share their rows with; returns the previous count.
extern "C" __attribute__((visibility("default"))) int offgraph_kv_set_step_helpers(int helpers) {
  const int previous = step_helpers;
  step_helpers = std::max(0, helpers);
  return previous;
}

// Returns once no helper still reads a call's weights (before they are freed).
extern "C" __attribute__((visibility("default"))) void offgraph_kv_quiesce_step_helpers() {
  offgraph_kv_native::HelperPool::get().quiesce();
}

// Chunks the helpers computed and chunks taken back from them, since the process began.
extern "C" __attribute__((visibility("default"))) void offgraph_kv_step_helper_counts(int64_t* helped,
                                                                                      int64_t* taken_back) {
  *helped = offgraph_kv_native::HelperPool::get().helped();
  *taken_back = offgraph_kv_native::HelperPool::get().taken_back();
}

// Tests only: helpers sleep this long after claiming a chunk, as a preempted helper would stall.
extern "C" __attribute__((visibility("default"))) void offgraph_kv_delay_step_helpers_for_tests(int microseconds) {
  offgraph_kv_native::HelperPool::get().delay_helpers_for_tests(microseconds);
}
