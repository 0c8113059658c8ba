// One private tensor as the manifest describes it: a layer's K or V storage.
// Shared by the manifest reader (which fills it) and the store (which sizes
// and binds storage from it).
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "storage_dtype.h"

namespace offgraph_kv {

enum class LayerKind : int8_t { Flat = 0, Ring = 1 };
enum class TensorRole : int8_t { Key = 0, Value = 1 };

struct TensorSpec {
  uint32_t layer = 0;
  TensorRole role = TensorRole::Key;
  LayerKind kind = LayerKind::Flat;
  uint32_t window = 0;
  uint32_t num_heads = 0;
  uint32_t head_dim = 0;
  StorageDType dtype = StorageDType::BFloat16;
  uint32_t compiled_input = 0;

  size_t row_bytes() const { return size_t(num_heads) * head_dim * element_size(dtype); }
};

// K and V specs of `layers` flat layers, bound from compiled input `first_input` on.
std::vector<TensorSpec> flat_layer_specs(size_t layers, uint32_t heads, uint32_t head_dim, StorageDType dtype,
                                         uint32_t first_input);

}  // namespace offgraph_kv
