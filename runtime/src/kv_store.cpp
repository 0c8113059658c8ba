#include "kv_store.h"

#include <executorch/runtime/platform/log.h>

#include <algorithm>
#include <limits>
#include <utility>

namespace offgraph_kv {

std::vector<TensorSpec> flat_layer_specs(size_t layers, uint32_t heads, uint32_t head_dim, StorageDType dtype,
                                         uint32_t first_input) {
  std::vector<TensorSpec> out;
  for (uint32_t l = 0; l < layers; ++l)
    for (uint32_t r = 0; r < 2; ++r) {
      TensorSpec t;
      t.layer = l;
      t.role = r == 0 ? TensorRole::Key : TensorRole::Value;
      t.num_heads = heads;
      t.head_dim = head_dim;
      t.dtype = dtype;
      t.compiled_input = first_input + 2 * l + r;
      out.push_back(t);
    }
  return out;
}

KVStore::KVStore(std::vector<TensorSpec> tensors, GrowthPolicy policy, size_t max_write,
                 std::shared_ptr<DeviceMemory> memory)
    : tensors_(std::move(tensors)),
      policy_(policy),
      max_write_(max_write),
      has_flat_(std::any_of(tensors_.begin(), tensors_.end(),
                            [](const TensorSpec& t) { return t.kind == LayerKind::Flat; })),
      has_ring_(std::any_of(tensors_.begin(), tensors_.end(),
                            [](const TensorSpec& t) { return t.kind == LayerKind::Ring; })),
      memory_(std::move(memory)) {}

std::unique_ptr<KVStore> KVStore::create(std::vector<TensorSpec> tensors, GrowthPolicy policy,
                                         size_t max_write, std::shared_ptr<DeviceMemory> memory,
                                         Status* status) {
  std::unique_ptr<KVStore> store(
      new KVStore(std::move(tensors), policy, max_write, std::move(memory)));
  store->rings_.resize(store->tensors_.size());
  store->kept_from_.assign(store->tensors_.size(), 0);
  for (size_t i = 0; i < store->tensors_.size(); ++i) {
    const TensorSpec& t = store->tensors_[i];
    if (t.kind == LayerKind::Ring && t.window == 0) {
      *status = Status(Error::InvalidProgram,
                       "layer " + std::to_string(t.layer) + ": a ring needs a positive window");
      return nullptr;
    }
    if (t.kind != LayerKind::Ring) continue;
    const size_t bytes = store->rows_of(i, 0) * t.row_bytes();
    store->rings_[i] = allocate_buffer(store->memory_, bytes);
    if (store->rings_[i].data() == nullptr) {
      *status = Status(Error::MemoryAllocationFailed,
                       "layer " + std::to_string(t.layer) + ": cannot allocate " +
                           std::to_string(bytes) + " bytes of ring storage");
      return nullptr;
    }
    // Empty slots are masked, but 0 x NaN is NaN: never leave garbage in a ring.
    store->memory_->zero(store->rings_[i].data(), bytes);
    store->note_allocated(bytes);
  }
  store->choose_growth();
  Status s = store->resize_flat(policy.initial_capacity, 0);
  if (!s.ok()) {
    *status = s;
    return nullptr;
  }
  store->capacity_ = policy.initial_capacity;
  store->growths_ = 0;
  *status = Status::ok_status();
  return store;
}

size_t KVStore::rows_of(size_t i, size_t flat_capacity) const {
  const TensorSpec& t = tensors_[i];
  // A ring keeps window + max_write - 1 slots: a step of max_write tokens then
  // never overwrites a position its own earliest query still needs. The rewind
  // budget adds slots, which keep older positions for rewinds.
  return t.kind == LayerKind::Ring ? size_t(t.window) + max_write_ - 1 + policy_.rewind_budget : flat_capacity;
}

size_t KVStore::bytes_at(size_t flat_capacity) const {
  size_t total = 0;
  for (size_t i = 0; i < tensors_.size(); ++i) total += rows_of(i, flat_capacity) * tensors_[i].row_bytes();
  return total;
}

void KVStore::note_allocated(size_t bytes) {
  allocated_ += bytes;
  peak_ = std::max(peak_, allocated_);
}

std::vector<size_t> KVStore::arena_offsets(size_t capacity, size_t* total) const {
  constexpr size_t kAlign = 256;  // what CUDA allocations and vector loads like
  std::vector<size_t> offsets(tensors_.size(), 0);
  size_t at = 0;
  for (size_t i = 0; i < tensors_.size(); ++i) {
    if (tensors_[i].kind != LayerKind::Flat) continue;
    offsets[i] = at;
    at += (capacity * tensors_[i].row_bytes() + kAlign - 1) / kAlign * kAlign;
  }
  *total = at;
  return offsets;
}

void* KVStore::data_of(size_t i) const {
  if (tensors_[i].kind == LayerKind::Ring) return rings_[i].data();
  if (reservation_) return mapped_base_[i];
  return static_cast<char*>(flat_arena_.data()) + flat_offset_[i];
}

void KVStore::choose_growth() {
  if (!has_flat_) {
    growth_note_ = "no flat layers: nothing grows";
    return;
  }
  if (policy_.growth == GrowthMode::Copy) return;
  if (policy_.growth == GrowthMode::Auto && !memory_->maps_by_default()) {
    growth_note_ = std::string("growth=auto grows by copy on ") + memory_->name() + " memory";
    return;
  }
  std::vector<size_t> segment_bytes;
  segment_of_.assign(tensors_.size(), 0);
  for (size_t i = 0; i < tensors_.size(); ++i) {
    if (tensors_[i].kind != LayerKind::Flat) continue;
    segment_of_[i] = segment_bytes.size();
    // Rows grow in place, so each tensor needs a contiguous range for all the rows it may ever hold.
    segment_bytes.push_back(policy_.max_capacity * tensors_[i].row_bytes());
  }
  Status s;
  std::unique_ptr<Reservation> r = memory_->reserve(segment_bytes, &s);
  if (!r) {
    growth_note_ = "growth=" + std::string(growth_mode_name(policy_.growth)) + " falls back to copy growth: " + s.message();
    if (policy_.growth == GrowthMode::Map) ET_LOG(Info, "OffGraphKVBackend: %s", growth_note_.c_str());
    return;
  }
  mapped_base_.assign(tensors_.size(), nullptr);
  for (size_t i = 0; i < tensors_.size(); ++i)
    if (tensors_[i].kind == LayerKind::Flat) mapped_base_[i] = r->base(segment_of_[i]);
  reservation_ = std::move(r);
}

Status KVStore::resize_flat(size_t new_capacity, size_t rows_to_keep) {
  if (!has_flat_) return Status::ok_status();
  if (reservation_) {
    // Rows stay where they are: back (or give back) the tail of each tensor's range.
    std::vector<size_t> bytes(reservation_->segments(), 0);
    for (size_t i = 0; i < tensors_.size(); ++i)
      if (tensors_[i].kind == LayerKind::Flat) bytes[segment_of_[i]] = new_capacity * tensors_[i].row_bytes();
    const size_t before = reservation_->committed_bytes();
    if (new_capacity >= capacity_) {
      Status s = reservation_->commit(bytes);
      if (!s.ok())
        return Status(s.code(), s.message() + " (growing flat KV storage to " + std::to_string(new_capacity) + " rows)");
    } else {
      reservation_->release_beyond(bytes);
    }
    allocated_ = allocated_ - before + reservation_->committed_bytes();
    peak_ = std::max(peak_, allocated_);
    capacity_ = new_capacity;
    return Status::ok_status();
  }
  size_t bytes = 0;
  std::vector<size_t> offsets = arena_offsets(new_capacity, &bytes);
  Buffer fresh = allocate_buffer(memory_, bytes);
  if (fresh.data() == nullptr) {
    // The old storage is untouched.
    return Status(Error::MemoryAllocationFailed,
                  "cannot allocate " + std::to_string(bytes) + " bytes of flat KV storage to grow to " +
                      std::to_string(new_capacity) + " rows");
  }
  // Old and new coexist until the copy is done: that transient is the peak.
  note_allocated(bytes);
  if (rows_to_keep > 0) {
    std::vector<CopyOp> copies;
    for (size_t i = 0; i < tensors_.size(); ++i) {
      if (tensors_[i].kind != LayerKind::Flat) continue;
      // Sequence-major rows: the committed prefix of a tensor is one contiguous block.
      copies.push_back({static_cast<char*>(fresh.data()) + offsets[i], data_of(i), rows_to_keep * tensors_[i].row_bytes()});
    }
    memory_->copy_many(copies);
  }
  allocated_ -= flat_arena_.bytes();
  released_arena_ = released_arena_ || flat_arena_.data() != nullptr;
  flat_arena_ = std::move(fresh);  // the old arena's release is ordered after the copy
  flat_offset_ = std::move(offsets);
  capacity_ = new_capacity;
  return Status::ok_status();
}

Status KVStore::prepare_step(size_t width) {
  if (pending_ != 0) abort_step();
  if (width == 0) return Status(Error::InvalidArgument, "step width is 0: a step must carry at least one token");
  if (has_ring_ && width > max_write_) {
    return Status(Error::InvalidArgument,
                  "step width " + std::to_string(width) + " exceeds max_write " +
                      std::to_string(max_write_) +
                      " (ring layers absorb at most max_write tokens per step); split the prefill into chunks");
  }
  const size_t needed = length_ + width;
  if (needed > policy_.max_capacity) {
    return Status(Error::InvalidArgument,
                  "step of " + std::to_string(width) + " tokens at length " + std::to_string(length_) +
                      " needs " + std::to_string(needed) + " rows, beyond max_capacity " +
                      std::to_string(policy_.max_capacity) + " (" +
                      std::to_string(policy_.max_capacity - length_) + " remaining)");
  }
  if (has_flat_ && needed > capacity_) {
    const size_t grown = next_capacity(policy_, capacity_, needed);
    Status s = resize_flat(grown, length_);
    if (!s.ok()) return s;
    ++growths_;
  }
  pending_ = width;
  return Status::ok_status();
}

void KVStore::commit_step() {
  if (pending_ != 0) ++steps_;
  length_ += pending_;
  pending_ = 0;
  // The step's writes overwrote the slots of positions [length - slots, ...).
  for (size_t i = 0; i < tensors_.size(); ++i) {
    const size_t slots = rows_of(i, capacity_);
    if (tensors_[i].kind == LayerKind::Ring && length_ > slots) kept_from_[i] = std::max(kept_from_[i], length_ - slots);
  }
  return_released_memory();
}

void KVStore::return_released_memory() {
  // Only after a growth: the old arena's release was queued behind the copy,
  // and the step that followed has completed, so nothing still reads it.
  if (!released_arena_) return;
  memory_->return_unused();
  released_arena_ = false;
}

void KVStore::abort_step() {
  // A failed step may have written its rows into ring slots before failing.
  clear_ring_positions(length_, length_ + pending_);
  pending_ = 0;
}

void KVStore::clear_ring_positions(size_t from, size_t to) {
  // Attention masks a slot that holds no position of the window, but a masked
  // slot still meets the probabilities as 0 x value, and 0 x NaN is NaN: slots
  // of positions that no longer exist are zeroed, so a rewound, reset or failed
  // step that wrote NaN or Inf leaves nothing behind (flat layers never read
  // rows past the length).
  if (to <= from) return;
  for (size_t i = 0; i < tensors_.size(); ++i) {
    const TensorSpec& t = tensors_[i];
    if (t.kind != LayerKind::Ring) continue;
    const size_t slots = rows_of(i, capacity_), row = t.row_bytes();
    const size_t count = std::min(to - from, slots), first = from % slots;
    char* base = static_cast<char*>(data_of(i));
    const size_t head = std::min(count, slots - first);
    memory_->zero(base + first * row, head * row);
    if (count > head) memory_->zero(base, (count - head) * row);  // the run wraps to slot 0
  }
}

Binding KVStore::binding(size_t i) const {
  const TensorSpec& t = tensors_[i];
  if (t.kind == LayerKind::Ring) return {data_of(i), int64_t(rows_of(i, capacity_))};
  return {data_of(i), int64_t(length_ + pending_)};
}

Binding KVStore::fixed_binding(size_t i) const {
  const TensorSpec& t = tensors_[i];
  if (t.kind == LayerKind::Ring) return binding(i);
  return {data_of(i), int64_t(reservation_ ? policy_.max_capacity : capacity_)};
}

std::shared_lock<std::shared_mutex> KVStore::control_turn() const {
  std::shared_mutex* turns = memory_->turns();
  return turns ? std::shared_lock<std::shared_mutex>(*turns) : std::shared_lock<std::shared_mutex>();
}

Status KVStore::rewind(size_t n) {
  const std::lock_guard<std::mutex> held(access_);
  if (pending_ != 0) return Status(Error::InvalidState, "rewind during a step");
  if (n > length_)
    return Status(Error::InvalidArgument,
                  "cannot rewind " + std::to_string(n) + " positions: the store holds " + std::to_string(length_));
  const size_t to = length_ - n;
  for (size_t i = 0; i < tensors_.size(); ++i) {
    const TensorSpec& t = tensors_[i];
    if (t.kind != LayerKind::Ring) continue;
    // The next query (position `to`) sees keys in (to - window, to): they must all still be in the ring.
    const size_t needed_from = to + 1 > t.window ? to + 1 - t.window : 0;
    if (needed_from < kept_from_[i]) {
      const size_t floor = kept_from_[i] + t.window - 1;  // the lowest length this ring can return to
      return Status(Error::InvalidArgument,
                    "cannot rewind " + std::to_string(n) + " positions (to " + std::to_string(to) + "): ring layer " +
                        std::to_string(t.layer) + " (window " + std::to_string(t.window) + ") keeps positions from " +
                        std::to_string(kept_from_[i]) + " on, so it can go back at most " +
                        std::to_string(length_ - std::min(length_, floor)) + " positions now; rewind_budget " +
                        std::to_string(policy_.rewind_budget) + " (a load-time option) buys more");
    }
  }
  const auto turn = control_turn();
  clear_ring_positions(to, length_);
  length_ = to;
  return Status::ok_status();
}

Status KVStore::reset(bool release_memory) {
  const std::lock_guard<std::mutex> held(access_);
  if (pending_ != 0) return Status(Error::InvalidState, "reset during a step");
  const auto turn = control_turn();
  clear_ring_positions(0, std::numeric_limits<size_t>::max());  // every slot
  length_ = 0;
  std::fill(kept_from_.begin(), kept_from_.end(), 0);
  if (release_memory && capacity_ != policy_.initial_capacity) {
    Status s = resize_flat(policy_.initial_capacity, 0);
    if (!s.ok()) return s;
    peak_ = allocated_;
    growths_ = 0;
    return_released_memory();
  }
  return Status::ok_status();
}

StoreMetrics KVStore::metrics() const {
  const std::lock_guard<std::mutex> held(access_);
  StoreMetrics m;
  m.length = length_;
  m.capacity = capacity_;
  m.allocated_bytes = allocated_;
  m.peak_bytes = peak_;
  m.reserved_bytes = reservation_ ? reservation_->reserved_bytes() : 0;
  m.graph_captures = graph_captures_;
  m.graph_replays = graph_replays_;
  m.growth = reservation_ ? GrowthMode::Map : GrowthMode::Copy;
  m.growth_note = growth_note_;
  m.growths = growths_;
  m.steps = steps_;
  m.host_ns = host_ns_;
  m.dtype = tensors_.empty() ? StorageDType::BFloat16 : tensors_[0].dtype;
  for (size_t i = 0; i < tensors_.size(); ++i) {
    const TensorSpec& t = tensors_[i];
    auto it = std::find_if(m.layers.begin(), m.layers.end(),
                           [&](const LayerMetrics& l) { return l.layer == t.layer; });
    if (it == m.layers.end()) {
      m.layers.push_back({t.layer, t.kind, t.window, rows_of(i, capacity_), 0});
      it = m.layers.end() - 1;
    }
    it->bytes += rows_of(i, capacity_) * t.row_bytes();
  }
  return m;
}

}  // namespace offgraph_kv
