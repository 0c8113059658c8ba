// CUDA storage and step I/O. Everything is ordered on one execution stream:
// allocation (cudaMallocAsync), growth copies, frees (cudaFreeAsync, so nothing
// is released while a kernel that reads it may still be queued), input staging
// and the output copy, after which the only host synchronisation of a step waits.
#include <cuda_runtime.h>

#include <cstring>
#include <string>
#include <vector>

#include "segment_copy.h"
#include "step_io.h"

namespace offgraph_kv {
namespace {

std::string cuda_error(const char* what, cudaError_t e) {
  return std::string(what) + ": " + cudaGetErrorString(e);
}

// Owns the execution stream: KV buffers release through it, and a store may
// outlive the step I/O that made it, so the stream lives as long as the last
// buffer (a free on a destroyed stream fails and leaves a CUDA error behind
// that torch's next launch check then reports as its own).
class CudaStreamMemory final : public DeviceMemory {
 public:
  CudaStreamMemory(cudaStream_t stream, CopyMode copies) : stream_(stream), copies_(copies) {}
  ~CudaStreamMemory() override {
    cudaStreamSynchronize(stream_);  // queued frees and copies complete first
    cudaStreamDestroy(stream_);
    cudaGetLastError();
  }
  void* allocate(size_t bytes) override {
    void* p = nullptr;
    if (cudaMallocAsync(&p, bytes, stream_) == cudaSuccess) return p;
    cudaGetLastError();  // reported through the store's status, not left for torch to find
    return nullptr;
  }
  void release(void* ptr) override { cudaFreeAsync(ptr, stream_); }
  void copy(void* dst, const void* src, size_t bytes) override {
    cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, stream_);
  }
  // A growth copies every flat tensor's prefix. One launch for all of them:
  // per-copy launch cost, not bandwidth, bounds many medium-sized copies.
  void copy_many(const std::vector<CopyOp>& copies) override {
    if (copies.size() > 1 && copies_ == CopyMode::Kernel) {
      if (segment_copy(copies, stream_) == cudaSuccess) return;
      cudaGetLastError();  // a failed launch queued nothing: fall back to the driver's copies
    }
#if CUDART_VERSION >= 13000
    if (copies.size() > 1 && copies_ != CopyMode::EachCall) {
      dsts_.clear();
      srcs_.clear();
      sizes_.clear();
      for (const CopyOp& c : copies) {
        dsts_.push_back(c.dst);
        srcs_.push_back(c.src);
        sizes_.push_back(c.bytes);
      }
      cudaMemcpyAttributes attr{};
      attr.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
      size_t attr_index = 0;
      if (cudaMemcpyBatchAsync(dsts_.data(), srcs_.data(), sizes_.data(), copies.size(), &attr, &attr_index, 1,
                               stream_) == cudaSuccess)
        return;
      cudaGetLastError();  // not supported here: clear it and copy one by one
    }
#endif
    DeviceMemory::copy_many(copies);
  }
  void zero(void* dst, size_t bytes) override { cudaMemsetAsync(dst, 0, bytes, stream_); }
  void synchronize() override { cudaStreamSynchronize(stream_); }
  const char* name() const override { return "cuda"; }

 private:
  cudaStream_t stream_;
  CopyMode copies_;
  std::vector<void*> dsts_;
  std::vector<const void*> srcs_;
  std::vector<size_t> sizes_;
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
    cudaError_t e = cudaStreamCreateWithFlags(&io->stream_, cudaStreamNonBlocking);
    if (e != cudaSuccess) {
      *status = Status(Error::NotSupported, cuda_error("no usable CUDA device", e));
      return nullptr;
    }
    // From here the memory object owns the stream (stream_ is a borrowed handle).
    io->memory_ = std::make_shared<CudaStreamMemory>(io->stream_, copies);
    // Pinned, so the per-step length upload is a true async copy.
    e = cudaMallocHost(reinterpret_cast<void**>(&io->length_host_), sizeof(int64_t));
    if (e != cudaSuccess) {
      *status = Status(Error::MemoryAllocationFailed, cuda_error("cudaMallocHost", e));
      return nullptr;
    }
    // Keep freed blocks in the stream-ordered pool: growth then reuses them
    // instead of mapping fresh pages (the default threshold returns memory to
    // the driver at every synchronisation).
    int device = 0;
    cudaMemPool_t pool = nullptr;
    if (cudaGetDevice(&device) == cudaSuccess && cudaDeviceGetDefaultMemPool(&pool, device) == cudaSuccess) {
      uint64_t keep = UINT64_MAX;
      cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &keep);
    }
    io->length_device_ = allocate_buffer(io->memory_, sizeof(int64_t));
    *status = Status::ok_status();
    return io;
  }

  ~CudaStepIO() override {
    staged_.clear();
    length_device_.reset();
    if (memory_ != nullptr) memory_->synchronize();  // the pinned length upload is done
    if (length_host_ != nullptr) cudaFreeHost(length_host_);
  }

  Status stage_input(size_t index, const executorch::aten::Tensor& t, TensorDesc* d) override {
    if (staged_.size() <= index) staged_.resize(index + 1);
    Buffer& buf = staged_[index];
    const size_t bytes = t.nbytes();
    if (buf.bytes() < bytes) {
      buf = allocate_buffer(memory_, bytes < 256 ? 256 : bytes * 2);  // headroom: prefill widths vary
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

 private:
  CudaStepIO() = default;
  cudaStream_t stream_ = nullptr;  // owned by memory_
  int64_t* length_host_ = nullptr;
  std::shared_ptr<DeviceMemory> memory_;
  Buffer length_device_;
  std::vector<Buffer> staged_;
};

}  // namespace

std::unique_ptr<StepIO> cuda_step_io(Status* status, CopyMode copies) { return CudaStepIO::create(copies, status); }

#ifndef OFFGRAPH_KV_WITH_COPY_KERNEL
// Built without nvcc: the driver's batched copies stand in for the kernel.
bool segment_copy_available() { return false; }
cudaError_t segment_copy(const std::vector<CopyOp>&, cudaStream_t) { return cudaErrorNotSupported; }
#endif

}  // namespace offgraph_kv
