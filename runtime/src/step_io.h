// StepIO: moves one step's inputs and outputs between the ExecuTorch method
// (host tensors) and wherever the compiled code runs. On the CPU it only
// describes the method's own memory; on CUDA it stages token ids and positions
// in and logits out on the execution stream.
#pragma once

#include <executorch/runtime/core/exec_aten/exec_aten.h>

#include <cstdint>
#include <memory>
#include <shared_mutex>
#include <string>
#include <utility>
#include <vector>

#include "compiled_program.h"
#include "copy_mode.h"
#include "device_memory.h"
#include "status.h"

namespace offgraph_kv {

class StepIO {
 public:
  virtual ~StepIO() = default;
  // Describe (and, off the host, copy) input `index` for the compiled code.
  virtual Status stage_input(size_t index, const executorch::aten::Tensor& t, TensorDesc* d) = 0;
  // The same into memory kept for captured steps (step_graph.h): its address
  // changes only when the input outgrows it, never because another step was
  // wider. Off the host only the host side is written: upload() copies it.
  virtual Status stage_input_fixed(size_t index, const executorch::aten::Tensor& t, TensorDesc* d) = 0;
  // Describe the committed length (int64 [1]) rings read; upload() copies it.
  virtual Status stage_length(int64_t length, TensorDesc* d) = 0;
  // Enqueue the copies of what stage_input_fixed and stage_length wrote since
  // the last upload. Captured inside a graph, these copies are part of every
  // replay: a replayed step is one launch and one wait, not a call per input.
  virtual Status upload() = 0;
  // Copy a compiled output into host memory of `bytes` bytes.
  virtual Status fetch_output(const OutputView& out, void* host, size_t bytes) = 0;
  // Captured steps' outputs: reserve_fixed_outputs (before a capture, which
  // may not allocate) sizes host memory for them, download_fixed (inside the
  // capture) enqueues the copy there, read_fixed (after finish) hands it on.
  virtual Status reserve_fixed_outputs(const std::vector<size_t>& bytes) = 0;
  virtual Status download_fixed(size_t index, const OutputView& out, size_t bytes) = 0;
  virtual Status read_fixed(size_t index, void* host, size_t bytes) = 0;
  // Wait for the step's outputs to be on the host.
  virtual Status finish() = 0;
  virtual void* stream() = 0;
  virtual std::shared_ptr<DeviceMemory> memory() = 0;
  // Steps on a shared stream hold this shared; a capture holds it alone, since
  // a capture records everything enqueued on its stream. Null on the host.
  virtual std::shared_mutex* turns() = 0;
};

// Describe `t`'s shape and dtype over `data` (the method's memory or a staged copy).
inline void describe_tensor(const executorch::aten::Tensor& t, void* data, TensorDesc* d) {
  d->data = data;
  d->dtype = static_cast<int32_t>(t.scalar_type());
  d->sizes.assign(t.sizes().begin(), t.sizes().end());
  d->strides.assign(t.strides().begin(), t.strides().end());
}

// Describe the int64 [1] committed length at `data`.
inline void describe_length(void* data, TensorDesc* d) {
  d->data = data;
  d->dtype = int32_t(AotiDType::Int64);
  d->sizes = {1};
  d->strides = {1};
}

std::unique_ptr<StepIO> host_step_io();
// nullptr with a message when this build or machine has no CUDA, or when
// `copies` asks for a kernel this build does not have.
std::unique_ptr<StepIO> cuda_step_io(Status* status, CopyMode copies = CopyMode::Auto);

}  // namespace offgraph_kv
