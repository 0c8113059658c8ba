// HostRunner: runs a method of a .pte through ExecuTorch's C++ Module (the
// same libexecutorch.so the Python runtime uses), taking and returning plain
// host buffers. It exists because the Python bindings exchange tensors through
// the ATen C++ ABI of the torch they were built against (2.13); with another
// torch in the process (the H200 image's 2.11) that exchange fails before any
// backend runs. Raw pointers, sizes and dtype names cross no C++ ABI.
#pragma once

#include <executorch/extension/module/module.h>
#include <executorch/extension/tensor/tensor_ptr.h>

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

// A greedy decode loop entirely in C++, as ExecuTorch's C++ LLM runner runs it
// (one Module::execute per token, the argmax on the host): what a deployed
// program pays per token without Python in the loop.
struct GreedyRequest {
  std::vector<HostTensor> inputs;  // the first decode step's inputs, width 1
  size_t token_input = 0;          // holds the token id (int64, one element)
  size_t position_input = 1;       // int64; every element advances by one per step
  size_t logits_output = 0;        // its last `vocab` values (the last dim) are the next token's logits
  size_t steps = 0;
  std::vector<int64_t> stop_ids;   // the loop ends after generating one of these
};

struct GreedyResult {
  std::vector<int64_t> tokens;     // one per step run: the argmax of that step's logits
  std::vector<int64_t> step_ns;    // host wall time of each step, argmax included
};

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
  // Runs up to req.steps greedy decode steps; the first failure stops the loop
  // (the store keeps every step that succeeded) and is returned.
  Status decode_greedy(const GreedyRequest& req, GreedyResult* result);
  // The KV store this runner's method owns (null for a program without this backend).
  const std::shared_ptr<KVStore>& store() const { return store_; }

 private:
  HostRunner(std::shared_ptr<executorch::extension::module::Module> module, std::string method,
             std::shared_ptr<executorch::extension::module::Module> origin);
  Status load_method();
  // Host buffers as the method's input values (the buffers are not copied: they must outlive the values).
  struct WrappedInputs {
    std::vector<executorch::extension::TensorPtr> owned;
    std::vector<executorch::runtime::EValue> values;
  };
  Status wrap_inputs(const std::vector<HostTensor>& inputs, WrappedInputs* wrapped);
  Status execute_wrapped(const WrappedInputs& wrapped, std::vector<HostTensor>* outputs);
  std::shared_ptr<executorch::extension::module::Module> module_;
  // The Module that loaded the Program owns its data loader, which the Program
  // reads through for as long as it lives: every session keeps it alive.
  std::shared_ptr<executorch::extension::module::Module> origin_;
  std::string method_;
  std::shared_ptr<KVStore> store_;
  std::vector<executorch::runtime::EValue> last_outputs_;  // keeps output memory described
};

}  // namespace offgraph_kv
