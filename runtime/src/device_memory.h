// Where KV storage lives. The store only ever allocates, copies and releases
// through this face, so host and device storage share one growth path.
#pragma once

#include <cstddef>
#include <cstring>
#include <memory>
#include <shared_mutex>
#include <utility>
#include <vector>

#include "status.h"

namespace offgraph_kv {

struct CopyOp {
  void* dst;
  const void* src;
  size_t bytes;
};

// Address space reserved up front for `segments` regions, each for its full
// size, and backed by memory only as far as commit() asks: a region's base
// never moves, so growing one copies nothing and rebinds nothing. Backing
// comes in chunks (chunk_bytes(): the device's mapping granularity); every
// mapping and the reservation itself are released on destruction.
class Reservation {
 public:
  virtual ~Reservation() = default;
  virtual void* base(size_t segment) const = 0;
  virtual size_t segments() const = 0;
  // Back at least the first bytes[s] bytes of every segment s. All or
  // nothing: on failure every segment keeps exactly the backing it had.
  virtual Status commit(const std::vector<size_t>& bytes) = 0;
  // Give back the backing beyond the first bytes[s] bytes of each segment
  // (what holds those bytes stays). Waits for queued work that may read it.
  virtual void release_beyond(const std::vector<size_t>& bytes) = 0;
  virtual size_t committed_bytes() const = 0;  // backed, all segments
  virtual size_t reserved_bytes() const = 0;   // address space, all segments
  virtual size_t chunk_bytes() const = 0;
};

class DeviceMemory {
 public:
  virtual ~DeviceMemory() = default;
  // nullptr when the allocation cannot be made.
  virtual void* allocate(size_t bytes) = 0;
  // Must not free while work that reads `ptr` may still be in flight.
  virtual void release(void* ptr) = 0;
  virtual void copy(void* dst, const void* src, size_t bytes) = 0;
  // Independent copies (no overlap); devices may submit them as one batch.
  virtual void copy_many(const std::vector<CopyOp>& copies) {
    for (const CopyOp& c : copies) copy(c.dst, c.src, c.bytes);
  }
  virtual void zero(void* dst, size_t bytes) = 0;
  // Between this memory and the host, complete on return (saved contexts).
  virtual void copy_to_host(void* host, const void* src, size_t bytes) { std::memcpy(host, src, bytes); }
  virtual void copy_from_host(void* dst, const void* host, size_t bytes) { std::memcpy(dst, host, bytes); }
  // Wait until queued work (copies, frees) is done; host memory has none.
  virtual void synchronize() {}
  // Hand memory that no live buffer holds back to the system (waiting for
  // queued frees first). The store calls it once the step after a growth has
  // completed, so device memory follows the arena in use rather than keeping
  // every arena it ever had. Host memory is freed at once: nothing to do.
  virtual void return_unused() {}
  virtual const char* name() const = 0;
  // Address space for regions of `segment_bytes` each, backed as they grow
  // (Reservation). nullptr with a message where this memory cannot (no
  // virtual-memory API, the reservation refused): the store then grows by copy.
  virtual std::unique_ptr<Reservation> reserve(const std::vector<size_t>& segment_bytes, Status* status) {
    *status = Status(Error::NotSupported, std::string(name()) + " memory cannot reserve address space");
    return nullptr;
  }
  // Whether growth="auto" maps on this memory (where it measured better than copying).
  virtual bool maps_by_default() const { return false; }
  // The lock of the stream this memory's work is queued on, shared with the
  // steps on it (nullptr: work completes on return, nothing to order).
  virtual std::shared_mutex* turns() { return nullptr; }
};

// 64-byte aligned host memory.
std::shared_ptr<DeviceMemory> host_memory();

// One allocation, released on destruction (RAII for every allocation).
class Buffer {
 public:
  Buffer() = default;
  Buffer(std::shared_ptr<DeviceMemory> memory, void* ptr, size_t bytes)
      : memory_(std::move(memory)), ptr_(ptr), bytes_(bytes) {}
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  Buffer(Buffer&& other) noexcept { *this = std::move(other); }
  Buffer& operator=(Buffer&& other) noexcept {
    if (this != &other) {
      reset();
      memory_ = std::move(other.memory_);
      ptr_ = std::exchange(other.ptr_, nullptr);
      bytes_ = std::exchange(other.bytes_, 0);
    }
    return *this;
  }
  ~Buffer() { reset(); }

  void reset() {
    if (ptr_ != nullptr) memory_->release(ptr_);
    ptr_ = nullptr;
    bytes_ = 0;
  }
  void* data() const { return ptr_; }
  size_t bytes() const { return bytes_; }

 private:
  std::shared_ptr<DeviceMemory> memory_;
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
};

// Allocate through `memory`; an empty Buffer (data() == nullptr) on failure.
inline Buffer allocate_buffer(const std::shared_ptr<DeviceMemory>& memory, size_t bytes) {
  void* p = bytes == 0 ? nullptr : memory->allocate(bytes);
  return p == nullptr ? Buffer() : Buffer(memory, p, bytes);
}

}  // namespace offgraph_kv
