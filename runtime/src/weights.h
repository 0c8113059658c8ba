// Weights outside the compiled code (manifest version 2; backend/weights.py is
// the export side). The compiled .so holds no constants; each one is named data
// of the program, which ExecuTorch's mmap loaders hand out as read-only views of
// the file. `BoundWeights::bind` checks every constant against the compiled
// code's own table and its bytes against their CRC-32, and gives the container user-managed tensors over that
// memory: on CPU the mapped file itself (no copy), on CUDA one device arena
// filled once from it. That memory is shared by every session of the program in
// the process (SharedWeights); each session binds its own views of it.
#pragma once

#include <executorch/runtime/core/freeable_buffer.h>
#include <executorch/runtime/core/named_data_map.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
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

// The checked bytes of one weight list, shared by every session (delegate
// init) of one program in this process: on CPU views of the mapped file (or
// copies of data the file did not align), on CUDA one device arena. Built by the
// first session, kept by a SharedCache under `weights_share_key`, destroyed
// when the last session's BoundWeights goes. Immutable once built, so sessions
// on any threads read it without a lock.
class SharedWeights {
 public:
  ~SharedWeights();
  SharedWeights(const SharedWeights&) = delete;
  SharedWeights& operator=(const SharedWeights&) = delete;

  // The bytes of the constant `name`, or null if this list does not hold it.
  void* at(const std::string& name) const;
  uint64_t weight_bytes() const { return weight_bytes_; }
  uint64_t copied_bytes() const { return copied_bytes_; }  // host copies (misaligned data) or device bytes
  bool on_device() const { return device_ != nullptr; }

 private:
  friend class BoundWeights;
  SharedWeights() = default;
  class DeviceArena;
  // Checks every weight's bytes in `data` (present, that size, CRC-32 intact)
  // and keeps them: on CPU the data's own views (or aligned copies), on CUDA
  // one arena filled once.
  static std::unique_ptr<SharedWeights> build(const std::vector<const WeightSpec*>& order,
                                              const executorch::runtime::NamedDataMap& data, bool cuda,
                                              Status* status);

  std::vector<executorch::runtime::FreeableBuffer> mapped_;  // CPU: the weights themselves
  std::vector<Buffer> host_copies_;                          // CPU: data the file did not align
  std::unique_ptr<DeviceArena> device_;                      // CUDA: every weight, one allocation
  std::vector<std::pair<std::string, void*>> by_name_;       // sorted by name
  uint64_t weight_bytes_ = 0;
  uint64_t copied_bytes_ = 0;
};

// What the sharing is keyed by: the compiled code's key (which carries its
// SHA-256), where the weights live (`place`: "cpu", "cuda:<device>", or a
// borrowed buffer's address, see weights.cpp) and a SHA-256 of the whole weight
// list (names, data keys, dtypes, sizes, geometry, CRC-32s). Two loads with the
// same key compute with the same bytes.
std::string weights_share_key(const std::string& code_key, const std::vector<WeightSpec>& specs,
                              const std::string& place);

// The shared weights alive in this process (for hosts' metrics and the tests).
struct SharedWeightsInfo {
  std::string key;
  long sessions = 0;
  uint64_t weight_bytes = 0;
  bool on_device = false;
};
std::vector<SharedWeightsInfo> shared_weights_in_use();

// One session's binding of the shared weights into its own container: the
// container's views (tensor handles) are this session's, the memory is shared.
// Destroy it only after the container that reads it.
class BoundWeights {
 public:
  // Checks `specs` against the compiled code's constants (every constant
  // present, same dtype and byte size, none unknown). The first session of a
  // key then checks them against `data` (each key present with that many
  // bytes, CRC-32 intact) and builds the SharedWeights; later sessions of the
  // same key reuse it without reading their own copy of the bytes. Any
  // mismatch is an InvalidProgram status naming the weight.
  static std::unique_ptr<BoundWeights> bind(CompiledProgram& program, const std::string& code_key,
                                            const std::vector<WeightSpec>& specs,
                                            const executorch::runtime::NamedDataMap& data, bool cuda, Status* status);
  ~BoundWeights();
  BoundWeights(const BoundWeights&) = delete;
  BoundWeights& operator=(const BoundWeights&) = delete;

  uint64_t weight_bytes() const { return shared_->weight_bytes(); }
  uint64_t copied_bytes() const { return shared_->copied_bytes(); }
  const std::shared_ptr<SharedWeights>& shared() const { return shared_; }

 private:
  BoundWeights() = default;

  std::shared_ptr<SharedWeights> shared_;  // declared first: outlives the handles that view it
  std::vector<AtenTensorHandle> handles_;  // views handed to this session's container
  DeleteTensorFn delete_tensor_ = nullptr;
};

}  // namespace offgraph_kv
