#include <cstring>

#include "step_io.h"

namespace offgraph_kv {
namespace {

class HostStepIO final : public StepIO {
 public:
  Status stage_input(size_t, const executorch::aten::Tensor& t, TensorDesc* d) override {
    describe_tensor(t, t.mutable_data_ptr(), d);
    return Status::ok_status();
  }
  Status stage_input_fixed(size_t index, const executorch::aten::Tensor& t, TensorDesc* d) override {
    return stage_input(index, t, d);
  }
  Status stage_length(int64_t length, TensorDesc* d) override {
    length_ = length;
    describe_length(&length_, d);
    return Status::ok_status();
  }
  Status upload() override { return Status::ok_status(); }  // the code reads the host memory itself
  Status fetch_output(const OutputView& out, void* host, size_t bytes) override {
    std::memcpy(host, out.data, bytes);
    return Status::ok_status();
  }
  // Host steps are never captured (step_graph.h is CUDA's).
  Status reserve_fixed_outputs(const std::vector<size_t>&) override { return not_captured(); }
  Status download_fixed(size_t, const OutputView&, size_t) override { return not_captured(); }
  Status read_fixed(size_t, void*, size_t) override { return not_captured(); }
  Status finish() override { return Status::ok_status(); }
  void* stream() override { return nullptr; }
  std::shared_ptr<DeviceMemory> memory() override { return host_memory(); }
  std::shared_mutex* turns() override { return nullptr; }

 private:
  static Status not_captured() { return Status(Error::NotSupported, "host steps are not captured"); }
  int64_t length_ = 0;
};

}  // namespace

std::unique_ptr<StepIO> host_step_io() { return std::make_unique<HostStepIO>(); }

#ifndef OFFGRAPH_KV_WITH_CUDA
std::unique_ptr<StepIO> cuda_step_io(Status* status, CopyMode) {
  *status = Status(Error::NotSupported,
                   "this build of the offgraph-kv runtime has no CUDA support (rebuild where nvcc and the CUDA runtime are present)");
  return nullptr;
}
#endif

}  // namespace offgraph_kv
