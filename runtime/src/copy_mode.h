// How CUDA storage submits the per-tensor copies of one growth.
#pragma once

#include <string>
#include <utility>

namespace offgraph_kv {

// How a CUDA store submits the per-tensor copies of one growth. Auto is the
// fastest this build has: one copy-kernel launch when it was built with nvcc,
// else one cudaMemcpyBatchAsync. The others stay for side-by-side benchmarks.
enum class CopyMode { Auto, Kernel, Batch, EachCall };
// "auto", "kernel", "batch" or "each"; false for anything else.
inline bool parse_copy_mode(const std::string& name, CopyMode* mode) {
  static const std::pair<const char*, CopyMode> names[] = {
      {"auto", CopyMode::Auto}, {"kernel", CopyMode::Kernel}, {"batch", CopyMode::Batch}, {"each", CopyMode::EachCall}};
  for (const auto& [n, m] : names) {
    if (name == n) {
      *mode = m;
      return true;
    }
  }
  return false;
}

}  // namespace offgraph_kv
