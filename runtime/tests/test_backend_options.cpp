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

TEST(growth_option_takes_map_copy_or_auto_and_names_anything_else) {
  executorch::runtime::BackendOption opt{};
  std::strcpy(opt.key, "growth");
  std::array<char, executorch::runtime::kMaxOptionValueLength> text{};
  std::strcpy(text.data(), "mmap");
  opt.value = text;
  Status bad = apply_options({&opt, 1});
  CHECK(!bad.ok() && bad.message().find("growth") != std::string::npos && bad.message().find("mmap") != std::string::npos);
  opt.value = 3;  // not a string
  CHECK(!apply_options({&opt, 1}).ok());
  const GrowthPolicy defaults = policy(16, 4096);
  CHECK(resolve_policy(defaults, {}).growth == GrowthMode::Auto);
  std::strcpy(text.data(), "copy");
  opt.value = text;
  CHECK(apply_options({&opt, 1}).ok());
  CHECK(resolve_policy(defaults, {}).growth == GrowthMode::Copy);
  // A per-load spec overrides the process-wide option.
  executorch::runtime::BackendOption per_load = opt;
  std::strcpy(text.data(), "map");
  per_load.value = text;
  CHECK(resolve_policy(defaults, {&per_load, 1}).growth == GrowthMode::Map);
  executorch::runtime::BackendOption read{};
  std::strcpy(read.key, "growth");
  CHECK(read_options({&read, 1}).ok());
  CHECK(std::strcmp(std::get<2>(read.value).data(), "copy") == 0);
  std::strcpy(text.data(), "");
  opt.value = text;
  CHECK(apply_options({&opt, 1}).ok());  // "" restores the default
  CHECK(resolve_policy(defaults, {}).growth == GrowthMode::Auto);
}

TEST(num_threads_option_is_checked_and_the_error_names_the_option_and_the_value) {
  executorch::runtime::BackendOption opt{};
  std::strcpy(opt.key, "num_threads");
  opt.value = 2000;
  Status bad = apply_options({&opt, 1});
  CHECK(!bad.ok() && bad.message().find("num_threads") != std::string::npos &&
        bad.message().find("2000") != std::string::npos);
  opt.value = -1;
  bad = apply_options({&opt, 1});
  CHECK(!bad.ok() && bad.message().find("-1") != std::string::npos);
  std::array<char, executorch::runtime::kMaxOptionValueLength> text{};
  std::strcpy(text.data(), "2");
  opt.value = text;
  bad = apply_options({&opt, 1});
  CHECK(!bad.ok() && bad.message().find("a string") != std::string::npos);
  const GrowthPolicy defaults = policy(16, 4096);
  CHECK(resolve_policy(defaults, {}).num_threads == 0);  // nothing applied
  opt.value = 2;
  CHECK(apply_options({&opt, 1}).ok());
  CHECK(resolve_policy(defaults, {}).num_threads == 2);
  // Per load: a bad spec is named (the load fails), a good one wins over the process-wide option.
  executorch::runtime::BackendOption per_load = opt;
  per_load.value = 4096;
  Status spec = check_runtime_specs({&per_load, 1});
  CHECK(!spec.ok() && spec.message().find("num_threads") != std::string::npos &&
        spec.message().find("4096") != std::string::npos);
  per_load.value = 1;
  CHECK(check_runtime_specs({&per_load, 1}).ok());
  CHECK(resolve_policy(defaults, {&per_load, 1}).num_threads == 1);
  opt.value = 0;
  CHECK(apply_options({&opt, 1}).ok());
  CHECK(resolve_policy(defaults, {}).num_threads == 0);
}

TEST(cuda_graphs_option_takes_on_or_off_and_names_anything_else) {
  executorch::runtime::BackendOption opt{};
  std::strcpy(opt.key, "cuda_graphs");
  std::array<char, executorch::runtime::kMaxOptionValueLength> text{};
  std::strcpy(text.data(), "yes");
  opt.value = text;
  Status bad = apply_options({&opt, 1});
  CHECK(!bad.ok() && bad.message().find("cuda_graphs") != std::string::npos &&
        bad.message().find("yes") != std::string::npos);
  opt.value = true;  // not a string
  CHECK(!apply_options({&opt, 1}).ok());
  const GrowthPolicy defaults = policy(16, 4096);
  CHECK(resolve_policy(defaults, {}).cuda_graphs);  // on unless asked
  std::strcpy(text.data(), "off");
  opt.value = text;
  CHECK(apply_options({&opt, 1}).ok());
  CHECK(!resolve_policy(defaults, {}).cuda_graphs);
  executorch::runtime::BackendOption read{};
  std::strcpy(read.key, "cuda_graphs");
  CHECK(read_options({&read, 1}).ok());
  CHECK(std::strcmp(std::get<2>(read.value).data(), "off") == 0);
  std::strcpy(text.data(), "");
  opt.value = text;
  CHECK(apply_options({&opt, 1}).ok());  // "" restores the default
  CHECK(resolve_policy(defaults, {}).cuda_graphs);
}

TEST(growth_factor_option_takes_finite_decimals_above_one_and_names_anything_else) {
  executorch::runtime::BackendOption opt{};
  std::strcpy(opt.key, "growth_factor");
  std::array<char, executorch::runtime::kMaxOptionValueLength> text{};
  for (const char* bad : {"inf", "1e400", "nan", "1", "0x10", " 2", "2x", "abc", "-3"}) {
    std::strcpy(text.data(), bad);
    opt.value = text;
    Status s = apply_options({&opt, 1});
    CHECK(!s.ok() && s.message().find("growth_factor") != std::string::npos && s.message().find(bad) != std::string::npos);
  }
  std::strcpy(text.data(), "1.5");
  opt.value = text;
  CHECK(apply_options({&opt, 1}).ok());
  const GrowthPolicy defaults = policy(16, 4096);
  CHECK(resolve_policy(defaults, {}).growth_factor == 1.5);
  std::strcpy(text.data(), "");
  opt.value = text;
  CHECK(apply_options({&opt, 1}).ok());  // "" restores the default
}
