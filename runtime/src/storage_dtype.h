// Storage dtype of the KV tensors: every size, pitch and descriptor derives
// from it, never from a hard-coded element size.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace offgraph_kv {

enum class StorageDType : int8_t { Float32 = 0, Float16 = 1, BFloat16 = 2 };

inline size_t element_size(StorageDType d) {
  return d == StorageDType::Float32 ? 4 : 2;
}

inline const char* dtype_name(StorageDType d) {
  switch (d) {
    case StorageDType::Float32: return "fp32";
    case StorageDType::Float16: return "fp16";
    case StorageDType::BFloat16: return "bf16";
  }
  return "unknown";
}

// The dtypes this build can store; a manifest naming another is rejected.
inline bool is_supported(int value) { return value >= 0 && value <= 2; }

}  // namespace offgraph_kv
