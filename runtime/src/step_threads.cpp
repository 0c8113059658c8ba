#include "step_threads.h"

#include <dirent.h>
#include <dlfcn.h>
#include <sched.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>

namespace offgraph_kv {

namespace {

// Reads a small /proc file into `buf`; false when it cannot.
bool read_small(const char* path, char* buf, size_t size) {
  FILE* f = std::fopen(path, "r");
  if (f == nullptr) return false;
  const size_t n = std::fread(buf, 1, size - 1, f);
  std::fclose(f);
  buf[n] = '\0';
  return n > 0;
}

long procs_running() {
  char buf[8192];  // procs_running comes after the per-CPU and interrupt lines
  if (!read_small("/proc/stat", buf, sizeof buf)) return -1;
  const char* at = std::strstr(buf, "\nprocs_running ");
  return at == nullptr ? -1 : std::strtol(at + 15, nullptr, 10);
}

// Threads of this process in state R (running or runnable), this one included.
long own_running() {
  DIR* dir = opendir("/proc/self/task");
  if (dir == nullptr) return -1;
  long n = 0;
  char path[64], buf[512];
  while (const dirent* e = readdir(dir)) {
    if (e->d_name[0] < '0' || e->d_name[0] > '9') continue;
    std::snprintf(path, sizeof path, "/proc/self/task/%s/stat", e->d_name);
    if (!read_small(path, buf, sizeof buf)) continue;
    const char* close = std::strrchr(buf, ')');  // the state follows the command name, which may hold spaces
    if (close != nullptr && close[1] == ' ' && close[2] == 'R') ++n;
  }
  closedir(dir);
  return n;
}

}  // namespace

size_t usable_cores() {
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof set, &set) == 0) return size_t(std::max(1, CPU_COUNT(&set)));
  return 1;
}

long others_running() {
  const long all = procs_running();
  if (all < 0) return -1;
  const long own = own_running();
  if (own < 0) return -1;
  return std::max(0L, all - own);
}

StepThreads::StepThreads(void* library) {
  if (library == nullptr) return;
  set_ = reinterpret_cast<void (*)(int)>(dlsym(library, "omp_set_num_threads"));
  get_ = reinterpret_cast<int (*)()>(dlsym(library, "omp_get_max_threads"));
  // The C entry point (mkl_service.h maps mkl_set_num_threads_local to it); the
  // lowercase symbols libtorch exports are MKL's Fortran ones, which take a pointer.
  mkl_set_local_ = reinterpret_cast<int (*)(int)>(dlsym(library, "MKL_Set_Num_Threads_Local"));
  // Present where the program calls the decode-linear kernels (backend/native/decode_linear.cpp).
  set_helpers_ = reinterpret_cast<int (*)(int)>(dlsym(library, "offgraph_kv_set_step_helpers"));
  quiesce_ = reinterpret_cast<void (*)()>(dlsym(library, "offgraph_kv_quiesce_step_helpers"));
}

StepThreads::~StepThreads() {
  if (quiesce_ != nullptr) quiesce_();
}

size_t StepThreads::helpers(size_t width, size_t num_threads) const {
  // Opt-in only (step_threads.h): the default decode step is one thread.
  if (width != 1 || set_helpers_ == nullptr || num_threads == 0) return 0;
  return num_threads - 1;
}

size_t StepThreads::automatic(size_t width) const {
  if (width <= 1 || !available()) return 1;
  const size_t wanted = size_t(std::max(1, get_()));  // the caller's setting (OMP_NUM_THREADS, torch.set_num_threads)
  const size_t cores = usable_cores();
  if (wanted == 1 || cores == 1) return 1;
  const long others = others_running();
  if (others < 0) return 1;  // cannot tell whether the cores are free: one thread is never the slow choice
  const long free = long(cores) - others;
  return size_t(std::max(1L, std::min(long(wanted), free)));
}

StepThreads::Scope::Scope(const StepThreads& t, size_t n, size_t helpers) : t_(t) {
  if (t_.set_helpers_ != nullptr) previous_helpers_ = t_.set_helpers_(int(helpers));
  if (n == 0 || !t_.available()) return;
  active_ = true;
  previous_omp_ = t_.get_();
  if (previous_omp_ != int(n)) t_.set_(int(n));
  // Set even when it equals the OpenMP count: left alone, MKL follows its own
  // global setting and dynamic adjustment; 64-token steps so run took 5.3 s
  // (median) on a busy machine against 0.44 s with the same count set here
  // (a build whose inductor kernels were parallel too).
  if (t_.mkl_set_local_ != nullptr) previous_mkl_ = t_.mkl_set_local_(int(n));
}

StepThreads::Scope::~Scope() {
  if (previous_helpers_ >= 0) t_.set_helpers_(previous_helpers_);
  if (!active_) return;
  if (t_.mkl_set_local_ != nullptr) t_.mkl_set_local_(previous_mkl_);  // 0 restores "follow the global setting"
  if (t_.get_() != previous_omp_) t_.set_(previous_omp_);
}

}  // namespace offgraph_kv
