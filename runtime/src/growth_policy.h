// Growth policy of flat storage: pure arithmetic, no allocation.
#pragma once

#include <cstddef>
#include <string>

namespace offgraph_kv {

// How flat storage grows. Map: address space for max_capacity rows is
// reserved at load and backed as the store grows (nothing is copied, nothing
// moves); Copy: a new arena per capacity, committed rows copied over. Auto:
// whichever the device does better (DeviceMemory::maps_by_default); Map falls
// back to Copy, with a logged reason, where the memory cannot reserve.
enum class GrowthMode { Auto, Map, Copy };
const char* growth_mode_name(GrowthMode mode);
// "auto", "map" or "copy" (and "" for auto); false for anything else.
bool parse_growth_mode(const std::string& name, GrowthMode* mode);

struct GrowthPolicy {
  size_t initial_capacity = 256;
  size_t max_capacity = 0;  // hard bound on readable rows
  double growth_factor = 2.0;
  // Extra ring slots beyond window + max_write - 1: how far back beyond
  // max_write a ring layer can still be rewound exactly (the store's load-time
  // policy, beside growth).
  size_t rewind_budget = 0;
  // Threads the compiled code's parallel loops use per step; 0: one for decode
  // steps (bandwidth-bound: more threads do not help, and collapse when another
  // job holds a core), the process's OpenMP setting for wider steps.
  size_t num_threads = 0;
  GrowthMode growth = GrowthMode::Auto;
  // CUDA: capture the decode step as a graph and replay it (step_graph.h),
  // where the compiled code allows it; off runs every step uncaptured.
  bool cuda_graphs = true;

  // Empty when valid, otherwise a message naming the offending field.
  std::string validate(size_t capacity_bound) const;
};

// The capacity to grow to so that `needed` rows fit: geometric from `current`,
// clamped at max_capacity. Returns 0 when `needed` exceeds max_capacity.
size_t next_capacity(const GrowthPolicy& policy, size_t current, size_t needed);

}  // namespace offgraph_kv
