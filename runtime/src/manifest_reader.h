// Reads and validates the manifest FlatBuffer (generated from schemas/manifest.fbs).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "input_spec.h"
#include "growth_policy.h"
#include "tensor_spec.h"
#include "status.h"
#include "weights.h"

namespace offgraph_kv {

constexpr uint32_t kManifestVersion = 3;  // 3: weights outside the compiled code
constexpr uint32_t kOldestManifestVersion = 2;  // 2: weights inside the code, still loadable

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
  std::vector<WeightSpec> weights;  // version 3: bound at init (weights.h); version 2: inside the code

  bool weights_outside_code() const { return version >= 3; }

  size_t num_compiled_inputs() const { return num_user_inputs + tensors.size() + (has_length_input ? 1 : 0); }
};

// Verifies the buffer, checks the version and every field; the message names
// the first problem found.
Status read_manifest(const void* data, size_t size, ManifestInfo* out);

// Whether code compiled for `target` ("cpu:<isa>" or "cuda:sm_<NN>", matching
// `device`) can run here; any other string is rejected.
Status check_target(const std::string& target, DeviceKind device);

}  // namespace offgraph_kv
