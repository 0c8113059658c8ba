// HostRunner: runs a method of a .pte through ExecuTorch's C++ Module (the
// same libexecutorch.so the Python runtime uses), taking and returning plain
// host buffers. It exists because the Python bindings exchange tensors through
// the ATen C++ ABI of the torch they were built against (2.13); with another
// torch in the process (the H200 image's 2.11) that exchange fails before any
// backend runs. Raw pointers, sizes and dtype names cross no C++ ABI.
#pragma once

#include <executorch/extension/module/module.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "status.h"

namespace offgraph_kv {

struct HostTensor {
  std::string dtype;           // torch-style name: "int64", "float32", "bfloat16", ...
  std::vector<int64_t> sizes;
  const void* data = nullptr;  // input: caller's memory; output: valid until the next run
  size_t nbytes = 0;
};

class KVStore;

class HostRunner {
 public:
  // Loads the program and the method (delegate init runs here).
  static std::unique_ptr<HostRunner> load(const std::string& path, const std::string& method, Status* status);
  // A new session of the same method: another Module over this runner's
  // Program (ExecuTorch's Module(shared_ptr<Program>)), so the method is
  // loaded again and its delegate gets its own container and KV store while
  // the compiled code and the weights are shared (weights.h). Each session has
  // its own planned memory, so sessions may run on different threads.
  std::unique_ptr<HostRunner> new_session(Status* status) const;
  // One execution; inputs are dense host tensors. Outputs alias the method's memory.
  Status run(const std::vector<HostTensor>& inputs, std::vector<HostTensor>* outputs);
  // The KV store this runner's method owns (null for a program without this backend).
  const std::shared_ptr<KVStore>& store() const { return store_; }

 private:
  HostRunner(std::shared_ptr<executorch::extension::module::Module> module, std::string method,
             std::shared_ptr<executorch::extension::module::Module> origin);
  Status load_method();
  std::shared_ptr<executorch::extension::module::Module> module_;
  // The Module that loaded the Program owns its data loader, which the Program
  // reads through for as long as it lives: every session keeps it alive.
  std::shared_ptr<executorch::extension::module::Module> origin_;
  std::string method_;
  std::shared_ptr<KVStore> store_;
  std::vector<executorch::runtime::EValue> last_outputs_;  // keeps output memory described
};

}  // namespace offgraph_kv
