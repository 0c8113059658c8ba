// Times the store's own growth path (allocate, contiguous copy, release) on a
// device, so benchmarks compare it with a plain memcpy in the same run.
#pragma once

#include <cstddef>
#include <string>

#include "status.h"

namespace offgraph_kv {

struct GrowthTiming {
  double seconds = 0;         // mean per growth, host wall clock (allocation calls, copy, release, one sync)
  double device_seconds = 0;  // mean per growth on the device stream (CUDA events; 0 on the host)
  size_t bytes_copied = 0;    // committed bytes moved per growth
};

// Fills `rows_before` rows of `layers` flat K/V pairs, then grows to
// `rows_after`, `repeats` times (each on a fresh store). `copy_mode` (see
// CopyMode: "auto", "kernel", "batch", "each") picks how CUDA submits the copies.
Status time_growth(const std::string& device, size_t layers, size_t heads, size_t head_dim, int dtype,
                   size_t rows_before, size_t rows_after, int repeats, const std::string& copy_mode,
                   GrowthTiming* out);

}  // namespace offgraph_kv
