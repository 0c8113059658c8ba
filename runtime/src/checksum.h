// Checksums against accidental damage (a truncated or bit-flipped file): CRC-32
// as zlib computes it, and per-block CRC-32s computed on several threads so a
// large buffer is checked at memory speed. Not a defence against a crafted
// file: whatever a checked buffer holds is still validated structurally by its
// reader. The compiled code, which runs, has a SHA-256 instead (code_digest.h).
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace offgraph_kv {

// zlib's crc32(0, data, n).
uint32_t crc32(const void* data, size_t n);

// The CRC-32 of each `block`-byte piece of [data, data + n) (the last may be
// shorter; none when n is 0), on up to 8 threads.
std::vector<uint32_t> block_crc32(const void* data, size_t n, size_t block);

}  // namespace offgraph_kv
