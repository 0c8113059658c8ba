// Store fixtures shared by the unit tests: a memory that counts and refuses,
// small flat layers, a policy, and a byte pattern to write and check rows with.
#pragma once

#include <cstring>
#include <vector>

#include "growth_policy.h"
#include "kv_store.h"

namespace offgraph_kv::testing {

// Host memory that counts what the store asks of it and can be told to refuse
// the next allocations.
class FailingMemory final : public DeviceMemory {
 public:
  int fail_after = -1;  // allocations left before refusing; -1 = never refuse
  int allocations = 0;
  int batches = 0;
  size_t batch_copies = 0;
  int returns = 0;  // return_unused calls
  void* allocate(size_t bytes) override {
    if (fail_after == 0) return nullptr;
    if (fail_after > 0) --fail_after;
    ++allocations;
    return host_memory()->allocate(bytes);
  }
  void copy_many(const std::vector<CopyOp>& copies) override {
    ++batches;
    batch_copies += copies.size();
    DeviceMemory::copy_many(copies);
  }
  void release(void* p) override { host_memory()->release(p); }
  void copy(void* d, const void* s, size_t n) override { host_memory()->copy(d, s, n); }
  void zero(void* d, size_t n) override { host_memory()->zero(d, n); }
  void return_unused() override { ++returns; }
  const char* name() const override { return "failing"; }
};

inline std::vector<TensorSpec> flat_layers(size_t layers, StorageDType dtype, uint32_t heads = 2, uint32_t head_dim = 4) {
  return flat_layer_specs(layers, heads, head_dim, dtype, 2);
}

inline GrowthPolicy policy(size_t initial, size_t max, double factor = 2.0, GrowthMode growth = GrowthMode::Auto) {
  GrowthPolicy p;
  p.initial_capacity = initial;
  p.max_capacity = max;
  p.growth_factor = factor;
  p.growth = growth;
  return p;
}

// Host memory whose reservations refuse commits once `commits_left` reaches 0
// (the real host reservation underneath, so refused commits are the only
// difference): the store's map growth must then leave everything as it was.
class RefusingMapMemory final : public DeviceMemory {
 public:
  int commits_left = -1;  // -1: never refuse
  void* allocate(size_t bytes) override { return host_memory()->allocate(bytes); }
  void release(void* p) override { host_memory()->release(p); }
  void copy(void* d, const void* s, size_t n) override { host_memory()->copy(d, s, n); }
  void zero(void* d, size_t n) override { host_memory()->zero(d, n); }
  const char* name() const override { return "refusing-map"; }
  std::unique_ptr<Reservation> reserve(const std::vector<size_t>& segment_bytes, Status* status) override {
    std::unique_ptr<Reservation> inner = host_memory()->reserve(segment_bytes, status);
    if (!inner) return nullptr;
    return std::make_unique<Refusing>(std::move(inner), &commits_left);
  }

 private:
  class Refusing final : public Reservation {
   public:
    Refusing(std::unique_ptr<Reservation> inner, int* left) : inner_(std::move(inner)), left_(left) {}
    void* base(size_t s) const override { return inner_->base(s); }
    size_t segments() const override { return inner_->segments(); }
    Status commit(const std::vector<size_t>& bytes) override {
      if (*left_ == 0) return Status(Error::MemoryAllocationFailed, "commit refused (test)");
      if (*left_ > 0) --*left_;
      return inner_->commit(bytes);
    }
    void release_beyond(const std::vector<size_t>& bytes) override { inner_->release_beyond(bytes); }
    size_t committed_bytes() const override { return inner_->committed_bytes(); }
    size_t reserved_bytes() const override { return inner_->reserved_bytes(); }
    size_t chunk_bytes() const override { return inner_->chunk_bytes(); }

   private:
    std::unique_ptr<Reservation> inner_;
    int* left_;
  };
};

// Writes `width` rows of the prepared step with a recognisable byte pattern.
inline void fill_step(KVStore& s, size_t width) {
  for (size_t i = 0; i < s.tensors().size(); ++i) {
    const Binding b = s.binding(i);
    const size_t rb = s.tensors()[i].row_bytes();
    for (size_t r = size_t(b.rows) - width; r < size_t(b.rows); ++r)
      std::memset(static_cast<char*>(b.data) + r * rb, int((r * 7 + i) & 0xff), rb);
  }
}

inline bool rows_intact(const KVStore& s, size_t upto) {
  for (size_t i = 0; i < s.tensors().size(); ++i) {
    const size_t rb = s.tensors()[i].row_bytes();
    for (size_t r = 0; r < upto; ++r) {
      // Idle, a binding is the committed rows: its data is row 0.
      const auto* p = static_cast<const unsigned char*>(s.binding(i).data) + r * rb;
      for (size_t b = 0; b < rb; ++b)
        if (p[b] != ((r * 7 + i) & 0xff)) return false;
    }
  }
  return true;
}


}  // namespace offgraph_kv::testing
