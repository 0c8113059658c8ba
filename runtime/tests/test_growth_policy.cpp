// Growth policy arithmetic: geometric, clamped, validated.
#include "growth_policy.h"
#include "harness.h"
#include "store_fixtures.h"

using namespace offgraph_kv;
using namespace offgraph_kv::testing;

TEST(growth_is_geometric_and_clamped_at_max_capacity) {
  GrowthPolicy p = policy(4, 100);
  CHECK(next_capacity(p, 4, 5) == 8);
  CHECK(next_capacity(p, 4, 9) == 16);
  CHECK(next_capacity(p, 64, 65) == 100);
  CHECK(next_capacity(p, 64, 101) == 0);
  p.growth_factor = 1.5;
  CHECK(next_capacity(p, 4, 5) == 6);
  p.growth_factor = 1.01;  // tiny factors still make progress
  CHECK(next_capacity(p, 4, 5) == 5);
}

TEST(growth_policy_validation_names_the_field) {
  CHECK(policy(4, 100).validate(100).empty());
  CHECK(policy(4, 200).validate(100).find("max_capacity 200 exceeds") != std::string::npos);
  CHECK(policy(0, 100).validate(100).find("initial_capacity") != std::string::npos);
  CHECK(policy(4, 100, 1.0).validate(100).find("growth_factor") != std::string::npos);
}
