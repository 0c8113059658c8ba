// One kernel launch that copies many independent device segments.
//
// A growth moves the committed prefix of every flat tensor (64 segments for a
// 32-layer model). As separate memcpy calls each pays its own launch, which
// kept growth at 0.28 of memcpy bandwidth for 128 MiB on the H200; one launch
// over all segments pays it once.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <vector>

#include "device_memory.h"

namespace offgraph_kv {

// Whether this build carries the copy kernel (it needs nvcc at build time).
bool segment_copy_available();

// Queues the copies on `stream`; segments must not overlap. Returns the launch
// error (cudaErrorNotSupported when the kernel was not built).
cudaError_t segment_copy(const std::vector<CopyOp>& copies, cudaStream_t stream);

}  // namespace offgraph_kv
