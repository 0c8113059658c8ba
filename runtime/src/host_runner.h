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

class HostRunner {
 public:
  // Loads the program and the method (delegate init runs here).
  static std::unique_ptr<HostRunner> load(const std::string& path, const std::string& method, Status* status);
  // One execution; inputs are dense host tensors. Outputs alias the method's memory.
  Status run(const std::vector<HostTensor>& inputs, std::vector<HostTensor>* outputs);

 private:
  HostRunner(const std::string& path, std::string method);
  executorch::extension::module::Module module_;
  std::string method_;
  std::vector<executorch::runtime::EValue> last_outputs_;  // keeps output memory described
};

}  // namespace offgraph_kv
