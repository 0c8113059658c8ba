// The store: growth, rejected and aborted steps, rings, reset, rewind.
#include <cstring>
#include <memory>

#include "device_memory.h"
#include "kv_store.h"
#include "harness.h"
#include "store_fixtures.h"

using namespace offgraph_kv;
using namespace offgraph_kv::testing;

TEST(allocated_bytes_follow_dtype_heads_head_dim_and_capacity) {
  for (StorageDType d : {StorageDType::Float32, StorageDType::Float16, StorageDType::BFloat16}) {
    Status st;
    auto s = KVStore::create(flat_layers(3, d, 2, 8), policy(16, 1024, 2.0, GrowthMode::Copy), 8, host_memory(), &st);
    CHECK(st.ok());
    CHECK(s->metrics().allocated_bytes == 3 * 2 * 16 * 2 * 8 * element_size(d));
  }
}

TEST(growth_preserves_committed_rows_and_counts_transient_peak) {
  Status st;
  auto s = KVStore::create(flat_layers(2, StorageDType::Float32), policy(4, 64, 2.0, GrowthMode::Copy), 8, host_memory(),
                           &st);
  const size_t row = 2 * 4 * 4, tensors = 4;
  size_t length = 0;
  for (size_t w : {3, 1, 1, 4, 1, 7, 2}) {
    CHECK(s->prepare_step(w).ok());
    fill_step(*s, w);
    s->commit_step();
    length += w;
    CHECK(s->length() == length);
    CHECK(rows_intact(*s, length));
  }
  StoreMetrics m = s->metrics();
  CHECK(m.capacity == 32);  // 4 -> 8 -> 16 -> 32
  CHECK(m.growths == 3);
  CHECK(m.allocated_bytes == tensors * 32 * row);
  CHECK(m.peak_bytes == tensors * (16 + 32) * row);
}

TEST(rejected_steps_change_nothing) {
  Status st;
  auto s = KVStore::create(flat_layers(1, StorageDType::BFloat16), policy(4, 10), 8, host_memory(), &st);
  CHECK(s->prepare_step(3).ok());
  fill_step(*s, 3);
  s->commit_step();
  const StoreMetrics before = s->metrics();
  Status zero = s->prepare_step(0);
  CHECK(!zero.ok() && zero.message().find("width is 0") != std::string::npos);
  Status over = s->prepare_step(8);
  CHECK(!over.ok() && over.message().find("max_capacity 10") != std::string::npos);
  CHECK(over.message().find("7 remaining") != std::string::npos);
  CHECK(s->length() == 3 && s->metrics().capacity == before.capacity);
  CHECK(rows_intact(*s, 3));
}

TEST(aborted_step_keeps_length_and_rows) {
  Status st;
  auto s = KVStore::create(flat_layers(2, StorageDType::Float16), policy(2, 64), 8, host_memory(), &st);
  CHECK(s->prepare_step(2).ok());
  fill_step(*s, 2);
  s->commit_step();
  CHECK(s->prepare_step(5).ok());  // grows, then the run "fails"
  std::memset(s->binding(0).data, 0, 0);
  s->abort_step();
  CHECK(s->length() == 2);
  CHECK(rows_intact(*s, 2));
  CHECK(s->prepare_step(1).ok());
  CHECK(s->binding(0).rows == 3);
}

TEST(failed_growth_allocation_leaves_store_unchanged) {
  auto mem = std::make_shared<FailingMemory>();
  Status st;
  auto s = KVStore::create(flat_layers(2, StorageDType::Float32), policy(2, 64), 8, mem, &st);
  CHECK(st.ok());
  CHECK(s->prepare_step(2).ok());
  fill_step(*s, 2);
  s->commit_step();
  const StoreMetrics before = s->metrics();
  mem->fail_after = 0;  // the growth's one allocation (all four tensors) fails
  Status g = s->prepare_step(1);
  CHECK(!g.ok() && g.code() == Error::MemoryAllocationFailed);
  CHECK(g.message().find("to grow to 4 rows") != std::string::npos);
  const StoreMetrics after = s->metrics();
  CHECK(after.capacity == before.capacity && after.allocated_bytes == before.allocated_bytes);
  CHECK(s->length() == 2 && rows_intact(*s, 2));
  mem->fail_after = -1;
  CHECK(s->prepare_step(1).ok());
}

TEST(growth_is_one_allocation_and_one_copy_batch_whatever_the_layer_count) {
  auto mem = std::make_shared<FailingMemory>();
  Status st;
  auto s = KVStore::create(flat_layers(32, StorageDType::BFloat16), policy(4, 64), 8, mem, &st);
  CHECK(st.ok() && mem->allocations == 1);
  CHECK(s->prepare_step(3).ok());
  fill_step(*s, 3);
  s->commit_step();
  CHECK(s->prepare_step(4).ok());  // 4 -> 8 rows
  CHECK(mem->allocations == 2 && mem->batches == 1 && mem->batch_copies == 64);
  s->abort_step();
  CHECK(rows_intact(*s, 3));
  // Every tensor gets its own non-overlapping rows, 256-byte aligned within the arena.
  for (size_t i = 0; i + 1 < s->tensors().size(); ++i) {
    const auto a = reinterpret_cast<uintptr_t>(s->binding(i).data);
    const auto b = reinterpret_cast<uintptr_t>(s->binding(i + 1).data);
    CHECK((b - a) % 256 == 0 && b >= a + 8 * s->tensors()[i].row_bytes());
  }
}

TEST(old_arena_memory_is_returned_once_the_step_after_a_growth_commits) {
  auto mem = std::make_shared<FailingMemory>();
  Status st;
  auto s = KVStore::create(flat_layers(2, StorageDType::Float32), policy(4, 64), 8, mem, &st);
  CHECK(st.ok());
  CHECK(s->prepare_step(3).ok());
  s->commit_step();
  CHECK(mem->returns == 0);  // no growth, nothing released
  CHECK(s->prepare_step(4).ok() && s->capacity() == 8);
  CHECK(mem->returns == 0);  // the copy out of the old arena may still be running
  s->abort_step();
  CHECK(mem->returns == 0);
  CHECK(s->prepare_step(1).ok());
  s->commit_step();
  CHECK(mem->returns == 1);  // the next completed step returns it
  CHECK(s->prepare_step(1).ok());
  s->commit_step();
  CHECK(mem->returns == 1);  // once
  CHECK(s->reset(true).ok());
  CHECK(mem->returns == 2);  // shrinking releases an arena too
}

TEST(reset_with_release_returns_to_initial_allocation) {
  Status st;
  auto s = KVStore::create(flat_layers(2, StorageDType::BFloat16), policy(4, 64, 2.0, GrowthMode::Copy), 8,
                           host_memory(), &st);
  const size_t initial = s->metrics().allocated_bytes;
  for (int i = 0; i < 20; ++i) {
    CHECK(s->prepare_step(1).ok());
    s->commit_step();
  }
  CHECK(s->metrics().allocated_bytes > initial);
  CHECK(s->reset(false).ok());
  CHECK(s->length() == 0 && s->metrics().allocated_bytes > initial);
  CHECK(s->reset(true).ok());
  CHECK(s->metrics().allocated_bytes == initial && s->capacity() == 4);
}

TEST(ring_layers_are_allocated_once_and_bound_max_write) {
  auto tensors = flat_layers(2, StorageDType::Float32);
  for (auto& t : tensors)
    if (t.layer == 1) {
      t.kind = LayerKind::Ring;
      t.window = 6;
    }
  Status st;
  auto s = KVStore::create(tensors, policy(4, 1000), 3, host_memory(), &st);
  CHECK(st.ok());
  const size_t ring_bytes = 2 * (6 + 3 - 1) * 2 * 4 * 4;
  StoreMetrics m = s->metrics();
  CHECK(m.layers.size() == 2 && m.layers[1].rows == 8 && m.layers[1].bytes == ring_bytes);
  Status wide = s->prepare_step(4);
  CHECK(!wide.ok() && wide.message().find("max_write 3") != std::string::npos);
  for (int i = 0; i < 100; ++i) {
    CHECK(s->prepare_step(3).ok());
    CHECK(s->binding(2).rows == 8);
    s->commit_step();
  }
  CHECK(s->metrics().layers[1].bytes == ring_bytes);
  CHECK(s->length() == 300);
}

TEST(rewind_keeps_flat_rows_and_bounds_rings_by_what_they_keep) {
  auto tensors = flat_layers(2, StorageDType::Float32);
  for (auto& t : tensors)
    if (t.layer == 1) {
      t.kind = LayerKind::Ring;
      t.window = 6;
    }
  GrowthPolicy p = policy(4, 1000);
  p.rewind_budget = 2;  // 6 + 3 - 1 + 2 = 10 slots
  Status st;
  auto s = KVStore::create(tensors, p, 3, host_memory(), &st);
  CHECK(st.ok() && s->metrics().layers[1].rows == 10);
  for (int i = 0; i < 10; ++i) {
    CHECK(s->prepare_step(3).ok());
    fill_step(*s, 3);
    s->commit_step();
  }
  // 30 positions, the ring keeps 20..29: back to 25 leaves the window (20..24) intact.
  CHECK(s->rewind(5).ok() && s->length() == 25);
  Status deep = s->rewind(1);
  CHECK(!deep.ok() && deep.message().find("rewind_budget 2") != std::string::npos && s->length() == 25);
  CHECK(!s->rewind(26).ok());
  // Flat rows below the new length are the ones written before.
  CHECK(s->prepare_step(1).ok());
  s->abort_step();
  bool flat_intact = true;
  for (size_t i = 0; i < 2; ++i) {
    const auto* p0 = static_cast<const unsigned char*>(s->binding(i).data);
    for (size_t r = 0; r < 25; ++r) flat_intact = flat_intact && p0[r * s->tensors()[i].row_bytes()] == ((r * 7 + i) & 0xff);
  }
  CHECK(flat_intact);
  CHECK(s->can_extend(975) && !s->can_extend(976));
}
