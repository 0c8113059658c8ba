#include "growth_benchmark.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <vector>

#ifdef OFFGRAPH_KV_WITH_CUDA
#include <cuda_runtime.h>

#include "segment_copy.h"
#endif

#include "kv_store.h"
#include "step_io.h"

namespace offgraph_kv {
namespace {

#ifdef OFFGRAPH_KV_WITH_CUDA
// A pair of CUDA events on one stream; times nothing without a stream.
class DeviceTimer {
 public:
  explicit DeviceTimer(void* stream) : stream_(static_cast<cudaStream_t>(stream)) {
    if (stream_ != nullptr && (cudaEventCreate(&start_) != cudaSuccess || cudaEventCreate(&stop_) != cudaSuccess))
      stream_ = nullptr;
  }
  ~DeviceTimer() {
    if (start_ != nullptr) cudaEventDestroy(start_);
    if (stop_ != nullptr) cudaEventDestroy(stop_);
  }
  DeviceTimer(const DeviceTimer&) = delete;
  DeviceTimer& operator=(const DeviceTimer&) = delete;
  void start() {
    if (stream_ != nullptr) cudaEventRecord(start_, stream_);
  }
  void stop() {
    if (stream_ != nullptr) cudaEventRecord(stop_, stream_);
  }
  // Seconds between start and stop; waits for stop. 0 without a stream.
  double seconds() {
    float ms = 0;
    if (stream_ == nullptr || cudaEventSynchronize(stop_) != cudaSuccess ||
        cudaEventElapsedTime(&ms, start_, stop_) != cudaSuccess)
      return 0;
    return ms / 1e3;
  }

 private:
  cudaStream_t stream_ = nullptr;
  cudaEvent_t start_ = nullptr;
  cudaEvent_t stop_ = nullptr;
};
#else
// Host-only build: nothing runs on a stream.
class DeviceTimer {
 public:
  explicit DeviceTimer(void*) {}
  void start() {}
  void stop() {}
  double seconds() { return 0; }
};
#endif

// Forwards to the store's memory and times its batch of copies on the stream.
class CopyTimedMemory final : public DeviceMemory {
 public:
  CopyTimedMemory(std::shared_ptr<DeviceMemory> inner, void* stream) : inner_(std::move(inner)), timer_(stream) {}
  void* allocate(size_t bytes) override { return inner_->allocate(bytes); }
  void release(void* ptr) override { inner_->release(ptr); }
  void copy(void* dst, const void* src, size_t bytes) override { inner_->copy(dst, src, bytes); }
  void copy_many(const std::vector<CopyOp>& copies) override {
    timer_.start();
    inner_->copy_many(copies);
    timer_.stop();
  }
  void zero(void* dst, size_t bytes) override { inner_->zero(dst, bytes); }
  void synchronize() override { inner_->synchronize(); }
  void return_unused() override { inner_->return_unused(); }
  const char* name() const override { return inner_->name(); }
  std::unique_ptr<Reservation> reserve(const std::vector<size_t>& segment_bytes, Status* status) override {
    return inner_->reserve(segment_bytes, status);
  }
  bool maps_by_default() const override { return inner_->maps_by_default(); }
  DeviceTimer& timer() { return timer_; }

 private:
  std::shared_ptr<DeviceMemory> inner_;
  DeviceTimer timer_;
};

}  // namespace

Status time_growth(const std::string& device, size_t layers, size_t heads, size_t head_dim, int dtype,
                   size_t rows_before, size_t rows_after, int repeats, const std::string& copy_mode,
                   bool fresh_memory, const std::string& growth, bool touch, GrowthTiming* out) {
  if (!is_supported(dtype)) return Status(Error::InvalidArgument, "unsupported dtype " + std::to_string(dtype));
  if (rows_before == 0 || rows_after <= rows_before || repeats <= 0)
    return Status(Error::InvalidArgument, "need 0 < rows_before < rows_after and repeats > 0");
  CopyMode mode = CopyMode::Auto;
  if (!parse_copy_mode(copy_mode, &mode))
    return Status(Error::InvalidArgument, "copy_mode '" + copy_mode + "': expected auto, kernel, batch or each");
  GrowthMode growth_mode = GrowthMode::Copy;
  if (!parse_growth_mode(growth, &growth_mode))
    return Status(Error::InvalidArgument, "growth '" + growth + "': expected copy, map or auto");
  Status s;
  std::unique_ptr<StepIO> io = device == "cuda" ? cuda_step_io(&s, mode) : host_step_io();
  if (!io) return s;
  const std::vector<TensorSpec> tensors =
      flat_layer_specs(layers, uint32_t(heads), uint32_t(head_dim), static_cast<StorageDType>(dtype), 0);
  GrowthPolicy policy;
  policy.growth = growth_mode;
  policy.initial_capacity = rows_before;
  policy.max_capacity = rows_after;
  policy.growth_factor = double(rows_after) / double(rows_before) + 1e-9;
  // On CUDA the growth, and the copy inside it, are also timed by events on
  // the store's stream: the same clock the memcpy it is compared with is timed
  // by, without the host's sync.
  void* stream = device == "cuda" ? io->stream() : nullptr;
  DeviceTimer timer(stream);
  auto memory = std::make_shared<CopyTimedMemory>(io->memory(), stream);
  double total = 0, device_total = 0, copy_total = 0;
  std::vector<unsigned char> pattern;
  auto device_used = [&]() -> size_t {
#ifdef OFFGRAPH_KV_WITH_CUDA
    if (device == "cuda") {
      size_t free_bytes = 0, total_bytes = 0;
      cudaMemGetInfo(&free_bytes, &total_bytes);
      return total_bytes - free_bytes;
    }
#endif
    return 0;
  };
  for (int i = 0; i < repeats + 1; ++i) {  // the first round warms up (code, pool creation)
    memory->synchronize();
    const size_t used_before = device_used();
    std::unique_ptr<KVStore> store = KVStore::create(tensors, policy, 1, memory, &s);
    if (!store) return s;
    if (!(s = store->prepare_step(rows_before)).ok()) return s;
    store->commit_step();
    if (fresh_memory) memory->return_unused();  // what a completed step leaves: the arena in use, nothing spare
    memory->synchronize();
    const auto t0 = std::chrono::steady_clock::now();
    timer.start();
    if (!(s = store->prepare_step(1)).ok()) return s;  // the growth
    if (touch) {
      // The rows the steps after the growth write: on the host, first touch of fresh pages.
      for (size_t t = 0; t < tensors.size(); ++t) {
        const size_t rb = tensors[t].row_bytes();
        const size_t bytes = (rows_after - rows_before) * rb;
        char* at = static_cast<char*>(store->binding(t).data) + rows_before * rb;
        if (device == "cuda") {
          memory->zero(at, bytes);
        } else {
          std::memset(at, 0x11, bytes);
        }
      }
    }
    timer.stop();
    memory->synchronize();
    const auto t1 = std::chrono::steady_clock::now();
    out->device_peak_bytes = std::max(out->device_peak_bytes, device_used() - used_before);
    if (store->capacity() != rows_after) return Status(Error::Internal, "growth did not reach rows_after");
    const StoreMetrics m = store->metrics();
    out->peak_bytes = m.peak_bytes;
    out->allocated_bytes = m.allocated_bytes;
    out->growth = growth_mode_name(m.growth);
    if (i == 0 && m.growth == GrowthMode::Copy)
      for (const TensorSpec& t : tensors) out->bytes_copied += rows_before * t.row_bytes();
    if (i > 0) {
      total += std::chrono::duration<double>(t1 - t0).count();
      device_total += timer.seconds();
      copy_total += memory->timer().seconds();
    }
    store.reset();
    memory->synchronize();
  }
  out->seconds = total / repeats;
  out->device_seconds = device_total / repeats;
  out->copy_device_seconds = copy_total / repeats;
  return Status::ok_status();
}

Status reservation_cost(const std::string& device, size_t layers, size_t heads, size_t head_dim, int dtype,
                        size_t initial_rows, size_t max_rows, ReservationCost* out) {
  if (!is_supported(dtype)) return Status(Error::InvalidArgument, "unsupported dtype " + std::to_string(dtype));
  if (initial_rows == 0 || initial_rows > max_rows)
    return Status(Error::InvalidArgument, "need 0 < initial_rows <= max_rows");
  Status s;
  std::unique_ptr<StepIO> io = device == "cuda" ? cuda_step_io(&s) : host_step_io();
  if (!io) return s;
  auto used = [&]() -> long long {
#ifdef OFFGRAPH_KV_WITH_CUDA
    if (device == "cuda") {
      size_t free_bytes = 0, total_bytes = 0;
      cudaDeviceSynchronize();
      cudaMemGetInfo(&free_bytes, &total_bytes);
      return (long long)(total_bytes - free_bytes);
    }
#endif
    return 0;
  };
  GrowthPolicy policy;
  policy.initial_capacity = initial_rows;
  policy.max_capacity = max_rows;
  policy.growth = GrowthMode::Map;
  const long long before = used();
  std::unique_ptr<KVStore> store = KVStore::create(
      flat_layer_specs(layers, uint32_t(heads), uint32_t(head_dim), static_cast<StorageDType>(dtype), 0), policy, 1,
      io->memory(), &s);
  if (!store) return s;
  out->device_used_delta = used() - before;
  const StoreMetrics m = store->metrics();
  out->reserved_bytes = m.reserved_bytes;
  out->allocated_bytes = m.allocated_bytes;
  out->growth = growth_mode_name(m.growth);
  out->note = m.growth_note;
  return Status::ok_status();
}

std::pair<int, int> set_copy_kernel_grid(int blocks_per_sm) {
#ifdef OFFGRAPH_KV_WITH_CUDA
  if (!segment_copy_available()) return {0, 0};
  return {set_segment_copy_blocks_per_sm(blocks_per_sm), segment_copy_resident_blocks_per_sm()};
#else
  (void)blocks_per_sm;
  return {0, 0};
#endif
}

}  // namespace offgraph_kv
