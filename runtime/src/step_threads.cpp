#include "step_threads.h"

#include <dlfcn.h>

namespace offgraph_kv {

StepThreads::StepThreads(void* library) {
  if (library == nullptr) return;
  set_ = reinterpret_cast<void (*)(int)>(dlsym(library, "omp_set_num_threads"));
  get_ = reinterpret_cast<int (*)()>(dlsym(library, "omp_get_max_threads"));
}

StepThreads::Scope::Scope(const StepThreads& t, size_t n) : t_(t) {
  if (n == 0 || !t_.available()) return;
  previous_ = t_.get_();
  if (previous_ != int(n)) t_.set_(int(n));
  else previous_ = 0;
}

StepThreads::Scope::~Scope() {
  if (previous_ > 0) t_.set_(previous_);
}

}  // namespace offgraph_kv
