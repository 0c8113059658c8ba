#include "cuda_memory.h"

#include <cstdint>
#include <vector>

#include "segment_copy.h"

namespace offgraph_kv {

std::string cuda_error(const char* what, cudaError_t e) {
  return std::string(what) + ": " + cudaGetErrorString(e);
}

CudaStream::~CudaStream() {
  cudaStreamSynchronize(stream_);  // queued frees and copies complete first
  cudaStreamDestroy(stream_);
  cudaGetLastError();
}

namespace {

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
  void copy_to_host(void* host, const void* src, size_t bytes) override {
    cudaMemcpyAsync(host, src, bytes, cudaMemcpyDeviceToHost, stream_);
    cudaStreamSynchronize(stream_);
  }
  void copy_from_host(void* dst, const void* host, size_t bytes) override {
    cudaMemcpyAsync(dst, host, bytes, cudaMemcpyHostToDevice, stream_);
    cudaStreamSynchronize(stream_);
  }
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

}  // namespace

std::shared_ptr<DeviceMemory> cuda_kv_memory(std::shared_ptr<CudaStream> stream, CopyMode copies, Status* status) {
  // A pool of its own, which keeps freed blocks until the store returns them
  // after a growth (return_unused): a growth's new arena is larger than any
  // freed one, so a kept old arena would only be memory that no longer follows
  // the context. Small step buffers use the default pool, so they never pin an
  // old arena's memory.
  cudaError_t e = cudaSuccess;
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
  return std::make_shared<CudaStreamMemory>(std::move(stream), copies, pool);
}

std::shared_ptr<DeviceMemory> cuda_stream_memory(std::shared_ptr<CudaStream> stream, CopyMode copies) {
  return std::make_shared<CudaStreamMemory>(std::move(stream), copies, nullptr);
}

}  // namespace offgraph_kv
