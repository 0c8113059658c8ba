// CUDA KV memory. Everything is ordered on one execution stream: allocation
// (cudaMallocFromPoolAsync / cudaMallocAsync), growth copies, frees
// (cudaFreeAsync, so nothing is released while a kernel that reads it may still
// be queued). KV arenas come from a pool of their own, trimmed once the step
// after a growth completes, so device memory follows the arena in use.
#pragma once

#include <cuda_runtime.h>

#include <memory>
#include <shared_mutex>
#include <string>

#include "copy_mode.h"
#include "device_memory.h"
#include "status.h"

namespace offgraph_kv {

std::string cuda_error(const char* what, cudaError_t e);

// The execution stream. Shared by the memories that release through it: a
// store may outlive the step I/O that made it, so the stream lives as long as
// the last buffer (a free on a destroyed stream fails and leaves a CUDA error
// behind that torch's next launch check then reports as its own).
class CudaStream {
 public:
  explicit CudaStream(cudaStream_t s) : stream_(s) {}
  ~CudaStream();
  CudaStream(const CudaStream&) = delete;
  CudaStream& operator=(const CudaStream&) = delete;
  cudaStream_t get() const { return stream_; }
  // Who may enqueue on this stream: steps share it, a capture holds it alone
  // (everything enqueued on a capturing stream, from any thread, joins the graph).
  std::shared_mutex& turns() { return turns_; }

 private:
  cudaStream_t stream_;
  std::shared_mutex turns_;
};

// KV storage: stream-ordered memory from a pool of its own (nullptr and a
// message when the pool cannot be made).
std::shared_ptr<DeviceMemory> cuda_kv_memory(std::shared_ptr<CudaStream> stream, CopyMode copies, Status* status);
// Small step buffers: stream-ordered memory from the device's default pool.
std::shared_ptr<DeviceMemory> cuda_stream_memory(std::shared_ptr<CudaStream> stream, CopyMode copies);

}  // namespace offgraph_kv
