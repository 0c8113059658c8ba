// The small test harness of the C++ unit tests: TEST registers a function,
// CHECK counts a failure and goes on. ctest runs each test by name.
#pragma once

#include <cstdio>
#include <functional>
#include <utility>
#include <vector>

namespace offgraph_kv::testing {

std::vector<std::pair<const char*, std::function<void()>>>& registry();
int& failures();

struct Register {
  Register(const char* name, std::function<void()> fn) { registry().emplace_back(name, std::move(fn)); }
};

}  // namespace offgraph_kv::testing

#define TEST(name)                                                         \
  static void name();                                                      \
  static ::offgraph_kv::testing::Register register_##name(#name, name);    \
  static void name()
#define CHECK(cond)                                                              \
  do {                                                                           \
    if (!(cond)) {                                                               \
      std::fprintf(stderr, "  FAILED %s:%d: %s\n", __FILE__, __LINE__, #cond);   \
      ++::offgraph_kv::testing::failures();                                      \
    }                                                                            \
  } while (0)
