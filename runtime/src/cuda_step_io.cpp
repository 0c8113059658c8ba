// CUDA step I/O: input staging, the length upload and the output copy, all on
// the execution stream that KV memory (cuda_memory.h) also orders its work on;
// finish() is the only host synchronisation of a step.
#include <cuda_runtime.h>

#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <utility>
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

// Page-locked host memory: copies from and to it are truly asynchronous, and
// a graph capture may record them (a copy from pageable memory is a
// synchronous staging the driver will not capture). Buffers of it free
// themselves (device_memory.h's Buffer).
class PinnedHostMemory final : public DeviceMemory {
 public:
  void* allocate(size_t bytes) override {
    void* p = nullptr;
    return cudaMallocHost(&p, bytes) == cudaSuccess ? p : nullptr;
  }
  void release(void* ptr) override { cudaFreeHost(ptr); }  // callers sync first: nothing queued reads it
  void copy(void* dst, const void* src, size_t bytes) override { std::memcpy(dst, src, bytes); }
  void zero(void* dst, size_t bytes) override { std::memset(dst, 0, bytes); }
  const char* name() const override { return "pinned host"; }
};

// An input of captured steps: fixed device memory and the pinned host memory
// its upload reads, allocated together so that both move only together.
struct FixedInput {
  Buffer device;
  Buffer host;  // pinned
  size_t bytes = 0;      // staged this step
  bool pending = false;  // staged since the last finish()
};

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
    io->turns_ = &stream->turns();  // the stream outlives io: memory_ and staging_ hold it
    // KV arenas come from a pool of their own (cuda_memory.h says why).
    io->memory_ = cuda_kv_memory(stream, copies, status);
    if (!io->memory_) return nullptr;
    io->staging_ = cuda_stream_memory(stream, copies);
    // Pinned, so the per-step length upload is a true async copy (and capturable).
    io->pinned_ = std::make_shared<PinnedHostMemory>();
    io->length_host_ = allocate_buffer(io->pinned_, sizeof(int64_t));
    io->length_device_ = allocate_buffer(io->staging_, sizeof(int64_t));
    if (io->length_host_.data() == nullptr || io->length_device_.data() == nullptr) {
      *status = Status(Error::MemoryAllocationFailed, "cannot allocate the length's host and device words");
      return nullptr;
    }
    *status = Status::ok_status();
    return io;
  }

  ~CudaStepIO() override {
    // Nothing queued may still read or write the pinned memory freed below.
    if (stream_ != nullptr) cudaStreamSynchronize(stream_);
  }

  Status stage_input(size_t index, const executorch::aten::Tensor& t, TensorDesc* d) override {
    return stage_into(staged_, index, t, d);
  }

  Status stage_input_fixed(size_t index, const executorch::aten::Tensor& t, TensorDesc* d) override {
    settle();
    if (fixed_.size() <= index) fixed_.resize(index + 1);
    FixedInput& f = fixed_[index];
    const size_t bytes = t.nbytes();
    if (f.device.bytes() < bytes || f.device.data() == nullptr) {
      const size_t room = bytes < 256 ? 256 : bytes;  // width-1 steps: the extent never changes
      f.device = allocate_buffer(staging_, room);
      f.host = allocate_buffer(pinned_, room);
      if (f.device.data() == nullptr || f.host.data() == nullptr)
        return Status(Error::MemoryAllocationFailed, "cannot stage input " + std::to_string(index) + " for captured steps");
    }
    if (bytes > 0) std::memcpy(f.host.data(), t.const_data_ptr(), bytes);
    f.bytes = bytes;
    f.pending = true;
    describe_tensor(t, f.device.data(), d);
    return Status::ok_status();
  }

  Status stage_length(int64_t length, TensorDesc* d) override {
    settle();
    *static_cast<int64_t*>(length_host_.data()) = length;
    length_pending_ = true;
    describe_length(length_device_.data(), d);
    return Status::ok_status();
  }

  Status upload() override {
    // Pending flags stay until finish(): a capture records these copies without
    // running them, and a step that falls back from a failed capture uploads again.
    if (length_pending_) {
      const cudaError_t e = cudaMemcpyAsync(length_device_.data(), length_host_.data(), sizeof(int64_t),
                                            cudaMemcpyHostToDevice, stream_);
      if (e != cudaSuccess) return Status(Error::Internal, cuda_error("length upload", e));
    }
    for (size_t i = 0; i < fixed_.size(); ++i) {
      const FixedInput& f = fixed_[i];
      if (!f.pending || f.bytes == 0) continue;
      const cudaError_t e = cudaMemcpyAsync(f.device.data(), f.host.data(), f.bytes, cudaMemcpyHostToDevice, stream_);
      if (e != cudaSuccess) return Status(Error::Internal, cuda_error(("input " + std::to_string(i) + " upload").c_str(), e));
    }
    in_flight_ = true;
    return Status::ok_status();
  }

  Status fetch_output(const OutputView& out, void* host, size_t bytes) override {
    const cudaError_t e = cudaMemcpyAsync(host, out.data, bytes, cudaMemcpyDeviceToHost, stream_);
    return e == cudaSuccess ? Status::ok_status() : Status(Error::Internal, cuda_error("output copy", e));
  }

  Status reserve_fixed_outputs(const std::vector<size_t>& bytes) override {
    settle();
    if (fixed_outputs_.size() < bytes.size()) fixed_outputs_.resize(bytes.size());
    for (size_t i = 0; i < bytes.size(); ++i) {
      if (fixed_outputs_[i].bytes() >= bytes[i] && (bytes[i] == 0 || fixed_outputs_[i].data() != nullptr)) continue;
      fixed_outputs_[i] = allocate_buffer(pinned_, bytes[i]);
      if (bytes[i] > 0 && fixed_outputs_[i].data() == nullptr)
        return Status(Error::MemoryAllocationFailed, "cannot allocate pinned host memory for output " + std::to_string(i));
    }
    return Status::ok_status();
  }

  Status download_fixed(size_t index, const OutputView& out, size_t bytes) override {
    if (bytes == 0) return Status::ok_status();
    void* fixed = fixed_output(index, bytes);
    if (!fixed)
      return Status(Error::InvalidState, "output " + std::to_string(index) + " of the captured step needs " +
                                             std::to_string(bytes) + " bytes, more than the first decode step's");
    const cudaError_t e = cudaMemcpyAsync(fixed, out.data, bytes, cudaMemcpyDeviceToHost, stream_);
    return e == cudaSuccess ? Status::ok_status() : Status(Error::Internal, cuda_error("output download", e));
  }

  Status read_fixed(size_t index, void* host, size_t bytes) override {
    if (bytes == 0) return Status::ok_status();
    const void* fixed = fixed_output(index, bytes);
    if (!fixed)
      return Status(Error::InvalidState, "output " + std::to_string(index) + " was not downloaded by the captured step");
    std::memcpy(host, fixed, bytes);
    return Status::ok_status();
  }

  Status finish() override {
    const cudaError_t e = cudaStreamSynchronize(stream_);
    in_flight_ = false;
    length_pending_ = false;
    for (FixedInput& f : fixed_) f.pending = false;
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

  // A step that failed before finish() may have left copies from the pinned
  // memory queued: wait for them before that memory is written again.
  void settle() {
    if (in_flight_) finish();
  }

  cudaStream_t stream_ = nullptr;  // the shared execution stream, kept alive by the memories
  std::shared_ptr<DeviceMemory> memory_;   // KV storage: its own pool
  std::shared_ptr<DeviceMemory> staging_;  // inputs and the length: the default pool
  std::shared_ptr<DeviceMemory> pinned_;  // host memory the step's copies read and write
  Buffer length_host_;
  Buffer length_device_;
  bool length_pending_ = false;
  bool in_flight_ = false;  // copies from pinned memory queued since the last finish()
  std::vector<Buffer> staged_;
  std::vector<FixedInput> fixed_;         // inputs of captured steps (stage_input_fixed)
  std::vector<Buffer> fixed_outputs_;  // where captured steps leave their outputs (pinned)
  std::shared_mutex* turns_ = nullptr;

  // Output `index`'s pinned memory when it holds at least `bytes`, else nullptr.
  void* fixed_output(size_t index, size_t bytes) {
    return index < fixed_outputs_.size() && fixed_outputs_[index].bytes() >= bytes ? fixed_outputs_[index].data()
                                                                                   : nullptr;
  }
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
