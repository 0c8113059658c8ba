#include "growth_policy.h"

#include <algorithm>
#include <cmath>

namespace offgraph_kv {

const char* growth_mode_name(GrowthMode mode) {
  return mode == GrowthMode::Map ? "map" : mode == GrowthMode::Copy ? "copy" : "auto";
}

bool parse_growth_mode(const std::string& name, GrowthMode* mode) {
  if (name.empty() || name == "auto") *mode = GrowthMode::Auto;
  else if (name == "map") *mode = GrowthMode::Map;
  else if (name == "copy") *mode = GrowthMode::Copy;
  else return false;
  return true;
}

std::string GrowthPolicy::validate(size_t capacity_bound) const {
  if (max_capacity == 0) return "max_capacity must be positive";
  if (max_capacity > capacity_bound)
    return "max_capacity " + std::to_string(max_capacity) +
           " exceeds what the compiled code supports (" +
           std::to_string(capacity_bound) + " rows)";
  if (initial_capacity == 0 || initial_capacity > max_capacity)
    return "initial_capacity " + std::to_string(initial_capacity) +
           " must be in [1, max_capacity=" + std::to_string(max_capacity) + "]";
  if (rewind_budget > (size_t(1) << 24))
    return "rewind_budget " + std::to_string(rewind_budget) + " is above 2^24 slots";
  if (!(growth_factor > 1.0) || !std::isfinite(growth_factor))
    return "growth_factor " + std::to_string(growth_factor) + " must be > 1";
  return {};
}

size_t next_capacity(const GrowthPolicy& policy, size_t current, size_t needed) {
  if (needed > policy.max_capacity) return 0;
  size_t cap = std::max<size_t>(current, 1);
  while (cap < needed) {
    // At least one more row, so factors close to 1 still make progress.
    const double grown = std::ceil(static_cast<double>(cap) * policy.growth_factor);
    cap = std::max(cap + 1, static_cast<size_t>(std::min(grown, 1e18)));
  }
  return std::min(cap, policy.max_capacity);
}

}  // namespace offgraph_kv
