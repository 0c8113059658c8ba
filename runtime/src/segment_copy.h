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

// Blocks launched per multiprocessor (spread over the segments); 0 restores
// the default. A process-wide tuning knob that benchmarks sweep; returns the
// value in effect. Also reports how many blocks of the kernel fit on one
// multiprocessor at once (0 without the kernel).
int set_segment_copy_blocks_per_sm(int blocks);
int segment_copy_resident_blocks_per_sm();

}  // namespace offgraph_kv
