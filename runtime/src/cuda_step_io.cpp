// CUDA storage and step I/O. Everything is ordered on one execution stream:
// allocation (cudaMallocFromPoolAsync / cudaMallocAsync), growth copies, frees (cudaFreeAsync, so nothing
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

// The execution stream. Shared by the memories that release through it: a
// store may outlive the step I/O that made it, so the stream lives as long as
// the last buffer (a free on a destroyed stream fails and leaves a CUDA error
// behind that torch's next launch check then reports as its own).
class CudaStream {
 public:
  explicit CudaStream(cudaStream_t s) : stream_(s) {}
  ~CudaStream() {
    cudaStreamSynchronize(stream_);  // queued frees and copies complete first
    cudaStreamDestroy(stream_);
    cudaGetLastError();
  }
  CudaStream(const CudaStream&) = delete;
  CudaStream& operator=(const CudaStream&) = delete;
  cudaStream_t get() const { return stream_; }

 private:
  cudaStream_t stream_;
};

// Stream-ordered device memory from `pool` (nullptr: the device's default pool).
class CudaStreamMemory final : public DeviceMemory {
 public:
  CudaStreamMemory(std::shared_ptr<CudaStream> stream, CopyMode copies, cudaMemPool_t pool)
      : owner_(std::move(stream)), stream_(owner_->get()), copies_(copies), pool_(pool) {}
  ~CudaStreamMemory() override {
    // Every buffer holds this object, so none is left; wait for their frees.
    cudaStreamSynchronize(stream_);
    if (pool_ != nullptr) cudaMemPoolDestroy(pool_);
    cudaGetLastError();
  }
  void* allocate(size_t bytes) override {
    void* p = nullptr;
    const cudaError_t e =
        pool_ != nullptr ? cudaMallocFromPoolAsync(&p, bytes, pool_, stream_) : cudaMallocAsync(&p, bytes, stream_);
    if (e == cudaSuccess) return p;
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
  void return_unused() override {
    if (pool_ == nullptr) return;  // the default pool is shared with the process: not ours to trim
    cudaStreamSynchronize(stream_);  // queued frees must have happened to be returned
    cudaMemPoolTrimTo(pool_, 0);     // keeps what live buffers use
    cudaGetLastError();
  }
  const char* name() const override { return "cuda"; }

 private:
  std::shared_ptr<CudaStream> owner_;
  cudaStream_t stream_;
  CopyMode copies_;
  cudaMemPool_t pool_;
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
    auto stream = std::make_shared<CudaStream>(io->stream_);  // owns it from here
    // KV arenas come from a pool of their own, which keeps freed blocks until
    // the store returns them after a growth (return_unused): a growth's new
    // arena is larger than any freed one, so a kept old arena would only be
    // memory that no longer follows the context. Small step buffers use the
    // default pool, so they never pin an old arena's memory.
    int device = 0;
    cudaMemPool_t pool = nullptr;
    cudaMemPoolProps props{};
    props.allocType = cudaMemAllocationTypePinned;
    props.handleTypes = cudaMemHandleTypeNone;
    props.location.type = cudaMemLocationTypeDevice;
    if ((e = cudaGetDevice(&device)) == cudaSuccess) {
      props.location.id = device;
      e = cudaMemPoolCreate(&pool, &props);
    }
    if (e != cudaSuccess) {
      *status = Status(Error::NotSupported, cuda_error("cannot create the KV memory pool", e));
      return nullptr;
    }
    uint64_t keep = UINT64_MAX;  // no release at every synchronisation: only after a growth
    cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &keep);
    io->memory_ = std::make_shared<CudaStreamMemory>(stream, copies, pool);
    io->staging_ = std::make_shared<CudaStreamMemory>(stream, copies, nullptr);
    // Pinned, so the per-step length upload is a true async copy.
    e = cudaMallocHost(reinterpret_cast<void**>(&io->length_host_), sizeof(int64_t));
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
    length_device_.reset();
    if (staging_ != nullptr) staging_->synchronize();  // the pinned length upload is done
    if (length_host_ != nullptr) cudaFreeHost(length_host_);
  }

  Status stage_input(size_t index, const executorch::aten::Tensor& t, TensorDesc* d) override {
    if (staged_.size() <= index) staged_.resize(index + 1);
    Buffer& buf = staged_[index];
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
  cudaStream_t stream_ = nullptr;  // owned by the memories' CudaStream
  int64_t* length_host_ = nullptr;
  std::shared_ptr<DeviceMemory> memory_;   // KV storage: its own pool
  std::shared_ptr<DeviceMemory> staging_;  // inputs and the length: the default pool
  Buffer length_device_;
  std::vector<Buffer> staged_;
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
