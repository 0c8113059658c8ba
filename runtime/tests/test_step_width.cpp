// The step-width locator spec.
#include "step_width.h"
#include "harness.h"

using namespace offgraph_kv;
using namespace offgraph_kv::testing;

TEST(step_width_spec_parses_or_names_the_problem) {
  StepWidthLocator at;
  CHECK(parse_step_width("0:1", &at).ok() && at.input_index == 0 && at.dim == 1);
  CHECK(parse_step_width("12:3", &at).ok() && at.input_index == 12 && at.dim == 3);
  for (const char* bad : {"", "1", "a:1", "1:", ":1", "1:2:3", "-1:0"}) {
    Status s = parse_step_width(bad, &at);
    CHECK(!s.ok() && s.message().find("input_index:dim") != std::string::npos);
  }
}
