// What the compiled code itself takes (manifest.fbs `CompiledInterface`), and
// the load-time check of the manifest against it. The export records it from
// the program AOTInductor compiled, and the code's digest covers it, so a
// manifest edited after export (heads, head dims, dtypes, which input is which)
// is refused at load with the field named, instead of sizing arenas that the
// compiled code then indexes with its own strides.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "status.h"

namespace offgraph_kv {

struct ManifestInfo;

struct CompiledInterfaceInfo {
  struct Input {
    int32_t dtype = 0;           // c10::ScalarType code
    std::vector<int64_t> sizes;  // -1: chosen at run time
  };
  std::vector<Input> inputs;
  uint32_t num_outputs = 0;
  uint32_t width_bound = 0;
  bool weights_in_code = false;
  // The attention reads the length from device memory; flat extents are bounds only (step_graph.h).
  bool lengths_from_device = false;
  // Per layer, the ring window compiled in (0: flat); empty in files that predate it.
  std::vector<uint32_t> ring_windows;
};

// Verifies and reads the interface FlatBuffer nested in the manifest.
Status read_compiled_interface(const uint8_t* data, size_t size, CompiledInterfaceInfo* out);

// Every compiled input the manifest describes (delegate inputs, K/V tensors,
// the length input) against what the code takes; outputs, the width bound and
// where the weights are, too. The message names the first disagreement.
Status check_manifest_against_code(const ManifestInfo& m);

}  // namespace offgraph_kv
