// StepExecutor: one loaded method's step, from ExecuTorch's arguments to a
// committed step (the delegate's execute is glue around it):
//
//   read the width (the locator's extent) -> check every input (manifest)
//   -> prepare_step(width) -> stage inputs -> bind private tensors
//   -> run the compiled code -> commit_step
//
// On CUDA, where the compiled code reads the length from device memory, a
// decode step (width 1) runs as a captured graph (step_graph.h): the first
// runs uncaptured (the code's lazy setup must not land in a graph), the next
// is captured and every later one replays it, until an input's address or
// extent differs from the capture's (copy growth), which captures again.
//
// A failure before prepare_step changes nothing; after it, StepGuard aborts
// the step, so the store keeps its length and every committed row.
#pragma once

#include <executorch/runtime/core/evalue.h>
#include <executorch/runtime/core/span.h>

#include <memory>
#include <shared_mutex>
#include <vector>

#include "compiled_program.h"
#include "growth_policy.h"
#include "kv_store.h"
#include "manifest_reader.h"
#include "status.h"
#include "step_graph.h"
#include "step_io.h"
#include "step_threads.h"
#include "step_width.h"

namespace offgraph_kv {

class StepExecutor {
 public:
  // Takes the loaded program; makes the step I/O for the manifest's device and
  // the store with `policy`.
  static std::unique_ptr<StepExecutor> create(const ManifestInfo& manifest, StepWidthLocator width_at,
                                              std::unique_ptr<CompiledProgram> program, const GrowthPolicy& policy,
                                              Status* status);
  // args: the delegate's inputs, then its outputs (ExecuTorch's order).
  Status execute(executorch::runtime::Span<executorch::runtime::EValue*> args);
  const std::shared_ptr<KVStore>& store() const { return store_; }

 private:
  StepExecutor() = default;
  // The step's width, and every input checked against what was compiled.
  Status check_inputs(executorch::runtime::Span<executorch::runtime::EValue*> args, size_t* width) const;
  // Binds inputs, private tensors and the length; runs; copies outputs out
  // (`run_ns`: the compiled code's share, for host-time accounting).
  Status run_prepared(executorch::runtime::Span<executorch::runtime::EValue*> args, size_t width, int64_t* run_ns,
                      std::shared_lock<std::shared_mutex>* turn);
  // `decode`: a width-1 step, whose output sizes a capture then reserves host memory for.
  Status run_uncaptured(executorch::runtime::Span<executorch::runtime::EValue*> args, bool decode);
  // A decode step through the graph: capture when needed, replay, copy the outputs out.
  Status run_captured(executorch::runtime::Span<executorch::runtime::EValue*> args,
                      std::shared_lock<std::shared_mutex>* turn);
  // Capture with the stream held alone (`turn` is given up meanwhile).
  Status capture(std::shared_lock<std::shared_mutex>* turn);

  ManifestInfo manifest_;
  StepWidthLocator width_at_;
  std::unique_ptr<CompiledProgram> program_;
  std::unique_ptr<StepIO> io_;      // declared before the store: storage is freed on its stream first
  std::shared_ptr<KVStore> store_;
  std::vector<TensorDesc> inputs_;  // reused every step: no per-step allocation
  std::unique_ptr<StepThreads> threads_;
  size_t num_threads_ = 0;  // the load-time option (0: the default rule)
  bool graphs_ = false;     // decode steps go through graph_ (load-time option and what the code allows)
  size_t decode_steps_seen_ = 0;
  // Declared after the program and the stream: released before either.
  std::unique_ptr<StepGraph> graph_;
  std::vector<TensorDesc> captured_inputs_;  // what graph_ was captured over
  std::vector<OutputView> graph_outputs_;    // where its replays leave the outputs
  std::vector<size_t> decode_output_bytes_;  // each output's bytes in the first decode step
};

}  // namespace offgraph_kv
