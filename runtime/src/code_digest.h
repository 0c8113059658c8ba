// SHA-256 of the compiled code, checked against the digest its named-data key
// carries before the code is written out and loaded: a flipped byte in a .pte
// must be a clear error at load, not different logits or a SIGILL.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "status.h"

namespace offgraph_kv {

// Incremental SHA-256 (FIPS 180-4): the digest of everything passed to update.
class Sha256 {
 public:
  Sha256();
  void update(const void* data, size_t size);
  std::string hex();  // lower-case hex; call once

 private:
  uint32_t state_[8];
  uint8_t block_[64] = {};
  size_t buffered_ = 0;
  uint64_t total_ = 0;
};

// Lower-case hex SHA-256 of `size` bytes at `data`.
std::string sha256_hex(const void* data, size_t size);

// Checks that `key` ("offgraph_kv_<32 hex digits>_so", as the backend names the
// code) starts with the SHA-256 of the code followed by its compiled-interface
// bytes (the manifest's description of what the code takes).
Status verify_code_digest(const std::string& key, const void* code, size_t size, const std::vector<uint8_t>& interface);

}  // namespace offgraph_kv
