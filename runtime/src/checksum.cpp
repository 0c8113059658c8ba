#include "checksum.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <thread>

namespace offgraph_kv {

namespace {

// CRC-32 as zlib computes it (reflected 0xEDB88320), eight bytes per step from
// eight tables: about a byte per cycle, so checking a weight costs about what
// reading it from memory does.
struct Crc32Tables {
  uint32_t t[8][256];
  Crc32Tables() {
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ 0xEDB88320u : c >> 1;
      t[0][i] = c;
    }
    for (uint32_t i = 0; i < 256; ++i)
      for (int s = 1; s < 8; ++s) t[s][i] = (t[s - 1][i] >> 8) ^ t[0][t[s - 1][i] & 0xff];
  }
};

}  // namespace

uint32_t crc32(const void* data, size_t n) {
  static const Crc32Tables tables;
  const auto& t = tables.t;
  const uint8_t* p = static_cast<const uint8_t*>(data);
  uint32_t c = 0xFFFFFFFFu;
  for (; n > 0 && (reinterpret_cast<uintptr_t>(p) & 7) != 0; --n) c = t[0][(c ^ *p++) & 0xff] ^ (c >> 8);
  for (; n >= 8; n -= 8, p += 8) {
    uint64_t v;
    std::memcpy(&v, p, 8);
    v ^= c;  // little-endian: the CRC meets the first four bytes
    c = t[7][v & 0xff] ^ t[6][(v >> 8) & 0xff] ^ t[5][(v >> 16) & 0xff] ^ t[4][(v >> 24) & 0xff] ^
        t[3][(v >> 32) & 0xff] ^ t[2][(v >> 40) & 0xff] ^ t[1][(v >> 48) & 0xff] ^ t[0][v >> 56];
  }
  for (; n > 0; --n) c = t[0][(c ^ *p++) & 0xff] ^ (c >> 8);
  return ~c;
}

std::vector<uint32_t> block_crc32(const void* data, size_t n, size_t block) {
  const char* p = static_cast<const char*>(data);
  std::vector<uint32_t> crcs(block == 0 ? 0 : (n + block - 1) / block);
  std::atomic<size_t> next{0};
  auto work = [&]() {
    for (size_t i = next++; i < crcs.size(); i = next++) crcs[i] = crc32(p + i * block, std::min(block, n - i * block));
  };
  const unsigned hw = std::max(1u, std::min(8u, std::thread::hardware_concurrency()));
  std::vector<std::thread> threads;
  for (unsigned k = 1; k < hw && k < crcs.size(); ++k) threads.emplace_back(work);
  work();
  for (std::thread& th : threads) th.join();
  return crcs;
}

}  // namespace offgraph_kv
