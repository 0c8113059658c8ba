// Weights outside the compiled code (manifest version 2; backend/weights.py is
// the export side). The compiled .so holds no constants; each one is named data
// of the program, which ExecuTorch's mmap loaders hand out as read-only views of
// the file. `BoundWeights::bind` checks every constant against the compiled
// code's own table and its bytes against their CRC-32, and gives the container user-managed tensors over that
// memory: on CPU the mapped file itself (no copy), on CUDA one device arena
// filled once from it.
#pragma once

#include <executorch/runtime/core/freeable_buffer.h>
#include <executorch/runtime/core/named_data_map.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "aoti_abi.h"
#include "device_memory.h"
#include "status.h"

namespace offgraph_kv {

namespace schema {
struct Manifest;
}

class CompiledProgram;

// One manifest entry: where a constant's bytes are and how the code views them.
struct WeightSpec {
  std::string name;      // the container's constant name
  std::string fqn;       // the model's name, for messages
  std::string data_key;  // named-data key of its storage bytes
  int32_t dtype = 0;     // c10::ScalarType code
  uint64_t nbytes = 0;   // storage bytes
  std::vector<int64_t> sizes;
  std::vector<int64_t> strides;
  int64_t storage_offset = 0;
  uint32_t crc32 = 0;    // zlib's CRC-32 of the bytes
};

// Reads the manifest's weight list, checking each entry's own consistency
// (known dtype, geometry inside its bytes, unique names).
Status read_weight_specs(const schema::Manifest* manifest, std::vector<WeightSpec>* out);

// The memory behind the container's constants, alive as long as the delegate.
// Destroy it only after the container that reads it.
class BoundWeights {
 public:
  // Checks `specs` against the compiled code's constants (every constant
  // present, same dtype and byte size, none unknown) and against `data` (each
  // key present with that many bytes, CRC-32 intact), then binds them. Any mismatch is an
  // InvalidProgram status naming the weight.
  static std::unique_ptr<BoundWeights> bind(CompiledProgram& program, const std::vector<WeightSpec>& specs,
                                            const executorch::runtime::NamedDataMap& data, bool cuda, Status* status);
  ~BoundWeights();
  BoundWeights(const BoundWeights&) = delete;
  BoundWeights& operator=(const BoundWeights&) = delete;

  uint64_t weight_bytes() const { return weight_bytes_; }
  uint64_t copied_bytes() const { return copied_bytes_; }  // host copies (misaligned data) or device bytes

 private:
  BoundWeights() = default;
  class DeviceArena;

  std::vector<executorch::runtime::FreeableBuffer> mapped_;  // CPU: the weights themselves
  std::vector<Buffer> host_copies_;                          // CPU: data the file did not align
  std::unique_ptr<DeviceArena> device_;                      // CUDA: every weight, one allocation
  std::vector<AtenTensorHandle> handles_;                    // views handed to the container
  DeleteTensorFn delete_tensor_ = nullptr;
  uint64_t weight_bytes_ = 0;
  uint64_t copied_bytes_ = 0;
};

}  // namespace offgraph_kv
