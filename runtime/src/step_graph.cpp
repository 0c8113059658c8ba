#include "step_graph.h"

#include <atomic>

namespace offgraph_kv {

namespace {
std::atomic<StepGraphFactory> g_factory{nullptr};
}  // namespace

void set_step_graph_factory(StepGraphFactory factory) { g_factory.store(factory); }

bool step_graphs_available() { return g_factory.load() != nullptr; }

std::unique_ptr<StepGraph> make_step_graph(Status* status) {
  const StepGraphFactory factory = g_factory.load();
  if (factory == nullptr) {
    *status = Status(Error::NotSupported, "this build has no CUDA graphs (built without libtorch's CUDA build)");
    return nullptr;
  }
  return factory(status);
}

}  // namespace offgraph_kv
