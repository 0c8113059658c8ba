// How many threads the compiled code's parallel loops use for one step. AOTI
// CPU code parallelises with OpenMP (the runtime libtorch links); the thread
// count is per calling thread, so it is set for the step and restored after,
// leaving the host's own torch work as it was.
#pragma once

#include <cstddef>

namespace offgraph_kv {

class StepThreads {
 public:
  // Finds OpenMP through the compiled code's dependencies; without it, a no-op.
  explicit StepThreads(void* library);
  // `n` threads until destroyed (0: leave as is).
  class Scope {
   public:
    Scope(const StepThreads& t, size_t n);
    ~Scope();
    Scope(const Scope&) = delete;
    Scope& operator=(const Scope&) = delete;

   private:
    const StepThreads& t_;
    int previous_ = 0;
  };
  bool available() const { return set_ != nullptr && get_ != nullptr; }

 private:
  void (*set_)(int) = nullptr;
  int (*get_)() = nullptr;
};

}  // namespace offgraph_kv
