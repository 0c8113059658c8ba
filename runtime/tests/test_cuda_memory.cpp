// CUDA KV memory: growth copies in every mode, memory following the arena, map
// growth (addresses kept, chunks mapped and released, reservation cost) (GPU only).
#ifdef OFFGRAPH_KV_WITH_CUDA
#include <cuda_runtime.h>
#endif

#include <cstring>

#include "device_memory.h"
#include "kv_store.h"
#include "step_io.h"
#include "harness.h"
#include "store_fixtures.h"

using namespace offgraph_kv;
using namespace offgraph_kv::testing;

#ifdef OFFGRAPH_KV_WITH_CUDA
// On a GPU: a growth through each copy mode keeps every committed byte of
// every tensor, including rows that are not a multiple of 16 bytes and tensors
// large enough to need many blocks. Without a usable device it says SKIP.
TEST(cuda_growth_keeps_every_byte_in_each_copy_mode) {
  const char* modes[] = {"kernel", "batch", "each"};
  for (const char* name : modes) {
    CopyMode mode = CopyMode::Auto;
    CHECK(parse_copy_mode(name, &mode));
    Status st;
    std::unique_ptr<StepIO> io = cuda_step_io(&st, mode);
    if (!io) {
      std::printf("  SKIP %s: %s\n", name, st.message().c_str());
      continue;
    }
    // 3 fp16 heads x 5 dims = 30-byte rows (ragged), and 8 x 128 bf16 = 2 KiB rows.
    std::vector<TensorSpec> tensors = flat_layer_specs(2, 3, 5, StorageDType::Float16, 0);
    for (const TensorSpec& t : flat_layer_specs(3, 8, 128, StorageDType::BFloat16, 0)) tensors.push_back(t);
    auto s = KVStore::create(tensors, policy(1000, 4000, 2.0, GrowthMode::Copy), 1000, io->memory(), &st);
    CHECK(st.ok() && s != nullptr);
    if (!s) continue;
    CHECK(s->prepare_step(999).ok());
    std::vector<std::vector<unsigned char>> written(tensors.size());
    for (size_t i = 0; i < tensors.size(); ++i) {
      written[i].resize(999 * tensors[i].row_bytes());
      for (size_t b = 0; b < written[i].size(); ++b) written[i][b] = (unsigned char)((b * 131 + i * 17) >> 3);
      CHECK(cudaMemcpy(s->binding(i).data, written[i].data(), written[i].size(), cudaMemcpyHostToDevice) ==
            cudaSuccess);
    }
    s->commit_step();
    CHECK(s->prepare_step(2).ok() && s->capacity() == 2000);  // the growth under test
    io->memory()->synchronize();
    for (size_t i = 0; i < tensors.size(); ++i) {
      std::vector<unsigned char> back(written[i].size());
      CHECK(cudaMemcpy(back.data(), s->binding(i).data, back.size(), cudaMemcpyDeviceToHost) == cudaSuccess);
      CHECK(back == written[i]);
    }
    s->abort_step();
    std::printf("  %s: ok\n", name);
  }
}

// On a GPU: after each growth's step, the device holds the arena in use, not
// every arena the store ever had (the pool gives old arenas back).
TEST(cuda_device_memory_follows_the_arena_after_each_growth) {
  Status st;
  std::unique_ptr<StepIO> io = cuda_step_io(&st);
  if (!io) {
    std::printf("  SKIP: %s\n", st.message().c_str());
    return;
  }
  auto used = [] {
    size_t free_bytes = 0, total = 0;
    cudaMemGetInfo(&free_bytes, &total);
    return total - free_bytes;
  };
  const size_t baseline = used();
  // 4 layers of 8 x 128 bf16: 16 KiB per row; 32 MiB at 2048 rows, 256 MiB at 16384.
  auto s = KVStore::create(flat_layer_specs(4, 8, 128, StorageDType::BFloat16, 0),
                           policy(2048, 16384, 2.0, GrowthMode::Copy), 1, io->memory(), &st);
  CHECK(st.ok() && s != nullptr);
  if (!s) return;
  size_t grown_to = 0;
  for (size_t rows : {2048, 4096, 8192, 16384}) {
    CHECK(s->prepare_step(rows - s->length()).ok() && s->capacity() == rows);
    s->commit_step();
    grown_to = s->metrics().allocated_bytes;
    const double used_mib = double(used() - baseline) / (1 << 20);
    std::printf("  capacity %zu: arena %.0f MiB, device memory used %.0f MiB\n", rows, grown_to / 1048576.0, used_mib);
    // Pool granularity and driver bookkeeping, not a second arena (the previous one is half the size).
    CHECK(used() - baseline <= grown_to + (16u << 20));
  }
  s.reset();
  io->memory()->return_unused();
  CHECK(used() - baseline <= (16u << 20));
}

size_t device_used() {
  size_t free_bytes = 0, total = 0;
  cudaMemGetInfo(&free_bytes, &total);
  return total - free_bytes;
}

// On a GPU: map growth keeps every tensor's address and every committed byte,
// maps only what the rows need (whole chunks), counts no old + new pair, and
// reset(release_memory) unmaps all but the initial chunks.
TEST(cuda_map_growth_keeps_addresses_and_bytes_and_reset_releases) {
  Status st;
  std::unique_ptr<StepIO> io = cuda_step_io(&st);
  if (!io) {
    std::printf("  SKIP: %s\n", st.message().c_str());
    return;
  }
  const size_t baseline = device_used();
  // 4 layers of 8 x 128 bf16 (2 KiB rows): 1024 rows per 2 MiB chunk.
  const std::vector<TensorSpec> tensors = flat_layer_specs(4, 8, 128, StorageDType::BFloat16, 0);
  auto s = KVStore::create(tensors, policy(256, 65536, 2.0, GrowthMode::Map), 1, io->memory(), &st);
  CHECK(st.ok() && s != nullptr);
  if (!s) return;
  StoreMetrics m = s->metrics();
  CHECK(m.growth == GrowthMode::Map);
  if (m.growth != GrowthMode::Map) {
    std::printf("  map growth unavailable: %s\n", m.growth_note.c_str());
    return;
  }
  const size_t initial = m.allocated_bytes;
  std::vector<void*> at_load;
  for (size_t i = 0; i < tensors.size(); ++i) at_load.push_back(s->binding(i).data);
  std::vector<std::vector<unsigned char>> written(tensors.size());
  size_t length = 0;
  for (size_t rows : {200, 1000, 5000, 20000, 60000}) {
    CHECK(s->prepare_step(rows - length).ok());
    for (size_t i = 0; i < tensors.size(); ++i) {
      const size_t rb = tensors[i].row_bytes();
      written[i].resize(rows * rb);
      for (size_t b = length * rb; b < rows * rb; ++b) written[i][b] = (unsigned char)((b * 131 + i * 17) >> 3);
      CHECK(s->binding(i).data == at_load[i]);
      CHECK(cudaMemcpy(static_cast<char*>(s->binding(i).data) + length * rb, written[i].data() + length * rb,
                       (rows - length) * rb, cudaMemcpyHostToDevice) == cudaSuccess);
    }
    s->commit_step();
    length = rows;
    m = s->metrics();
    CHECK(m.peak_bytes == m.allocated_bytes);  // nothing is ever held twice
    // Chunks of 2 MiB (the usual granularity) round each tensor up by less than one chunk.
    CHECK(m.allocated_bytes < tensors.size() * (s->capacity() * 2048 + (size_t(2) << 20)));
    CHECK(device_used() - baseline <= m.allocated_bytes + (size_t(8) << 20));
    std::printf("  %zu rows: capacity %zu, mapped %.1f MiB, device memory used %.1f MiB\n", rows, s->capacity(),
                m.allocated_bytes / 1048576.0, (device_used() - baseline) / 1048576.0);
  }
  for (size_t i = 0; i < tensors.size(); ++i) {
    std::vector<unsigned char> back(written[i].size());
    CHECK(cudaMemcpy(back.data(), s->binding(i).data, back.size(), cudaMemcpyDeviceToHost) == cudaSuccess);
    CHECK(back == written[i]);
  }
  CHECK(s->reset(true).ok());
  m = s->metrics();
  CHECK(m.allocated_bytes == initial && s->capacity() == 256);
  CHECK(device_used() - baseline <= initial + (size_t(8) << 20));
  for (size_t i = 0; i < tensors.size(); ++i) CHECK(s->binding(i).data == at_load[i]);
  std::printf("  after reset(release): mapped %.1f MiB, device memory used %.1f MiB\n", m.allocated_bytes / 1048576.0,
              (device_used() - baseline) / 1048576.0);
  s.reset();
  CHECK(device_used() - baseline <= (size_t(4) << 20));
}

// On a GPU: reserving address space for 1M rows of a 32-layer Llama-3-8B-shaped
// store (8 KV heads x 128, bf16, K and V: 128 GiB) costs no device memory.
TEST(cuda_million_row_reservation_costs_no_device_memory) {
  Status st;
  std::unique_ptr<StepIO> io = cuda_step_io(&st);
  if (!io) {
    std::printf("  SKIP: %s\n", st.message().c_str());
    return;
  }
  const std::vector<TensorSpec> tensors = flat_layer_specs(32, 8, 128, StorageDType::BFloat16, 0);
  std::vector<size_t> segments;
  for (const TensorSpec& t : tensors) segments.push_back((size_t(1) << 20) * t.row_bytes());
  cudaDeviceSynchronize();
  const size_t before = device_used();
  std::unique_ptr<Reservation> r = io->memory()->reserve(segments, &st);
  CHECK(r != nullptr);
  if (!r) {
    std::printf("  no reservation: %s\n", st.message().c_str());
    return;
  }
  const size_t after = device_used();
  std::printf("  reserved %.1f GiB of address space; device memory used before %zu, after %zu bytes (delta %lld)\n",
              r->reserved_bytes() / 1073741824.0, before, after, (long long)after - (long long)before);
  CHECK(r->reserved_bytes() >= (size_t(128) << 30) && r->committed_bytes() == 0);
  CHECK(after <= before);
  // The same through a store: only the initial chunks are backed.
  auto s = KVStore::create(tensors, policy(256, size_t(1) << 20, 2.0, GrowthMode::Map), 1, io->memory(), &st);
  CHECK(st.ok() && s != nullptr && s->metrics().growth == GrowthMode::Map);
  if (!s) return;
  const size_t with_store = device_used();
  std::printf("  store of 1M rows: mapped %.1f MiB, device memory used %.1f MiB more\n",
              s->metrics().allocated_bytes / 1048576.0, (double(with_store) - double(after)) / 1048576.0);
  CHECK(with_store - after <= s->metrics().allocated_bytes + (size_t(8) << 20));
}

// On a GPU: a map growth the device cannot back fails with a message and
// leaves the store as it was (a reservation larger than the GPU).
TEST(cuda_failed_map_growth_leaves_store_unchanged) {
  Status st;
  std::unique_ptr<StepIO> io = cuda_step_io(&st);
  if (!io) {
    std::printf("  SKIP: %s\n", st.message().c_str());
    return;
  }
  size_t free_bytes = 0, total = 0;
  cudaMemGetInfo(&free_bytes, &total);
  // One tensor of 64 KiB rows; max_capacity rows need twice the GPU's memory.
  const std::vector<TensorSpec> tensors = flat_layer_specs(1, 128, 256, StorageDType::BFloat16, 0);
  const size_t row = tensors[0].row_bytes();
  const size_t max_rows = 2 * total / (2 * row);
  auto s = KVStore::create(tensors, policy(16, max_rows, 2.0, GrowthMode::Map), 1, io->memory(), &st);
  CHECK(st.ok() && s != nullptr);
  if (!s || s->metrics().growth != GrowthMode::Map) return;
  CHECK(s->prepare_step(16).ok());
  CHECK(cudaMemset(s->binding(0).data, 0x5a, 16 * row) == cudaSuccess);
  CHECK(cudaMemset(s->binding(1).data, 0xa5, 16 * row) == cudaSuccess);
  s->commit_step();
  const StoreMetrics before = s->metrics();
  Status grow = s->prepare_step(max_rows - 16);  // all of it: more than the device has
  CHECK(!grow.ok() && grow.code() == Error::MemoryAllocationFailed);
  std::printf("  refused: %s\n", grow.message().c_str());
  const StoreMetrics after = s->metrics();
  CHECK(after.length == 16 && after.capacity == before.capacity && after.allocated_bytes == before.allocated_bytes);
  std::vector<unsigned char> back(16 * row);
  CHECK(cudaMemcpy(back.data(), s->binding(0).data, back.size(), cudaMemcpyDeviceToHost) == cudaSuccess);
  bool same = true;
  for (unsigned char c : back) same = same && c == 0x5a;
  CHECK(same);
  CHECK(s->prepare_step(100).ok() && s->capacity() == 128);  // still usable: an ordinary growth maps
  s->abort_step();
}
#endif
