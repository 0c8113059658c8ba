// Step threads: what the default rule reads about the machine.
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>

#include "harness.h"
#include "step_threads.h"

using namespace offgraph_kv;

TEST(others_running_sees_a_spinning_process_and_not_this_ones_threads) {
  CHECK(usable_cores() >= 1);
  const long quiet = others_running();
  CHECK(quiet >= 0);
  const pid_t child = fork();
  if (child == 0) {
    for (volatile unsigned long i = 0;; ++i) {
    }
  }
  long seen = 0;
  for (int i = 0; i < 50 && seen < 1; ++i) {
    usleep(2000);
    seen = std::max(seen, others_running());
  }
  kill(child, SIGKILL);
  waitpid(child, nullptr, 0);
  CHECK(seen >= 1);
}
