// StepGraph over libtorch's CUDAGraph (step_graph.h). libtorch is what the
// compiled code allocates its intermediates through; its CUDAGraph routes every
// allocation made on the capturing stream to a memory pool private to the
// graph, which keeps those addresses for the graph's lifetime, so a replay
// writes where the capture did and nothing else is ever handed that memory.
#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>

#include <exception>
#include <optional>
#include <string>

#include "step_graph.h"

namespace offgraph_kv {
namespace {

c10::cuda::CUDAStream external(void* stream) {
  int device = 0;
  cudaGetDevice(&device);
  return c10::cuda::getStreamFromExternal(static_cast<cudaStream_t>(stream), c10::DeviceIndex(device));
}

class TorchStepGraph final : public StepGraph {
 public:
  Status capture(void* stream, const std::function<Status()>& launch) override {
    graph_.reset();
    Status launched;
    try {
      // The compiled code sets this stream current itself; the guard makes the
      // capture (and its allocation filter) watch the same one.
      const c10::cuda::CUDAStream on = external(stream);
      c10::cuda::CUDAStreamGuard guard(on);
      auto graph = std::make_unique<at::cuda::CUDAGraph>();
      // Thread-local: other threads' unrelated CUDA calls stay legal; nothing
      // else enqueues on this stream meanwhile (the executor holds it alone).
      graph->capture_begin({0, 0}, cudaStreamCaptureModeThreadLocal);
      launched = launch();
      graph->capture_end();  // ends the capture even when the launch failed
      if (launched.ok()) {
        graph_ = std::move(graph);
        stream_ = on;  // replays go to the same stream: resolved once here, not per token
      }
    } catch (const std::exception& e) {
      cudaGetLastError();  // capture errors are not sticky; do not leave one for the next call
      return Status(Error::Internal, std::string("CUDA graph capture failed: ") + first_line(e.what()));
    }
    return launched;
  }

  Status replay(void* stream) override {
    if (!graph_) return Status(Error::InvalidState, "no captured CUDA graph to replay");
    if (stream_->stream() != static_cast<cudaStream_t>(stream))
      return Status(Error::InvalidArgument, "a CUDA graph replays on the stream it was captured on");
    try {
      c10::cuda::CUDAStreamGuard guard(*stream_);
      graph_->replay();
    } catch (const std::exception& e) {
      return Status(Error::Internal, std::string("CUDA graph replay failed: ") + first_line(e.what()));
    }
    return Status::ok_status();
  }

 private:
  static std::string first_line(const char* what) {
    const std::string text = what ? what : "?";
    return text.substr(0, text.find('\n'));
  }
  std::unique_ptr<at::cuda::CUDAGraph> graph_;
  std::optional<c10::cuda::CUDAStream> stream_;
};

std::unique_ptr<StepGraph> make(Status* status) {
  *status = Status::ok_status();
  return std::make_unique<TorchStepGraph>();
}

}  // namespace

void register_cuda_step_graphs() { set_step_graph_factory(&make); }

}  // namespace offgraph_kv
