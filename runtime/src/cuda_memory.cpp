#include "cuda_memory.h"

// Types of the driver's virtual-memory API only: its entry points are looked up
// at run time through the CUDA runtime, so nothing links libcuda.
#include <cuda.h>

#include <cstdint>
#include <mutex>
#include <utility>
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

// The driver's virtual-memory entry points, looked up once through the CUDA
// runtime (cudaGetDriverEntryPointByVersion): no libcuda at link time. Empty
// (ok() false, with why) where the driver lacks any of them.
struct DriverVmm {
  decltype(&cuMemAddressReserve) address_reserve = nullptr;
  decltype(&cuMemAddressFree) address_free = nullptr;
  decltype(&cuMemCreate) create = nullptr;
  decltype(&cuMemRelease) release = nullptr;
  decltype(&cuMemMap) map = nullptr;
  decltype(&cuMemUnmap) unmap = nullptr;
  decltype(&cuMemSetAccess) set_access = nullptr;
  decltype(&cuMemGetAllocationGranularity) granularity = nullptr;
  decltype(&cuDeviceGetAttribute) device_attribute = nullptr;
  decltype(&cuGetErrorString) error_string = nullptr;
  std::string why;  // empty when every entry point was found
  bool ok() const { return why.empty(); }

  std::string error(const char* what, CUresult r) const {
    const char* text = nullptr;
    if (error_string == nullptr || error_string(r, &text) != CUDA_SUCCESS || text == nullptr) text = "unknown error";
    return std::string(what) + ": " + text + " (CUresult " + std::to_string(int(r)) + ")";
  }
};

template <typename Fn>
bool entry_point(const char* symbol, Fn* out, std::string* why) {
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
  // 12000: the ABI of these entry points as of CUDA 12 (none changed since).
  cudaError_t e = cudaGetDriverEntryPointByVersion(symbol, &fn, 12000, cudaEnableDefault, &found);
  if (e != cudaSuccess || found != cudaDriverEntryPointSuccess || fn == nullptr) {
    cudaGetLastError();
    if (why->empty()) *why = std::string("the CUDA driver has no ") + symbol;
    return false;
  }
  *out = reinterpret_cast<Fn>(fn);
  return true;
}

const DriverVmm& driver_vmm() {
  static DriverVmm api;
  static std::once_flag once;
  std::call_once(once, [] {
    DriverVmm& a = api;
    std::string why;
    entry_point("cuMemAddressReserve", &a.address_reserve, &why);
    entry_point("cuMemAddressFree", &a.address_free, &why);
    entry_point("cuMemCreate", &a.create, &why);
    entry_point("cuMemRelease", &a.release, &why);
    entry_point("cuMemMap", &a.map, &why);
    entry_point("cuMemUnmap", &a.unmap, &why);
    entry_point("cuMemSetAccess", &a.set_access, &why);
    entry_point("cuMemGetAllocationGranularity", &a.granularity, &why);
    entry_point("cuDeviceGetAttribute", &a.device_attribute, &why);
    entry_point("cuGetErrorString", &a.error_string, &why);
    a.why = why;
  });
  return api;
}

size_t round_up(size_t n, size_t to) { return (n + to - 1) / to * to; }

// Physical memory mapped at one address of a reservation: unmapped and
// released on destruction (RAII for the handle and the mapping).
class Mapping {
 public:
  Mapping(const DriverVmm* api, CUdeviceptr at, size_t bytes, CUmemGenericAllocationHandle handle)
      : api_(api), at_(at), bytes_(bytes), handle_(handle) {}
  Mapping(const Mapping&) = delete;
  Mapping& operator=(const Mapping&) = delete;
  Mapping(Mapping&& o) noexcept
      : api_(o.api_), at_(o.at_), bytes_(std::exchange(o.bytes_, 0)), handle_(std::exchange(o.handle_, 0)) {}
  Mapping& operator=(Mapping&&) = delete;
  ~Mapping() {
    if (bytes_ == 0) return;
    api_->unmap(at_, bytes_);
    api_->release(handle_);
  }
  size_t bytes() const { return bytes_; }

 private:
  const DriverVmm* api_;
  CUdeviceptr at_;
  size_t bytes_;
  CUmemGenericAllocationHandle handle_;
};

// One cuMemAddressReserve for every segment (each sized for max_capacity rows,
// rounded up to the granularity, so segments start on chunk boundaries).
// commit() backs a segment's new tail with one physical allocation of that
// tail's size (cuMemCreate, a multiple of the granularity), mapped and made
// accessible there: one allocation per flat tensor per growth, whatever its
// size. release_beyond() unmaps and releases whole allocations past what is
// kept, after the stream's queued work (which may read them) completes.
class CudaReservation final : public Reservation {
 public:
  static std::unique_ptr<CudaReservation> create(std::shared_ptr<CudaStream> stream,
                                                 const std::vector<size_t>& segment_bytes, Status* status) {
    const DriverVmm& api = driver_vmm();
    if (!api.ok()) {
      *status = Status(Error::NotSupported, api.why);
      return nullptr;
    }
    int device = 0;
    cudaError_t e = cudaGetDevice(&device);
    // The driver calls below act on the thread's current context: the runtime's primary one.
    if (e == cudaSuccess) e = cudaSetDevice(device);
    if (e != cudaSuccess) {
      *status = Status(Error::NotSupported, cuda_error("cudaGetDevice", e));
      return nullptr;
    }
    int supported = 0;
    CUresult r = api.device_attribute(&supported, CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, device);
    if (r != CUDA_SUCCESS || !supported) {
      *status = Status(Error::NotSupported, r != CUDA_SUCCESS ? api.error("cuDeviceGetAttribute", r)
                                                              : "device " + std::to_string(device) +
                                                                    " does not support virtual memory management");
      return nullptr;
    }
    std::unique_ptr<CudaReservation> res(new CudaReservation(&api, std::move(stream), device));
    size_t granularity = 0;
    r = api.granularity(&granularity, &res->prop_, CU_MEM_ALLOC_GRANULARITY_MINIMUM);
    if (r != CUDA_SUCCESS || granularity == 0) {
      *status = Status(Error::NotSupported, api.error("cuMemGetAllocationGranularity", r));
      return nullptr;
    }
    res->chunk_ = granularity;
    size_t total = 0;
    for (size_t bytes : segment_bytes) {
      res->offsets_.push_back(total);
      res->limit_.push_back(round_up(bytes, granularity));
      if (res->limit_.back() > SIZE_MAX / 2 - total) {
        *status = Status(Error::NotSupported, "the reservation for max_capacity rows overflows the address space");
        return nullptr;
      }
      total += res->limit_.back();
    }
    if (total == 0) total = granularity;
    r = api.address_reserve(&res->base_, total, granularity, 0, 0);
    if (r != CUDA_SUCCESS) {
      res->base_ = 0;
      *status = Status(Error::NotSupported, api.error(("cuMemAddressReserve of " + std::to_string(total) + " bytes").c_str(), r));
      return nullptr;
    }
    res->reserved_ = total;
    res->maps_.resize(segment_bytes.size());
    res->committed_.assign(segment_bytes.size(), 0);
    *status = Status::ok_status();
    return res;
  }

  ~CudaReservation() override {
    // Kernels queued on the stream may still read the mappings.
    cudaStreamSynchronize(stream_->get());
    cudaSetDevice(device_);
    maps_.clear();
    if (base_ != 0) api_->address_free(base_, reserved_);
    cudaGetLastError();
  }

  void* base(size_t segment) const override { return reinterpret_cast<void*>(base_ + offsets_[segment]); }
  size_t segments() const override { return offsets_.size(); }

  Status commit(const std::vector<size_t>& bytes) override {
    // The driver API acts on the calling thread's current context: make it the
    // runtime's primary context of this device (a step may run on any thread).
    cudaError_t e = cudaSetDevice(device_);
    if (e != cudaSuccess) return Status(Error::Internal, cuda_error("cudaSetDevice", e));
    const std::vector<size_t> before = committed_;
    std::vector<size_t> mapped_before(maps_.size());
    for (size_t s = 0; s < maps_.size(); ++s) mapped_before[s] = maps_[s].size();
    for (size_t s = 0; s < offsets_.size(); ++s) {
      const size_t want = round_up(bytes[s], chunk_);
      if (want <= committed_[s]) continue;
      Status st = want > limit_[s] ? Status(Error::InvalidArgument, "commit of " + std::to_string(bytes[s]) +
                                                                        " bytes beyond segment " + std::to_string(s) +
                                                                        "'s reservation of " + std::to_string(limit_[s]))
                                   : map_tail(s, want);
      if (!st.ok()) {
        // All or nothing: unmap what this call mapped.
        for (size_t t = 0; t < maps_.size(); ++t)
          while (maps_[t].size() > mapped_before[t]) maps_[t].pop_back();
        committed_ = before;
        return st;
      }
    }
    return Status::ok_status();
  }

  void release_beyond(const std::vector<size_t>& bytes) override {
    cudaStreamSynchronize(stream_->get());  // nothing queued may read what is unmapped
    cudaSetDevice(device_);
    for (size_t s = 0; s < offsets_.size(); ++s) {
      const size_t keep = round_up(bytes[s], chunk_);
      // Whole allocations only: the one that holds byte `keep - 1` stays.
      while (!maps_[s].empty() && committed_[s] - maps_[s].back().bytes() >= keep) {
        committed_[s] -= maps_[s].back().bytes();
        maps_[s].pop_back();
      }
    }
    cudaGetLastError();
  }

  size_t committed_bytes() const override {
    size_t n = 0;
    for (size_t c : committed_) n += c;
    return n;
  }
  size_t reserved_bytes() const override { return reserved_; }
  size_t chunk_bytes() const override { return chunk_; }

 private:
  CudaReservation(const DriverVmm* api, std::shared_ptr<CudaStream> stream, int device)
      : api_(api), stream_(std::move(stream)), device_(device) {
    prop_.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop_.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop_.location.id = device;
    prop_.requestedHandleTypes = CU_MEM_HANDLE_TYPE_NONE;
  }

  // Backs segment s from its committed end to `want` bytes with one allocation.
  Status map_tail(size_t s, size_t want) {
    const size_t bytes = want - committed_[s];
    const CUdeviceptr at = base_ + offsets_[s] + committed_[s];
    CUmemGenericAllocationHandle handle = 0;
    CUresult r = api_->create(&handle, bytes, &prop_, 0);
    if (r != CUDA_SUCCESS)
      return Status(Error::MemoryAllocationFailed,
                    api_->error(("cannot allocate " + std::to_string(bytes) + " bytes of KV storage (cuMemCreate)").c_str(), r));
    r = api_->map(at, bytes, 0, handle, 0);
    if (r != CUDA_SUCCESS) {
      api_->release(handle);
      return Status(Error::MemoryAllocationFailed, api_->error("cuMemMap", r));
    }
    Mapping mapping(api_, at, bytes, handle);  // from here its destructor unmaps and releases
    CUmemAccessDesc access{};
    access.location = prop_.location;
    access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    r = api_->set_access(at, bytes, &access, 1);
    if (r != CUDA_SUCCESS) return Status(Error::MemoryAllocationFailed, api_->error("cuMemSetAccess", r));
    maps_[s].push_back(std::move(mapping));
    committed_[s] = want;
    return Status::ok_status();
  }

  const DriverVmm* api_;
  std::shared_ptr<CudaStream> stream_;  // the execution stream: releases wait for it
  int device_;
  CUmemAllocationProp prop_{};
  CUdeviceptr base_ = 0;
  size_t reserved_ = 0;
  size_t chunk_ = 0;
  std::vector<size_t> offsets_;            // segment starts in the reservation
  std::vector<size_t> limit_;              // each segment's reserved bytes
  std::vector<size_t> committed_;          // each segment's backed prefix
  std::vector<std::vector<Mapping>> maps_; // each segment's allocations, in address order
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
  void copy_to_host(void* host, const void* src, size_t bytes) override {
    cudaMemcpyAsync(host, src, bytes, cudaMemcpyDeviceToHost, stream_);
    cudaStreamSynchronize(stream_);
  }
  void copy_from_host(void* dst, const void* host, size_t bytes) override {
    cudaMemcpyAsync(dst, host, bytes, cudaMemcpyHostToDevice, stream_);
    cudaStreamSynchronize(stream_);
  }
  void synchronize() override { cudaStreamSynchronize(stream_); }
  std::shared_mutex* turns() override { return &owner_->turns(); }
  void return_unused() override {
    if (pool_ == nullptr) return;  // the default pool is shared with the process: not ours to trim
    cudaStreamSynchronize(stream_);  // queued frees must have happened to be returned
    cudaMemPoolTrimTo(pool_, 0);     // keeps what live buffers use
    cudaGetLastError();
  }
  const char* name() const override { return "cuda"; }
  std::unique_ptr<Reservation> reserve(const std::vector<size_t>& segment_bytes, Status* status) override {
    return CudaReservation::create(owner_, segment_bytes, status);
  }
  // Map growth copies nothing and keeps every address (issue 19).
  bool maps_by_default() const override { return pool_ != nullptr; }

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
