// StepGraph: one step's launches captured as a CUDA graph, then replayed.
//
// A graph replays the exact launches it recorded: the same input, KV and
// length addresses, extents and strides, and its own intermediates and
// outputs, which stay in a memory pool private to it. The executor
// (executor.cpp) therefore replays only while every compiled input is
// described exactly as at capture, and captures again when one changed (a
// copy growth moved the arena; map growth moves nothing). Only code whose
// attention reads the committed length from device memory can be captured
// (CompiledInterfaceInfo::lengths_from_device): its launches do not depend on
// the length.
//
// The implementation needs libtorch's CUDA build (the compiled code takes its
// intermediates from libtorch's caching allocator, which must route them to
// the graph's pool while capturing), so it lives in the Python module's
// library (cuda_graph.cpp) and registers itself here; a build or process
// without it runs every step uncaptured.
#pragma once

#include <functional>
#include <memory>

#include "status.h"

namespace offgraph_kv {

class StepGraph {
 public:
  virtual ~StepGraph() = default;
  // Record what `launch` enqueues on `stream`; nothing runs. On failure no
  // graph is kept and the stream is usable again.
  virtual Status capture(void* stream, const std::function<Status()>& launch) = 0;
  // Enqueue the recorded launches on `stream`.
  virtual Status replay(void* stream) = 0;
};

using StepGraphFactory = std::unique_ptr<StepGraph> (*)(Status* status);

// Set once by the library that can capture (cuda_graph.cpp).
void set_step_graph_factory(StepGraphFactory factory);
// Whether this process can capture (a factory was set).
bool step_graphs_available();
// A new, empty graph; nullptr and NotSupported where none can be made.
std::unique_ptr<StepGraph> make_step_graph(Status* status);

}  // namespace offgraph_kv
