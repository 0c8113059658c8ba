// Times the store's own growth path (allocate, contiguous copy, release) on a
// device, so benchmarks compare it with a plain memcpy in the same run.
#pragma once

#include <cstddef>
#include <string>
#include <utility>

#include "status.h"

namespace offgraph_kv {

struct GrowthTiming {
  double seconds = 0;         // mean per growth, host wall clock (allocation calls, copy, release, one sync)
  double device_seconds = 0;  // mean per growth on the device stream (CUDA events; 0 on the host)
  double copy_device_seconds = 0;  // mean of the copy alone (the one batch of copies), CUDA events
  size_t bytes_copied = 0;    // committed bytes moved per growth (0 with map growth)
  size_t peak_bytes = 0;      // the store's own peak (its accounting), the last round
  size_t allocated_bytes = 0; // the store's allocation after the growth, the last round
  // CUDA: device memory in use right after the growth (before an old arena is
  // given back: the growth's peak), less what was in use before the store; max over rounds.
  size_t device_peak_bytes = 0;
  std::string growth;         // the growth in effect ("map" or "copy")
};

// Fills `rows_before` rows of `layers` flat K/V pairs, then grows to
// `rows_after`, `repeats` times, each on a new store. With `fresh_memory` the
// store's memory holds only its arena before the growth, as after any
// completed step, so the new arena is memory the device maps afresh (real
// use); without, the pool still holds the previous round's blocks. `copy_mode` (see
// CopyMode: "auto", "kernel", "batch", "each") picks how CUDA submits the copies;
// `growth` ("copy", "map", "auto") the store's growth policy. With `touch` the
// new rows a step would write next (rows_before .. rows_after) are written
// after the growth, inside the timed span: what the step after a growth costs
// on top (map growth: first-touch page faults on the host, nothing on CUDA).
Status time_growth(const std::string& device, size_t layers, size_t heads, size_t head_dim, int dtype,
                   size_t rows_before, size_t rows_after, int repeats, const std::string& copy_mode,
                   bool fresh_memory, const std::string& growth, bool touch, GrowthTiming* out);

struct ReservationCost {
  size_t reserved_bytes = 0;   // address space the store reserved
  size_t allocated_bytes = 0;  // what it backed (the initial rows, in whole chunks)
  long long device_used_delta = 0;  // device memory in use after the store's creation, less before (CUDA)
  std::string growth;               // in effect
  std::string note;                 // why not map, when not
};

// Creates a map-growth store of `layers` flat K/V pairs for `max_rows` rows
// (`initial_rows` backed) on `device` and reports what that cost.
Status reservation_cost(const std::string& device, size_t layers, size_t heads, size_t head_dim, int dtype,
                        size_t initial_rows, size_t max_rows, ReservationCost* out);

// Benchmark hook: blocks per multiprocessor of the growth copy kernel (0: the
// default), process-wide. Returns {the value in effect, how many blocks of the
// kernel fit on one multiprocessor}; {0, 0} when this build has no kernel.
std::pair<int, int> set_copy_kernel_grid(int blocks_per_sm);

}  // namespace offgraph_kv
