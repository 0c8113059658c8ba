#include "growth_benchmark.h"

#include <chrono>

#include "kv_store.h"
#include "step_io.h"

namespace offgraph_kv {

Status time_growth(const std::string& device, size_t layers, size_t heads, size_t head_dim, int dtype,
                   size_t rows_before, size_t rows_after, int repeats, const std::string& copy_mode,
                   GrowthTiming* out) {
  if (!is_supported(dtype)) return Status(Error::InvalidArgument, "unsupported dtype " + std::to_string(dtype));
  if (rows_before == 0 || rows_after <= rows_before || repeats <= 0)
    return Status(Error::InvalidArgument, "need 0 < rows_before < rows_after and repeats > 0");
  CopyMode mode = CopyMode::Auto;
  if (!parse_copy_mode(copy_mode, &mode))
    return Status(Error::InvalidArgument, "copy_mode '" + copy_mode + "': expected auto, kernel, batch or each");
  Status s;
  std::unique_ptr<StepIO> io = device == "cuda" ? cuda_step_io(&s, mode) : host_step_io();
  if (!io) return s;
  const std::vector<TensorSpec> tensors =
      flat_layer_specs(layers, uint32_t(heads), uint32_t(head_dim), static_cast<StorageDType>(dtype), 0);
  for (const TensorSpec& t : tensors) out->bytes_copied += rows_before * t.row_bytes();
  GrowthPolicy policy;
  policy.initial_capacity = rows_before;
  policy.max_capacity = rows_after;
  policy.growth_factor = double(rows_after) / double(rows_before) + 1e-9;
  double total = 0;
  for (int i = 0; i < repeats + 1; ++i) {  // the first round warms the pool
    std::unique_ptr<KVStore> store = KVStore::create(tensors, policy, 1, io->memory(), &s);
    if (!store) return s;
    if (!(s = store->prepare_step(rows_before)).ok()) return s;
    store->commit_step();
    io->memory()->synchronize();
    const auto t0 = std::chrono::steady_clock::now();
    if (!(s = store->prepare_step(1)).ok()) return s;  // the growth
    io->memory()->synchronize();
    const auto t1 = std::chrono::steady_clock::now();
    if (store->capacity() != rows_after) return Status(Error::Internal, "growth did not reach rows_after");
    if (i > 0) total += std::chrono::duration<double>(t1 - t0).count();
    store.reset();
    io->memory()->synchronize();
  }
  out->seconds = total / repeats;
  return Status::ok_status();
}

}  // namespace offgraph_kv
