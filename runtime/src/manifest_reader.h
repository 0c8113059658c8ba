// Reads and validates the manifest FlatBuffer (generated from schemas/manifest.fbs).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "code_interface.h"
#include "input_spec.h"
#include "growth_policy.h"
#include "tensor_spec.h"
#include "status.h"
#include "weights.h"

namespace offgraph_kv {

constexpr uint32_t kManifestVersion = 4;        // 4: the compiled interface, checked at load
constexpr uint32_t kOldestManifestVersion = 4;  // earlier ones lack it: re-export

enum class DeviceKind : int8_t { CPU = 0, CUDA = 1 };

struct ManifestInfo {
  uint32_t version = 0;
  DeviceKind device = DeviceKind::CPU;
  std::string target;
  uint32_t batch = 1;
  uint32_t num_user_inputs = 0;
  uint32_t num_outputs = 0;
  uint32_t max_write = 0;
  uint64_t capacity_bound = 0;
  GrowthPolicy defaults;
  std::string compiled_code_key;
  std::vector<TensorSpec> tensors;
  bool has_length_input = false;  // rings read the committed length from it
  uint32_t length_input = 0;
  std::vector<InputSpec> inputs;  // the delegate inputs, in the order of execute's args
  uint32_t width_bound = 0;       // export bound of the step width (>= max_write)
  std::vector<WeightSpec> weights;  // bound at init (weights.h), unless the code packages its constants
  CompiledInterfaceInfo code;       // what the compiled code takes (code_interface.h)
  std::vector<uint8_t> code_interface_bytes;  // covered by the code's digest with the code

  bool weights_outside_code() const { return !code.weights_in_code; }

  size_t num_compiled_inputs() const { return num_user_inputs + tensors.size() + (has_length_input ? 1 : 0); }
};

// Verifies the buffer, checks the version and every field, and checks the
// manifest against the compiled interface it carries; the message names the
// first problem found. (The interface itself is trusted once the code's digest,
// which covers it, is verified at load.)
Status read_manifest(const void* data, size_t size, ManifestInfo* out);

// Whether code compiled for `target` ("cpu:<isa>" or "cuda:sm_<NN>", matching
// `device`) can run here; any other string is rejected.
Status check_target(const std::string& target, DeviceKind device);

}  // namespace offgraph_kv
