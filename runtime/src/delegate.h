// The ExecuTorch delegate: init / execute / destroy of "OffGraphKVBackend".
#pragma once

#include <executorch/runtime/backend/interface.h>

#include <string>

namespace offgraph_kv {

constexpr const char* kBackendName = "OffGraphKVBackend";

class OffGraphKVDelegate final : public executorch::runtime::BackendInterface {
 public:
  bool is_available() const override;
  executorch::runtime::Result<executorch::runtime::DelegateHandle*> init(
      executorch::runtime::BackendInitContext& context, executorch::runtime::FreeableBuffer* processed,
      executorch::runtime::ArrayRef<executorch::runtime::CompileSpec> compile_specs) const override;
  executorch::runtime::Error execute(executorch::runtime::BackendExecutionContext& context,
                                     executorch::runtime::DelegateHandle* handle,
                                     executorch::runtime::Span<executorch::runtime::EValue*> args) const override;
  void destroy(executorch::runtime::DelegateHandle* handle) const override;
  executorch::runtime::Error set_option(
      executorch::runtime::BackendOptionContext& context,
      const executorch::runtime::Span<executorch::runtime::BackendOption>& options) override;
  executorch::runtime::Error get_option(
      executorch::runtime::BackendOptionContext& context,
      executorch::runtime::Span<executorch::runtime::BackendOption>& options) override;
};

// The last message the delegate failed with on this thread ("" after
// clear_last_error): hosts whose exceptions carry only ExecuTorch's error code
// (executorch.runtime's Python bindings) attach it to their own.
std::string last_error();
void clear_last_error();

// Registers the delegate with the process's ExecuTorch runtime (idempotent).
executorch::runtime::Error register_delegate();

}  // namespace offgraph_kv
