// CUDA KV memory: growth copies in every mode, memory following the arena (GPU only).
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
    auto s = KVStore::create(tensors, policy(1000, 4000), 1000, io->memory(), &st);
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
  auto s = KVStore::create(flat_layer_specs(4, 8, 128, StorageDType::BFloat16, 0), policy(2048, 16384), 1, io->memory(),
                           &st);
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
#endif
