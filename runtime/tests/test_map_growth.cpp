// Map growth on the host: address space reserved for max_capacity rows at
// load, committed as the store grows; rows never move and nothing is copied.
#include <sys/mman.h>
#include <unistd.h>

#include <cstring>
#include <memory>
#include <vector>

#include "device_memory.h"
#include "kv_store.h"
#include "harness.h"
#include "store_fixtures.h"

using namespace offgraph_kv;
using namespace offgraph_kv::testing;

namespace {

std::vector<void*> bases(const KVStore& s) {
  std::vector<void*> out;
  for (size_t i = 0; i < s.tensors().size(); ++i) out.push_back(s.binding(i).data);
  return out;
}

// Pages of [p, p + bytes) that are resident in memory.
size_t resident_pages(const void* p, size_t bytes) {
  const size_t page = size_t(sysconf(_SC_PAGESIZE));
  std::vector<unsigned char> in(bytes / page);
  if (mincore(const_cast<void*>(p), bytes, in.data()) != 0) return size_t(-1);
  size_t n = 0;
  for (unsigned char c : in) n += c & 1;
  return n;
}

}  // namespace

TEST(map_growth_keeps_every_base_address_and_every_committed_row) {
  Status st;
  // 4 KiB fp32 rows (8 heads x 128): each growth commits whole new pages.
  auto s = KVStore::create(flat_layers(2, StorageDType::Float32, 8, 128), policy(4, 256, 2.0, GrowthMode::Map), 8,
                           host_memory(), &st);
  CHECK(st.ok() && s != nullptr);
  if (!s) return;
  CHECK(s->metrics().growth == GrowthMode::Map);
  const std::vector<void*> at_load = bases(*s);
  size_t length = 0;
  for (size_t w : {3, 1, 1, 4, 1, 7, 2, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8}) {
    CHECK(s->prepare_step(w).ok());
    fill_step(*s, w);
    s->commit_step();
    length += w;
    CHECK(bases(*s) == at_load);  // nothing moved, nothing to rebind
    CHECK(rows_intact(*s, length));
  }
  const StoreMetrics m = s->metrics();
  const size_t row = 8 * 128 * 4, tensors = 4;
  CHECK(m.capacity == 256 && m.growths == 6);  // 4 -> 8 -> ... -> 256
  CHECK(m.allocated_bytes == tensors * 256 * row);
  CHECK(m.peak_bytes == m.allocated_bytes);  // no old + new pair
  CHECK(m.reserved_bytes >= tensors * 256 * row);
}

TEST(map_growth_commits_no_more_than_the_rows_rounded_to_a_page) {
  Status st;
  // 64-byte rows: 4 rows are one page per tensor; 1M rows are reserved, not committed.
  auto s = KVStore::create(flat_layers(2, StorageDType::Float32, 4, 4), policy(4, 1 << 20, 2.0, GrowthMode::Map), 8,
                           host_memory(), &st);
  CHECK(st.ok() && s != nullptr);
  if (!s) return;
  const size_t page = size_t(sysconf(_SC_PAGESIZE));
  CHECK(s->metrics().allocated_bytes == 4 * page);
  CHECK(s->metrics().reserved_bytes >= 4 * (size_t(1) << 20) * 64);
  CHECK(s->prepare_step(1000).ok());
  s->commit_step();
  CHECK(s->capacity() == 1024);
  CHECK(s->metrics().allocated_bytes == 4 * ((1024 * 64 + page - 1) / page * page));
}

TEST(reset_with_release_gives_mapped_pages_back_and_keeps_the_addresses) {
  Status st;
  auto s = KVStore::create(flat_layers(1, StorageDType::Float32, 8, 128), policy(4, 1024, 2.0, GrowthMode::Map), 8,
                           host_memory(), &st);
  CHECK(st.ok() && s != nullptr);
  if (!s) return;
  const size_t initial = s->metrics().allocated_bytes;
  const std::vector<void*> at_load = bases(*s);
  const size_t row = 8 * 128 * 4;
  CHECK(s->prepare_step(500).ok());
  fill_step(*s, 500);
  s->commit_step();
  CHECK(resident_pages(at_load[0], 512 * row) == 500);  // written rows are resident, committed ones not yet
  CHECK(s->reset(false).ok());
  CHECK(s->metrics().allocated_bytes > initial);  // kept without release
  CHECK(s->reset(true).ok());
  const StoreMetrics m = s->metrics();
  CHECK(m.allocated_bytes == initial && m.capacity == 4 && m.peak_bytes == initial);
  CHECK(bases(*s) == at_load);
  // The pages beyond the initial rows went back to the system.
  CHECK(resident_pages(static_cast<char*>(at_load[0]) + 4 * row, 508 * row) == 0);
  // Growing again maps fresh (zeroed) pages at the same addresses.
  CHECK(s->prepare_step(100).ok());
  const auto* row99 = static_cast<const unsigned char*>(s->binding(0).data) + 99 * row;
  bool zero = true;
  for (size_t b = 0; b < row; ++b) zero = zero && row99[b] == 0;
  CHECK(zero && bases(*s) == at_load);
  s->abort_step();
}

TEST(failed_map_growth_leaves_store_unchanged) {
  auto mem = std::make_shared<RefusingMapMemory>();
  Status st;
  auto s = KVStore::create(flat_layers(2, StorageDType::Float32, 8, 128), policy(4, 64, 2.0, GrowthMode::Map), 8, mem,
                           &st);
  CHECK(st.ok() && s != nullptr);
  if (!s) return;
  CHECK(s->metrics().growth == GrowthMode::Map);
  CHECK(s->prepare_step(4).ok());
  fill_step(*s, 4);
  s->commit_step();
  const StoreMetrics before = s->metrics();
  const std::vector<void*> at = bases(*s);
  mem->commits_left = 0;
  Status grow = s->prepare_step(1);
  CHECK(!grow.ok() && grow.message().find("refused") != std::string::npos &&
        grow.message().find("8 rows") != std::string::npos);
  const StoreMetrics after = s->metrics();
  CHECK(after.length == 4 && after.capacity == 4 && after.allocated_bytes == before.allocated_bytes);
  CHECK(after.growths == before.growths && bases(*s) == at && rows_intact(*s, 4));
  mem->commits_left = -1;  // the store is still usable
  CHECK(s->prepare_step(1).ok() && s->capacity() == 8);
  fill_step(*s, 1);
  s->commit_step();
  CHECK(rows_intact(*s, 5) && bases(*s) == at);
}

TEST(map_growth_falls_back_to_copy_where_memory_cannot_reserve) {
  auto mem = std::make_shared<FailingMemory>();  // no reserve(): like a device without the VMM API
  Status st;
  auto s = KVStore::create(flat_layers(1, StorageDType::Float32), policy(4, 64, 2.0, GrowthMode::Map), 8, mem, &st);
  CHECK(st.ok() && s != nullptr);
  if (!s) return;
  StoreMetrics m = s->metrics();
  CHECK(m.growth == GrowthMode::Copy && m.reserved_bytes == 0);
  CHECK(m.growth_note.find("falls back to copy") != std::string::npos &&
        m.growth_note.find("cannot reserve") != std::string::npos);
  for (size_t w : {3, 2}) {  // the second step grows, by copy
    CHECK(s->prepare_step(w).ok());
    fill_step(*s, w);
    s->commit_step();
  }
  CHECK(s->capacity() == 8 && mem->batches == 1 && rows_intact(*s, 5));
}

TEST(huge_max_capacity_falls_back_to_copy_with_a_message) {
  Status st;
  // 2^31 rows of 2 KiB for 64 tensors: 256 TiB of address space, beyond the per-store cap.
  auto s = KVStore::create(flat_layer_specs(32, 8, 128, StorageDType::BFloat16, 0),
                           policy(16, size_t(1) << 31, 2.0, GrowthMode::Map), 8, host_memory(), &st);
  CHECK(st.ok() && s != nullptr);
  if (!s) return;
  const StoreMetrics m = s->metrics();
  CHECK(m.growth == GrowthMode::Copy && m.growth_note.find("max_capacity") != std::string::npos);
  CHECK(s->prepare_step(20).ok() && s->capacity() == 32);
}

TEST(copy_growth_is_kept_when_asked_for) {
  Status st;
  auto s = KVStore::create(flat_layers(1, StorageDType::Float32), policy(4, 64, 2.0, GrowthMode::Copy), 8,
                           host_memory(), &st);
  CHECK(st.ok() && s->metrics().growth == GrowthMode::Copy && s->metrics().reserved_bytes == 0);
}
