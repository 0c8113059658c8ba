// Runs every registered test, or the one named on the command line (ctest
// registers one test per name); exits non-zero when a check failed.
#include <cstdio>
#include <cstring>

#include "harness.h"

namespace offgraph_kv::testing {

std::vector<std::pair<const char*, std::function<void()>>>& registry() {
  static std::vector<std::pair<const char*, std::function<void()>>> r;
  return r;
}

int& failures() {
  static int n = 0;
  return n;
}

}  // namespace offgraph_kv::testing

int main(int argc, char** argv) {
  using namespace offgraph_kv::testing;
  size_t ran = 0;
  for (auto& [name, fn] : registry()) {
    if (argc > 1 && std::strcmp(argv[1], name) != 0) continue;
    const int before = failures();
    fn();
    ++ran;
    std::printf("%s %s\n", failures() == before ? "PASS" : "FAIL", name);
  }
  if (ran == 0) {
    std::fprintf(stderr, "no test named %s\n", argc > 1 ? argv[1] : "(any)");
    return 2;
  }
  std::printf("%zu tests, %d failed checks\n", ran, failures());
  return failures() == 0 ? 0 : 1;
}
