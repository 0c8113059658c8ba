// Decode-step work shared with helper threads without ever waiting for one.
//
// An OpenMP loop ends in a barrier: with another job on the cores, a preempted
// thread stalls the step for a scheduler time slice, loop after loop (a SmolLM2
// step's bf16 linears took 8.6 ms on 2 threads idle, 18.5 ms with one busy
// process, 11.3-12.5 ms on one thread). Here the calling thread owns the call:
// the outputs are cut into chunks, every thread claims chunks from one
// counter, a helper computes its chunk into scratch of its own and publishes
// it only if the chunk is still its own, and the caller, once no chunk is
// left to claim, takes back any chunk a helper has not published after
// twice the caller's own time for a chunk and computes it itself. So a step
// is never held up by a helper that is not running (beyond the copy of one
// published chunk), and with helpers running the weights are read by two
// cores. Every chunk is computed by the same code whichever thread runs it,
// so the outputs are the same bits as on one thread.
//
// Lifetimes: a call's record (activations, chunk states) is reference
// counted, so a helper that wakes after its call has returned touches only
// that record and, until it sees that its chunk was taken, the weights; the
// runtime calls quiesce() before it frees weights (offgraph_kv_quiesce_step_helpers).
#pragma once

#include <pthread.h>
#include <sched.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

namespace offgraph_kv_native {

// Helper threads this thread's decode linears may share their outputs with, set by the runtime per
// step on the thread that runs it (offgraph_kv_set_step_helpers, decode_linear.cpp); 0: the kernels'
// OpenMP loops, as for wider steps. One variable for every kernel of the program's library.
inline thread_local int step_helpers = 0;

// One call's work: `count()` chunks that any thread may compute.
class SharedCall {
 public:
  explicit SharedCall(int64_t chunks) : count_(chunks), state_(new std::atomic<uint8_t>[size_t(chunks)]) {
    for (int64_t i = 0; i < chunks; ++i) state_[i].store(kFree, std::memory_order_relaxed);
  }
  virtual ~SharedCall() = default;
  SharedCall(const SharedCall&) = delete;
  SharedCall& operator=(const SharedCall&) = delete;

  int64_t count() const { return count_; }
  // Chunk c straight into the outputs (the caller).
  virtual void compute_into_outputs(int64_t c) = 0;
  // Chunk c into `scratch` (a helper), then, if it is still the helper's, into the outputs.
  virtual size_t scratch_bytes() const = 0;
  virtual void compute_into_scratch(int64_t c, void* scratch) = 0;
  virtual void publish(int64_t c, const void* scratch) = 0;

 private:
  friend class HelperPool;
  enum : uint8_t { kFree = 0, kHelper = 1, kDone = 2, kCaller = 3, kPublishing = 4 };
  const int64_t count_;
  std::atomic<int64_t> next_{0};
  std::unique_ptr<std::atomic<uint8_t>[]> state_;
};

class HelperPool {
 public:
  // The process's pool (one per compiled program's code), never destroyed: its
  // threads may outlive any static destructor that could join them.
  static HelperPool& get() {
    static std::once_flag once;
    std::call_once(once, [] {
      instance() = new HelperPool();
      pthread_atfork(nullptr, nullptr, [] { instance() = new HelperPool(); });  // the child has no helpers
    });
    return *instance();
  }

  // Runs every chunk of `call`, with up to `helpers` pool threads joining in;
  // returns once every chunk's outputs are in place.
  void run(const std::shared_ptr<SharedCall>& call, int helpers) {
    SharedCall& c = *call;
    if (helpers > 0 && ensure(helpers)) offer(call, helpers);
    using Clock = std::chrono::steady_clock;
    // The quickest chunk is the one the caller was not preempted in: a chunk's time on a running core.
    Clock::duration chunk_time = Clock::duration::max();
    for (int64_t i; (i = c.next_.fetch_add(1, std::memory_order_relaxed)) < c.count_;) {
      uint8_t free = SharedCall::kFree;
      if (!c.state_[i].compare_exchange_strong(free, SharedCall::kCaller, std::memory_order_acq_rel)) continue;
      const auto t0 = Clock::now();
      c.compute_into_outputs(i);
      chunk_time = std::min(chunk_time, Clock::now() - t0);
    }
    // What helpers hold: theirs while they are quick about it, else the caller's.
    const auto patience =
        chunk_time != Clock::duration::max() ? 2 * chunk_time : Clock::duration(std::chrono::microseconds(20));
    for (int64_t i = 0; i < c.count_; ++i) {
      const auto deadline = Clock::now() + patience;
      for (unsigned spins = 0;; ++spins) {
        uint8_t s = c.state_[i].load(std::memory_order_acquire);
        if (s == SharedCall::kDone || s == SharedCall::kCaller) break;
        if (s == SharedCall::kFree || (s == SharedCall::kHelper && Clock::now() > deadline)) {
          if (c.state_[i].compare_exchange_strong(s, SharedCall::kCaller, std::memory_order_acq_rel)) {
            if (s == SharedCall::kHelper) taken_back_.fetch_add(1, std::memory_order_relaxed);
            c.compute_into_outputs(i);
            break;
          }
          continue;
        }
        pause(spins);  // a helper computing (within patience) or copying its published chunk
      }
    }
    retire(call);
  }

  // Chunks helpers published, and chunks the caller took back from a helper, since the process began.
  int64_t helped() const { return helped_.load(std::memory_order_relaxed); }
  int64_t taken_back() const { return taken_back_.load(std::memory_order_relaxed); }

  // Tests: every helper sleeps this long after claiming a chunk, as if preempted there.
  void delay_helpers_for_tests(int microseconds) { test_delay_us_.store(std::max(0, microseconds)); }

  // Returns once no helper is inside a call (before the weights a call reads are freed).
  void quiesce() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      current_.reset();
    }
    for (unsigned spins = 0; inside_.load(std::memory_order_acquire) != 0; ++spins) pause(spins | 1024u);
  }

 private:
  static HelperPool*& instance() {
    static HelperPool* pool = nullptr;
    return pool;
  }

  static void pause(unsigned spins) {
    if (spins < 64) {
#if defined(__x86_64__) || defined(__i386__)
      __builtin_ia32_pause();
#endif
    } else {
      sched_yield();  // leave the core to whoever the scheduler would rather run (the caller, under load)
    }
  }

  bool ensure(int helpers) {
    std::lock_guard<std::mutex> lock(mutex_);
    try {
      while (int(threads_) < helpers) {
        std::thread([this, id = int(threads_)] { loop(id); }).detach();
        ++threads_;
      }
    } catch (...) {  // no more threads: the caller does the rest
    }
    return threads_ > 0;
  }

  void offer(const std::shared_ptr<SharedCall>& call, int helpers) {
    std::lock_guard<std::mutex> lock(mutex_);
    current_ = call;
    wanted_ = helpers;
    generation_.fetch_add(1, std::memory_order_release);
    if (sleeping_ > 0) wake_.notify_all();
  }

  void retire(const std::shared_ptr<SharedCall>& call) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (current_ == call) current_.reset();
  }

  void loop(int id) {
    std::vector<char> scratch;
    uint64_t seen = generation_.load(std::memory_order_acquire);
    for (;;) {
      wait_for_work(seen);
      std::shared_ptr<SharedCall> call;
      {
        std::lock_guard<std::mutex> lock(mutex_);
        seen = generation_.load(std::memory_order_acquire);
        if (current_ == nullptr || id >= wanted_) continue;
        call = current_;
        inside_.fetch_add(1, std::memory_order_acq_rel);  // under the lock: quiesce() cannot miss it
      }
      help(*call, &scratch);
      call.reset();
      inside_.fetch_sub(1, std::memory_order_acq_rel);
    }
  }

  // Spins a little (the next linear of a step follows within microseconds),
  // yields for a while, then sleeps until the next call is offered.
  void wait_for_work(uint64_t seen) {
    using Clock = std::chrono::steady_clock;
    const auto until = Clock::now() + std::chrono::microseconds(200);
    for (unsigned spins = 0; generation_.load(std::memory_order_acquire) == seen; ++spins) {
      if ((spins & 63u) == 63u && Clock::now() > until) {
        std::unique_lock<std::mutex> lock(mutex_);
        ++sleeping_;
        wake_.wait(lock, [&] { return generation_.load(std::memory_order_acquire) != seen; });
        --sleeping_;
        return;
      }
      pause(spins);
    }
  }

  void help(SharedCall& c, std::vector<char>* scratch) {
    scratch->resize(std::max(scratch->size(), c.scratch_bytes()));
    for (int64_t i; (i = c.next_.fetch_add(1, std::memory_order_relaxed)) < c.count_;) {
      uint8_t s = SharedCall::kFree;
      if (!c.state_[i].compare_exchange_strong(s, SharedCall::kHelper, std::memory_order_acq_rel)) continue;
      if (const int us = test_delay_us_.load(std::memory_order_relaxed))
        std::this_thread::sleep_for(std::chrono::microseconds(us));  // a preempted helper, for the tests
      c.compute_into_scratch(i, scratch->data());
      s = SharedCall::kHelper;
      if (!c.state_[i].compare_exchange_strong(s, SharedCall::kPublishing, std::memory_order_acq_rel))
        continue;  // the caller took it back: drop the scratch
      c.publish(i, scratch->data());
      c.state_[i].store(SharedCall::kDone, std::memory_order_release);
      helped_.fetch_add(1, std::memory_order_relaxed);
    }
  }

  std::mutex mutex_;
  std::condition_variable wake_;
  std::shared_ptr<SharedCall> current_;  // guarded by mutex_
  int wanted_ = 0;                       // guarded by mutex_: helpers with a smaller id join current_
  int sleeping_ = 0;                     // guarded by mutex_
  size_t threads_ = 0;                   // guarded by mutex_
  std::atomic<uint64_t> generation_{0};  // bumped under mutex_ for every call offered
  std::atomic<int> inside_{0};           // helpers holding a call
  std::atomic<int64_t> helped_{0}, taken_back_{0};
  std::atomic<int> test_delay_us_{0};
};

}  // namespace offgraph_kv_native
