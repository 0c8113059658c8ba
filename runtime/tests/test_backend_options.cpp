// Backend options: overrides all or nothing, per-load specs.
#include <cstring>

#include "backend_options.h"
#include "harness.h"
#include "store_fixtures.h"

using namespace offgraph_kv;
using namespace offgraph_kv::testing;

TEST(backend_options_override_defaults_all_or_nothing) {
  executorch::runtime::BackendOption opts[2] = {};
  std::strcpy(opts[0].key, "max_capacity");
  opts[0].value = 512;
  std::strcpy(opts[1].key, "bogus");
  opts[1].value = 1;
  Status bad = apply_options({opts, 2});
  CHECK(!bad.ok() && bad.message().find("bogus") != std::string::npos);
  GrowthPolicy defaults = policy(16, 4096);
  CHECK(resolve_policy(defaults, {}).max_capacity == 4096);  // nothing applied
  CHECK(apply_options({opts, 1}).ok());
  CHECK(resolve_policy(defaults, {}).max_capacity == 512);
  opts[0].value = 0;
  CHECK(apply_options({opts, 1}).ok());
  CHECK(resolve_policy(defaults, {}).max_capacity == 4096);
}
