#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>

#include "device_memory.h"

namespace offgraph_kv {
namespace {

// Address space one store may reserve on the host. x86-64 gives a process 128
// TiB; a store that asks for more than a few TiB (a huge max_capacity) grows
// by copy instead of taking a large share of it.
constexpr size_t kMaxHostReservation = size_t(4) << 40;
// Segment starts: 2 MiB, so the kernel may back a segment with huge pages.
constexpr size_t kSegmentAlign = size_t(2) << 20;

size_t round_up(size_t n, size_t to) { return (n + to - 1) / to * to; }

// One PROT_NONE, MAP_NORESERVE mapping for every segment: address space only.
// commit() makes the rows it asks for readable and writable (pages are then
// materialised, zero-filled, when first written); release_beyond() hands the
// pages back (MADV_DONTNEED) and makes the range inaccessible again.
class HostReservation final : public Reservation {
 public:
  static std::unique_ptr<HostReservation> create(const std::vector<size_t>& segment_bytes, Status* status) {
    std::unique_ptr<HostReservation> r(new HostReservation());
    r->chunk_ = size_t(sysconf(_SC_PAGESIZE));
    size_t total = 0;
    for (size_t bytes : segment_bytes) {
      if (bytes > kMaxHostReservation) total = kMaxHostReservation + 1;
      if (total > kMaxHostReservation) break;
      r->offsets_.push_back(total);
      total += round_up(bytes, kSegmentAlign);
    }
    if (total > kMaxHostReservation) {
      *status = Status(Error::NotSupported, "reserving address space for max_capacity rows of every flat tensor needs more than " +
                                                std::to_string(kMaxHostReservation >> 40) +
                                                " TiB (the cap per store): lower max_capacity to grow by mapping");
      return nullptr;
    }
    if (total == 0) total = kSegmentAlign;
    void* p = mmap(nullptr, total, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) {
      *status = Status(Error::NotSupported, "mmap of " + std::to_string(total) +
                                                " bytes of address space failed: " + std::strerror(errno));
      return nullptr;
    }
    r->base_ = static_cast<char*>(p);
    r->reserved_ = total;
    r->committed_.assign(segment_bytes.size(), 0);
    r->limit_.resize(segment_bytes.size());
    for (size_t s = 0; s < segment_bytes.size(); ++s) r->limit_[s] = round_up(segment_bytes[s], r->chunk_);
    *status = Status::ok_status();
    return r;
  }
  ~HostReservation() override {
    if (base_ != nullptr) munmap(base_, reserved_);
  }

  void* base(size_t segment) const override { return base_ + offsets_[segment]; }
  size_t segments() const override { return offsets_.size(); }

  Status commit(const std::vector<size_t>& bytes) override {
    std::vector<size_t> before = committed_;
    for (size_t s = 0; s < offsets_.size(); ++s) {
      const size_t want = round_up(bytes[s], chunk_);
      if (want <= committed_[s]) continue;
      if (want > limit_[s]) {
        rollback(before);
        return Status(Error::InvalidArgument, "commit of " + std::to_string(bytes[s]) + " bytes beyond segment " +
                                                  std::to_string(s) + "'s reservation of " + std::to_string(limit_[s]));
      }
      if (mprotect(static_cast<char*>(base(s)) + committed_[s], want - committed_[s], PROT_READ | PROT_WRITE) != 0) {
        const int err = errno;
        rollback(before);
        return Status(Error::MemoryAllocationFailed, "cannot commit " + std::to_string(want - committed_[s]) +
                                                         " bytes of host KV storage: " + std::strerror(err));
      }
      committed_[s] = want;
    }
    return Status::ok_status();
  }

  void release_beyond(const std::vector<size_t>& bytes) override {
    for (size_t s = 0; s < offsets_.size(); ++s) decommit(s, round_up(bytes[s], chunk_));
  }

  size_t committed_bytes() const override {
    size_t n = 0;
    for (size_t c : committed_) n += c;
    return n;
  }
  size_t reserved_bytes() const override { return reserved_; }
  size_t chunk_bytes() const override { return chunk_; }

 private:
  HostReservation() = default;
  void decommit(size_t s, size_t keep) {
    if (keep >= committed_[s]) return;
    char* from = static_cast<char*>(base(s)) + keep;
    // The pages go back to the system now; PROT_NONE keeps the range reserved.
    madvise(from, committed_[s] - keep, MADV_DONTNEED);
    mprotect(from, committed_[s] - keep, PROT_NONE);
    committed_[s] = keep;
  }
  void rollback(const std::vector<size_t>& before) {
    for (size_t s = 0; s < offsets_.size(); ++s) decommit(s, before[s]);
  }

  char* base_ = nullptr;
  size_t reserved_ = 0;
  size_t chunk_ = 4096;
  std::vector<size_t> offsets_;    // segment starts in the mapping
  std::vector<size_t> limit_;      // each segment's reserved bytes (chunk-rounded)
  std::vector<size_t> committed_;  // each segment's accessible prefix
};

class HostMemory final : public DeviceMemory {
 public:
  void* allocate(size_t bytes) override {
    constexpr size_t kAlign = 64;  // a cache line, and what vector loads like
    return std::aligned_alloc(kAlign, (bytes + kAlign - 1) / kAlign * kAlign);
  }
  void release(void* ptr) override { std::free(ptr); }
  void copy(void* dst, const void* src, size_t bytes) override {
    std::memcpy(dst, src, bytes);
  }
  void zero(void* dst, size_t bytes) override { std::memset(dst, 0, bytes); }
  const char* name() const override { return "cpu"; }
  std::unique_ptr<Reservation> reserve(const std::vector<size_t>& segment_bytes, Status* status) override {
    return HostReservation::create(segment_bytes, status);
  }
  bool maps_by_default() const override { return true; }
};

}  // namespace

std::shared_ptr<DeviceMemory> host_memory() {
  static std::shared_ptr<DeviceMemory> memory = std::make_shared<HostMemory>();
  return memory;
}

}  // namespace offgraph_kv
