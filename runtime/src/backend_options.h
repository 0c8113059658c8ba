// Load-time policy: ExecuTorch backend options override the export-time
// defaults of the growth policy for every method loaded afterwards.
//
// Keys: "initial_capacity" (int), "max_capacity" (int), "growth_factor"
// (string, e.g. "1.5"), "rewind_budget" (int), "num_threads" (int), "growth"
// (string: "map", "copy" or "auto"). 0 or "" restores the export-time default
// (-1 for rewind_budget, where 0 is a value; "auto" for growth).
#pragma once

#include <executorch/runtime/backend/options.h>
#include <executorch/runtime/core/span.h>

#include "growth_policy.h"
#include "status.h"

namespace offgraph_kv {

using executorch::runtime::BackendOption;
using executorch::runtime::Span;

// set_option: record overrides (process-wide, like the registry they come through).
Status apply_options(Span<BackendOption> options);
// get_option: report the overrides now in force (0 / "" when unset).
Status read_options(Span<BackendOption> options);

// The per-load runtime specs a C++ host passes to Module::load, checked as
// set_option checks its options (a bad one fails the load, naming it).
Status check_runtime_specs(Span<const BackendOption> runtime_specs);
// The policy for one load: export defaults, then process-wide overrides, then
// the per-load runtime specs a C++ host may pass to Module::load.
GrowthPolicy resolve_policy(const GrowthPolicy& defaults, Span<const BackendOption> runtime_specs);

}  // namespace offgraph_kv
