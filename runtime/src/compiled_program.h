// CompiledProgram: the AOTInductor shared object of one delegate, its model
// container, and the C-ABI tensor functions used to describe inputs.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "aoti_abi.h"
#include "status.h"
#include "storage_dtype.h"

namespace offgraph_kv {

// AOTI dtype codes (c10::ScalarType numbering, which ExecuTorch shares).
enum class AotiDType : int32_t { Int32 = 3, Int64 = 4, Float16 = 5, Float32 = 6, Bool = 11, BFloat16 = 15 };

inline int32_t aoti_dtype(StorageDType d) {
  switch (d) {
    case StorageDType::Float32: return int32_t(AotiDType::Float32);
    case StorageDType::Float16: return int32_t(AotiDType::Float16);
    case StorageDType::BFloat16: return int32_t(AotiDType::BFloat16);
  }
  return int32_t(AotiDType::Float32);
}

struct TensorDesc {
  void* data = nullptr;
  int32_t dtype = 0;  // c10::ScalarType code
  std::vector<int64_t> sizes;
  std::vector<int64_t> strides;
};

inline bool operator==(const TensorDesc& a, const TensorDesc& b) {
  return a.data == b.data && a.dtype == b.dtype && a.sizes == b.sizes && a.strides == b.strides;
}
inline bool operator!=(const TensorDesc& a, const TensorDesc& b) { return !(a == b); }

struct OutputView {
  const void* data = nullptr;
  int32_t dtype = 0;
  std::vector<int64_t> sizes;
};

class CompiledProgram {
 public:
  // Writes `code` to a private temporary file, loads it and creates the
  // container for `device` ("cpu" or "cuda").
  // `key` names the code (its digest): a process maps each distinct code once.
  static std::unique_ptr<CompiledProgram> load(const void* code, size_t size, const std::string& key,
                                               const std::string& device,
                                               Status* status);
  ~CompiledProgram();
  CompiledProgram(const CompiledProgram&) = delete;
  CompiledProgram& operator=(const CompiledProgram&) = delete;

  size_t num_inputs() const { return num_inputs_; }
  // For binding weights kept outside the code (weights.cpp).
  void* library() const { return library_; }
  AOTInductorModelContainerHandle container() const { return container_; }
  int32_t device_type() const { return device_type_; }
  std::string last_error() const;
  size_t num_outputs() const { return num_outputs_; }

  // Runs with the given inputs (memory borrowed, never owned by the program),
  // hands each output to `sink`, then calls `settle` (which waits for any
  // queued copies) before the outputs are released. `stream` may be null.
  template <typename Sink, typename Settle>
  Status run(const std::vector<TensorDesc>& inputs, void* stream, Sink&& sink, Settle&& settle);

  // Runs (enqueues) and describes the outputs without reading them: for a
  // captured step (step_graph.h), whose graph's pool keeps the outputs'
  // memory, so `outputs` stays valid for every replay of that graph.
  Status launch(const std::vector<TensorDesc>& inputs, void* stream, std::vector<OutputView>* outputs);
  // Whether runs can be captured: the container's single-threaded entry,
  // which records no event of its own (an event recorded during a capture
  // cannot be queried afterwards, and the threaded entry queries it next run).
  bool capturable() const { return single_threaded_; }

 private:
  CompiledProgram() = default;
  Status run_raw(const std::vector<TensorDesc>& inputs, void* stream);
  Status describe(AtenTensorHandle h, OutputView* out) const;
  void release(AtenTensorHandle h) const;

  std::vector<AtenTensorHandle> input_handles_;   // scratch reused every run
  std::vector<AtenTensorHandle> output_handles_;
  void* library_ = nullptr;
  AOTInductorModelContainerHandle container_ = nullptr;
  size_t num_inputs_ = 0;
  size_t num_outputs_ = 0;
  int32_t device_type_ = 0;
  ContainerDeleteFn delete_container_ = nullptr;
  ContainerRunFn run_ = nullptr;
  bool single_threaded_ = false;
  GetLastErrorFn last_error_ = nullptr;
  CreateTensorFromBlobFn from_blob_ = nullptr;
  GetDataPtrFn data_ptr_ = nullptr;
  GetInt64ArrayFn sizes_ = nullptr;
  GetInt64Fn dim_ = nullptr;
  GetInt32Fn dtype_ = nullptr;
  DeleteTensorFn delete_tensor_ = nullptr;
};

template <typename Sink, typename Settle>
Status CompiledProgram::run(const std::vector<TensorDesc>& inputs, void* stream, Sink&& sink, Settle&& settle) {
  Status s = run_raw(inputs, stream);
  if (!s.ok()) return s;
  const std::vector<AtenTensorHandle>& outputs = output_handles_;
  for (size_t i = 0; i < outputs.size() && s.ok(); ++i) {
    OutputView view;
    s = describe(outputs[i], &view);
    if (s.ok()) s = sink(i, view);
  }
  Status settled = settle();
  if (s.ok()) s = settled;
  for (AtenTensorHandle h : outputs) release(h);  // ours to release, on every path
  return s;
}

}  // namespace offgraph_kv
