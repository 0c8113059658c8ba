// How many threads the compiled code's parallel loops use for one step.
//
// The parallel work of AOTI CPU code is in the ATen kernels it calls (MKL's
// GEMM / GEMV for fp32 weights, oneDNN for bf16, the fused attention), all on
// OpenMP (the libgomp that libtorch links); the backend compiles inductor's
// own kernels serial (backend/aoti_compile.py says why). OpenMP's thread
// count is per calling thread (the ICV of omp_set_num_threads), and MKL keeps
// one more per thread: torch.set_num_threads(n) sets mkl_set_num_threads_local(n),
// which then overrides the OpenMP setting for MKL calls on that thread. So a
// step sets both on the thread that runs it and restores both after, leaving
// the host's own torch work as it was. (at::set_num_threads would do both but
// also clears oneDNN's primitive cache on every call: not per step.)
//
// How idle OpenMP threads wait (OMP_WAIT_POLICY, GOMP_SPINCOUNT) is read once
// when libgomp starts, before any program loads: the runtime cannot change
// it. And whatever the policy, every parallel loop ends in a barrier that
// waits for its slowest thread: with another job on the cores, one preempted
// thread stalls the step for a scheduler time slice, loop after loop. So the
// default (num_threads unset, `automatic`) is measured, not assumed
// (benchmarks/cpu/threads.py, SmolLM2-135M on 2 cores, README "CPU threads"):
// decode steps take one thread (reading every weight once is bandwidth-bound:
// 2 threads were no faster idle and slower with a busy process per core, up
// to 20-40x at the worst step while inductor's kernels were parallel too);
// wider steps take the cores no other process is running on right now
// (2 threads prefill 1.6x faster idle, 1.6x slower busy, 20x slower when
// someone else's job held one core).
//
// Decode steps' linears (the weights' stream, most of a step) can also take
// helper threads of the compiled code's own (backend/native/shared_rows.h):
// the calling thread never waits for a helper that is not running (it takes
// its chunk back), so no barrier stalls the step. They are opt-in
// (`num_threads` n gives a decode step n - 1 helpers): measured in the whole
// SmolLM2 program they bought 0-13 % idle and, with a busy process per core,
// anywhere from 0.7x to 1.3x one thread's time (a runnable helper is one more
// thread for the scheduler to share the cores among, and it takes them from
// the caller as well as from the other job), so the default stays one thread.
#pragma once

#include <cstddef>

namespace offgraph_kv {

// Threads of other processes that are runnable right now (/proc/stat's
// procs_running less this process's own running threads); -1 when unknown.
long others_running();
// The cores this process may run on (its affinity mask).
size_t usable_cores();

class StepThreads {
 public:
  // Finds OpenMP (and MKL, when libtorch carries it) through the compiled
  // code's dependencies; without OpenMP, a no-op.
  explicit StepThreads(void* library);
  // `n` threads until destroyed (0: leave as is).
  class Scope {
   public:
    // `helpers`: the decode linears' helper threads for the step (when the code has them).
    Scope(const StepThreads& t, size_t n, size_t helpers = 0);
    ~Scope();
    Scope(const Scope&) = delete;
    Scope& operator=(const Scope&) = delete;

   private:
    const StepThreads& t_;
    bool active_ = false;
    int previous_omp_ = 0;
    int previous_mkl_ = 0;  // 0: MKL followed the global setting
    int previous_helpers_ = -1;  // -1: not set
  };
  // Waits until no helper thread still reads a call's weights (before they are freed).
  ~StepThreads();
  bool available() const { return set_ != nullptr && get_ != nullptr; }
  // The default thread count for a step of `width` tokens: 1 for a decode
  // step; else the caller's OpenMP setting, less the cores other processes
  // are running on at this moment (at least 1).
  size_t automatic(size_t width) const;
  // Helper threads for the decode linears of a step of `width` tokens: none
  // for wider steps; `num_threads` - 1 when that option is set (non-zero);
  // else the caller's OpenMP setting, at most the usable cores, less one.
  size_t helpers(size_t width, size_t num_threads) const;
  bool has_helpers() const { return set_helpers_ != nullptr; }
  bool controls_mkl() const { return mkl_set_local_ != nullptr; }

 private:
  void (*set_)(int) = nullptr;
  int (*get_)() = nullptr;
  int (*mkl_set_local_)(int) = nullptr;  // returns the previous thread-local count
  int (*set_helpers_)(int) = nullptr;    // the compiled code's offgraph_kv_set_step_helpers; previous count
  void (*quiesce_)() = nullptr;          // offgraph_kv_quiesce_step_helpers
};

}  // namespace offgraph_kv
