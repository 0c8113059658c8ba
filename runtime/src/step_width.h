// The step-width locator "input_index:dim": which delegate input carries this
// step's token count, and along which dimension. Only the extent is read.
#pragma once

#include <cstddef>
#include <string>

#include "status.h"

namespace offgraph_kv {

struct StepWidthLocator {
  size_t input_index = 0;
  size_t dim = 0;
};

Status parse_step_width(const std::string& spec, StepWidthLocator* out);

}  // namespace offgraph_kv
