// CUDA step I/O: input staging, the length upload and the output copy, all on
// the execution stream that KV memory (cuda_memory.h) also orders its work on;
// finish() is the only host synchronisation of a step.
#include <cuda_runtime.h>

#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "cuda_memory.h"
#include "segment_copy.h"
#include "step_io.h"

namespace offgraph_kv {
namespace {

// One execution stream per device for the whole process, shared by every
// session and program. Libraries keep per-stream state keyed by the stream:
// cuBLAS's workspace (32 MiB on sm90) and libtorch's caching-allocator pools,
// which the compiled code's intermediates come from. A stream per session cost
// each extra session ~36 MB of device memory beyond its KV (H200, 2026-12-01).
// Work of different sessions is independent, so queuing it on one stream is
// correct; finish() then also waits for another thread's queued step.
// Who may enqueue on each device's shared stream (StepIO::turns).
std::shared_mutex& stream_turns(int device) {
  static std::mutex mu;
  static std::map<int, std::unique_ptr<std::shared_mutex>> turns;
  std::lock_guard<std::mutex> lock(mu);
  std::unique_ptr<std::shared_mutex>& t = turns[device];
  if (!t) t = std::make_unique<std::shared_mutex>();
  return *t;
}

std::shared_ptr<CudaStream> shared_execution_stream(Status* status) {
  static std::mutex mu;
  static std::map<int, std::weak_ptr<CudaStream>> streams;
  int device = 0;
  cudaError_t e = cudaGetDevice(&device);
  if (e != cudaSuccess) {
    *status = Status(Error::NotSupported, cuda_error("no usable CUDA device", e));
    return nullptr;
  }
  std::lock_guard<std::mutex> lock(mu);
  if (std::shared_ptr<CudaStream> live = streams[device].lock()) return live;
  cudaStream_t raw = nullptr;
  e = cudaStreamCreateWithFlags(&raw, cudaStreamNonBlocking);
  if (e != cudaSuccess) {
    *status = Status(Error::NotSupported, cuda_error("no usable CUDA device", e));
    return nullptr;
  }
  auto stream = std::make_shared<CudaStream>(raw);  // owns it from here
  streams[device] = stream;
  return stream;
}

class CudaStepIO final : public StepIO {
 public:
  static std::unique_ptr<CudaStepIO> create(CopyMode copies, Status* status) {
    if (copies == CopyMode::Auto) copies = segment_copy_available() ? CopyMode::Kernel : CopyMode::Batch;
    if (copies == CopyMode::Kernel && !segment_copy_available()) {
      *status = Status(Error::NotSupported, "copy mode 'kernel': this build has no copy kernel (built without nvcc)");
      return nullptr;
    }
    std::unique_ptr<CudaStepIO> io(new CudaStepIO());
    std::shared_ptr<CudaStream> stream = shared_execution_stream(status);
    if (!stream) return nullptr;
    io->stream_ = stream->get();
    int device = 0;
    cudaGetDevice(&device);
    io->turns_ = &stream_turns(device);
    // KV arenas come from a pool of their own (cuda_memory.h says why).
    io->memory_ = cuda_kv_memory(stream, copies, status);
    if (!io->memory_) return nullptr;
    io->staging_ = cuda_stream_memory(stream, copies);
    // Pinned, so the per-step length upload is a true async copy.
    cudaError_t e = cudaMallocHost(reinterpret_cast<void**>(&io->length_host_), sizeof(int64_t));
    if (e != cudaSuccess) {
      *status = Status(Error::MemoryAllocationFailed, cuda_error("cudaMallocHost", e));
      return nullptr;
    }
    io->length_device_ = allocate_buffer(io->staging_, sizeof(int64_t));
    *status = Status::ok_status();
    return io;
  }

  ~CudaStepIO() override {
    staged_.clear();
    fixed_.clear();
    length_device_.reset();
    if (staging_ != nullptr) staging_->synchronize();  // the pinned length upload is done
    if (length_host_ != nullptr) cudaFreeHost(length_host_);
  }

  Status stage_input(size_t index, const executorch::aten::Tensor& t, TensorDesc* d) override {
    return stage_into(staged_, index, t, d);
  }

  Status stage_input_fixed(size_t index, const executorch::aten::Tensor& t, TensorDesc* d) override {
    return stage_into(fixed_, index, t, d);
  }

  Status stage_length(int64_t length, TensorDesc* d) override {
    // The previous step's upload has completed: finish() synchronised.
    *length_host_ = length;
    const cudaError_t e =
        cudaMemcpyAsync(length_device_.data(), length_host_, sizeof(int64_t), cudaMemcpyHostToDevice, stream_);
    if (e != cudaSuccess) return Status(Error::Internal, cuda_error("length upload", e));
    describe_length(length_device_.data(), d);
    return Status::ok_status();
  }

  Status fetch_output(const OutputView& out, void* host, size_t bytes) override {
    const cudaError_t e = cudaMemcpyAsync(host, out.data, bytes, cudaMemcpyDeviceToHost, stream_);
    return e == cudaSuccess ? Status::ok_status() : Status(Error::Internal, cuda_error("output copy", e));
  }

  Status finish() override {
    const cudaError_t e = cudaStreamSynchronize(stream_);
    return e == cudaSuccess ? Status::ok_status() : Status(Error::Internal, cuda_error("step", e));
  }

  void* stream() override { return stream_; }
  std::shared_ptr<DeviceMemory> memory() override { return memory_; }
  std::shared_mutex* turns() override { return turns_; }

 private:
  CudaStepIO() = default;

  Status stage_into(std::vector<Buffer>& buffers, size_t index, const executorch::aten::Tensor& t, TensorDesc* d) {
    if (buffers.size() <= index) buffers.resize(index + 1);
    Buffer& buf = buffers[index];
    const size_t bytes = t.nbytes();
    if (buf.bytes() < bytes) {
      buf = allocate_buffer(staging_, bytes < 256 ? 256 : bytes * 2);  // headroom: prefill widths vary
      if (buf.data() == nullptr)
        return Status(Error::MemoryAllocationFailed, "cannot stage input " + std::to_string(index) + " on the device");
    }
    if (bytes > 0) {
      const cudaError_t e = cudaMemcpyAsync(buf.data(), t.const_data_ptr(), bytes, cudaMemcpyHostToDevice, stream_);
      if (e != cudaSuccess) return Status(Error::Internal, cuda_error("input copy", e));
    }
    describe_tensor(t, buf.data(), d);
    return Status::ok_status();
  }

  cudaStream_t stream_ = nullptr;  // the shared execution stream, kept alive by the memories
  int64_t* length_host_ = nullptr;
  std::shared_ptr<DeviceMemory> memory_;   // KV storage: its own pool
  std::shared_ptr<DeviceMemory> staging_;  // inputs and the length: the default pool
  Buffer length_device_;
  std::vector<Buffer> staged_;
  std::vector<Buffer> fixed_;  // inputs of captured steps (stage_input_fixed)
  std::shared_mutex* turns_ = nullptr;
};

}  // namespace

std::unique_ptr<StepIO> cuda_step_io(Status* status, CopyMode copies) { return CudaStepIO::create(copies, status); }

#ifndef OFFGRAPH_KV_WITH_COPY_KERNEL
// Built without nvcc: the driver's batched copies stand in for the kernel.
bool segment_copy_available() { return false; }
cudaError_t segment_copy(const std::vector<CopyOp>&, cudaStream_t) { return cudaErrorNotSupported; }
int set_segment_copy_blocks_per_sm(int) { return 0; }
int segment_copy_resident_blocks_per_sm() { return 0; }
#endif

}  // namespace offgraph_kv
