// KVStore: the KV storage one loaded method owns, and its step transitions.
//
//   idle --prepare_step(w)--> prepared(w) --commit_step--> idle (length += w)
//                                  \--------abort_step----> idle (length kept)
//   idle --rewind(n)--> idle (length -= n)     idle --reset--> idle (length 0)
//   empty --load_context(file)--> idle (length = the file's)
//
// prepare_step does everything that can fail (checks, growth) before the
// compiled code runs; commit_step cannot fail. A step that is rejected or whose
// run fails is aborted, so `length` and every committed row stay as they were.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <string>
#include <vector>

#include "device_memory.h"
#include "growth_policy.h"
#include "status.h"
#include "storage_dtype.h"
#include "tensor_spec.h"

namespace offgraph_kv {

// What the compiled code sees for one private tensor: [1, rows, H, D], dense.
struct Binding {
  void* data = nullptr;
  int64_t rows = 0;
};

struct LayerMetrics {
  uint32_t layer;
  LayerKind kind;
  uint32_t window;
  size_t rows;   // capacity (flat) or slots (ring)
  size_t bytes;  // K and V together
};

struct StoreMetrics {
  size_t length = 0;
  size_t capacity = 0;
  size_t allocated_bytes = 0;  // backed: rings, and the flat arena or the mapped chunks
  size_t peak_bytes = 0;
  size_t reserved_bytes = 0;   // address space held for map growth (0 with copy growth)
  GrowthMode growth = GrowthMode::Copy;  // in effect: Map or Copy
  std::string growth_note;     // why map growth was not used, when it was not
  size_t growths = 0;
  size_t steps = 0;         // committed steps
  size_t graph_captures = 0;  // CUDA graphs captured for decode steps (step_graph.h)
  size_t graph_replays = 0;   // committed steps that replayed one
  uint64_t host_ns = 0;     // host work of those steps (width, prepare, bind, commit)
  StorageDType dtype = StorageDType::BFloat16;
  std::vector<LayerMetrics> layers;
};

class KVStore {
 public:
  // Allocates every tensor at its initial size (rings at their full size).
  static std::unique_ptr<KVStore> create(std::vector<TensorSpec> tensors, GrowthPolicy policy,
                                         size_t max_write, std::shared_ptr<DeviceMemory> memory,
                                         Status* status);

  // Check the step and make room for it; nothing committed changes on failure.
  Status prepare_step(size_t width);
  // Make the prepared step's rows part of the history; after a growth, give
  // the old arena's memory back (call it once the step's work has completed).
  void commit_step();
  // Forget the prepared step (its rows were never committed).
  void abort_step();

  // The view the compiled code binds for tensor i during a prepared step (idle:
  // the committed rows).
  Binding binding(size_t i) const;
  // The widest view of tensor i whose address and extent hold until the
  // storage itself moves: flat tensors whole (every reserved row with map
  // growth, the arena's rows with copy growth), rings as always. For code
  // that takes a flat extent only as a bound (lengths_from_device), so a
  // captured step stays valid as the context grows.
  Binding fixed_binding(size_t i) const;

  // Drop the history; with release_memory, shrink back to the initial allocation.
  Status reset(bool release_memory);
  // Forget the newest n committed positions (idle only). Flat layers simply
  // forget them; a ring layer can go back only while every position its window
  // then needs is still in its slots: at least max_write + rewind_budget
  // positions after any step. Beyond that: an error naming the budget, nothing changed.
  Status rewind(size_t n);
  // Whether n more tokens fit under max_capacity.
  // Held by the executor for a whole step, and taken by every control-face
  // call (rewind, reset, save, load, metrics): a call from another thread
  // waits for the step to end instead of changing the store under it.
  std::mutex& access() const { return access_; }
  bool can_extend(size_t n) const { return n <= policy_.max_capacity && length_ <= policy_.max_capacity - n; }
  // Writes the committed rows of every tensor (rings in position order), the
  // length and the program's identity to `path` (atomically: a temp file,
  // then rename), with a SHA-256 of the whole.
  Status save_context(const std::string& path) const;
  // Restores a saved context into this store, which must be empty; anything
  // else (another program's file, a truncated or corrupt one) is refused and
  // leaves the store empty and usable.
  Status load_context(const std::string& path);
  // What a saved context must match: the compiled code and the tensors' shapes.
  void set_identity(std::string identity) { identity_ = std::move(identity); }

  StoreMetrics metrics() const;
  void record_host_time(uint64_t ns) { host_ns_ += ns; }
  void record_graph_capture() { ++graph_captures_; }
  void record_graph_replay() { ++graph_replays_; }
  size_t length() const { return length_; }
  size_t capacity() const { return capacity_; }
  const std::vector<TensorSpec>& tensors() const { return tensors_; }
  const GrowthPolicy& policy() const { return policy_; }

 private:
  KVStore(std::vector<TensorSpec> tensors, GrowthPolicy policy, size_t max_write,
          std::shared_ptr<DeviceMemory> memory);
  size_t rows_of(size_t i, size_t flat_capacity) const;
  // Zero the ring slots of positions [from, to) (every slot when the range is at least a ring).
  void clear_ring_positions(size_t from, size_t to);
  // The control face (rewind, reset, save, load) queues device work outside
  // any step: it takes a turn on the memory's stream as a step does, so a
  // capture on another thread cannot record it.
  std::shared_lock<std::shared_mutex> control_turn() const;
  size_t bytes_at(size_t flat_capacity) const;
  // All-or-nothing: either every flat tensor moves to `new_capacity` with its
  // committed rows, or nothing changes. Copy growth: one allocation and one
  // batched copy per growth, whatever the layer count (per-tensor allocations
  // dominated growth time on the H200). Map growth: more of each tensor's
  // reserved range is backed (or, shrinking, given back); rows stay in place.
  Status resize_flat(size_t new_capacity, size_t rows_to_keep);
  // Map growth when the policy asks for it and the memory can reserve
  // max_capacity rows of every flat tensor; otherwise copy growth, and why.
  void choose_growth();
  void note_allocated(size_t bytes);
  // Give a released arena's memory back to the system (see DeviceMemory::return_unused).
  void return_released_memory();
  // Where each flat tensor starts in an arena of `capacity` rows (aligned), and its size.
  std::vector<size_t> arena_offsets(size_t capacity, size_t* total) const;
  // Storage of tensor i: its ring, or its region of the flat arena.
  void* data_of(size_t i) const;

  std::vector<TensorSpec> tensors_;
  std::vector<Buffer> rings_;       // one allocation per ring tensor, made once
  Buffer flat_arena_;               // every flat tensor, in one allocation per capacity
  std::vector<size_t> flat_offset_; // byte offset of flat tensor i in the arena
  // Map growth (in effect iff reservation_ is set): one reserved range per flat tensor (its base never moves).
  std::unique_ptr<Reservation> reservation_;
  std::vector<size_t> segment_of_;  // flat tensor i -> its range in reservation_
  std::vector<void*> mapped_base_;  // flat tensor i -> that range's base
  std::string growth_note_;
  GrowthPolicy policy_;
  size_t max_write_;
  bool has_flat_;  // fixed by the manifest: derived once, not per step
  bool has_ring_;
  std::shared_ptr<DeviceMemory> memory_;
  std::string identity_;
  size_t length_ = 0;
  // Per tensor: the lowest position whose row is still in the tensor (flat: 0;
  // ring: raised as steps overwrite slots). Rewinds never go below what a ring
  // window then needs.
  std::vector<size_t> kept_from_;
  size_t capacity_ = 0;  // rows of every flat tensor
  size_t pending_ = 0;   // width of the prepared step, 0 when idle
  mutable std::mutex access_;
  bool released_arena_ = false;  // an old arena was released since memory was last returned
  size_t allocated_ = 0;
  size_t peak_ = 0;
  size_t growths_ = 0;
  size_t steps_ = 0;
  uint64_t host_ns_ = 0;
  size_t graph_captures_ = 0;
  size_t graph_replays_ = 0;
};

}  // namespace offgraph_kv
