// The growth copy kernel: blockIdx.y picks a segment, the x blocks stride over
// its 16-byte words. Arena regions are 256-byte aligned, so the 16-byte body
// covers nearly everything; an unaligned segment (or a ragged tail) is copied
// byte by byte by the same threads.
#include "segment_copy.h"

#include <algorithm>
#include <atomic>
#include <cstdint>

namespace offgraph_kv {
namespace {

// Kernel parameters are passed by value (4 KiB limit): segments go in batches.
constexpr int kMaxSegments = 96;
constexpr int kThreads = 256;
constexpr int kUnroll = 4;  // independent loads in flight per thread

struct Segment {
  char* dst;
  const char* src;
  unsigned long long bytes;
};

struct Batch {
  Segment seg[kMaxSegments];
};

__global__ void copy_segments(Batch batch) {
  const Segment s = batch.seg[blockIdx.y];
  const unsigned long long stride = static_cast<unsigned long long>(gridDim.x) * blockDim.x;
  const unsigned long long first = static_cast<unsigned long long>(blockIdx.x) * blockDim.x + threadIdx.x;
  const bool aligned = ((reinterpret_cast<uintptr_t>(s.dst) | reinterpret_cast<uintptr_t>(s.src)) & 15) == 0;
  const unsigned long long words = aligned ? s.bytes / 16 : 0;
  const uint4* src = reinterpret_cast<const uint4*>(s.src);
  uint4* dst = reinterpret_cast<uint4*>(s.dst);
  unsigned long long i = first;
  for (; i + (kUnroll - 1) * stride < words; i += kUnroll * stride) {
    uint4 v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) v[u] = src[i + u * stride];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) dst[i + u * stride] = v[u];
  }
  for (; i < words; i += stride) dst[i] = src[i];
  for (unsigned long long b = words * 16 + first; b < s.bytes; b += stride) s.dst[b] = s.src[b];
}

int multiprocessors() {
  static const int count = [] {
    int device = 0, n = 0;
    if (cudaGetDevice(&device) != cudaSuccess ||
        cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, device) != cudaSuccess)
      n = 0;
    return n > 0 ? n : 108;
  }();
  return count;
}

// Two waves of resident blocks (8 fit per multiprocessor): in two sweeps on
// the H200 (benchmarks/results/cuda_h200.md) 12 and more blocks per
// multiprocessor copied at 0.94-0.99 of one memcpy, 2 to 8 at 0.89-0.96.
constexpr int kDefaultBlocksPerSM = 16;
std::atomic<int> g_blocks_per_sm{kDefaultBlocksPerSM};

}  // namespace

bool segment_copy_available() { return true; }

int set_segment_copy_blocks_per_sm(int blocks) {
  g_blocks_per_sm = blocks > 0 ? blocks : kDefaultBlocksPerSM;
  return g_blocks_per_sm;
}

int segment_copy_resident_blocks_per_sm() {
  int n = 0;
  return cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, copy_segments, kThreads, 0) == cudaSuccess ? n : 0;
}

cudaError_t segment_copy(const std::vector<CopyOp>& copies, cudaStream_t stream) {
  for (size_t start = 0; start < copies.size(); start += kMaxSegments) {
    const size_t n = std::min<size_t>(kMaxSegments, copies.size() - start);
    Batch batch{};
    unsigned long long largest = 0;
    for (size_t j = 0; j < n; ++j) {
      const CopyOp& c = copies[start + j];
      batch.seg[j] = {static_cast<char*>(c.dst), static_cast<const char*>(c.src), c.bytes};
      largest = std::max<unsigned long long>(largest, c.bytes);
    }
    if (largest == 0) continue;
    // Enough blocks to fill the device several times over, spread across the
    // segments, but never more than the largest segment has work for.
    const unsigned long long per_block = static_cast<unsigned long long>(kThreads) * 16 * kUnroll;
    const unsigned long long wanted =
        (static_cast<unsigned long long>(g_blocks_per_sm.load()) * multiprocessors() + n - 1) / n;
    const unsigned long long needed = (largest + per_block - 1) / per_block;
    const unsigned int blocks_x = static_cast<unsigned int>(std::max(1ULL, std::min(wanted, needed)));
    copy_segments<<<dim3(blocks_x, static_cast<unsigned int>(n)), kThreads, 0, stream>>>(batch);
    const cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess) return e;
  }
  return cudaSuccess;
}

}  // namespace offgraph_kv
