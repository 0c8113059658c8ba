// SHA-256 of the compiled code, checked against the digest its named-data key
// carries before the code is written out and loaded: a flipped byte in a .pte
// must be a clear error at load, not different logits or a SIGILL.
#pragma once

#include <cstddef>
#include <string>

#include "status.h"

namespace offgraph_kv {

// Lower-case hex SHA-256 of `size` bytes at `data`.
std::string sha256_hex(const void* data, size_t size);

// Checks that `key` ("offgraph_kv_<32 hex digits>_so", as the backend names the
// code) starts with the SHA-256 of the bytes found under it.
Status verify_code_digest(const std::string& key, const void* code, size_t size);

}  // namespace offgraph_kv
