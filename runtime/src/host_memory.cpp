#include <cstdlib>
#include <cstring>

#include "device_memory.h"

namespace offgraph_kv {
namespace {

class HostMemory final : public DeviceMemory {
 public:
  void* allocate(size_t bytes) override {
    constexpr size_t kAlign = 64;  // a cache line, and what vector loads like
    return std::aligned_alloc(kAlign, (bytes + kAlign - 1) / kAlign * kAlign);
  }
  void release(void* ptr) override { std::free(ptr); }
  void copy(void* dst, const void* src, size_t bytes) override {
    std::memcpy(dst, src, bytes);
  }
  void zero(void* dst, size_t bytes) override { std::memset(dst, 0, bytes); }
  const char* name() const override { return "cpu"; }
};

}  // namespace

std::shared_ptr<DeviceMemory> host_memory() {
  static std::shared_ptr<DeviceMemory> memory = std::make_shared<HostMemory>();
  return memory;
}

}  // namespace offgraph_kv
