// What the compiled code was compiled for, per delegate input, and the check a
// step's inputs must pass before anything is bound: the compiled code trusts
// the shapes it is given, so an input that differs from what was compiled (a
// width that disagrees between inputs, a wrong rank or dtype) is rejected here
// rather than allowed to write outside the rows bound for the step.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "status.h"

namespace offgraph_kv {

enum class DimKind : int8_t { Static = 0, StepWidth = 1, Dynamic = 2 };

struct InputDim {
  DimKind kind = DimKind::Static;
  int64_t extent = 0;  // Static: the extent; Dynamic: the upper bound (0: none)
};

struct InputSpec {
  int8_t dtype = 0;  // ExecuTorch ScalarType code
  std::vector<InputDim> dims;
};

// Checks input `index` (dtype code and sizes as the host passed them) against
// its spec for a step of `width` tokens; the message names the input and the
// mismatch.
Status check_input(size_t index, const InputSpec& spec, int dtype, const int32_t* sizes, size_t rank, size_t width);

// "Float", "Long", ... for a ScalarType code, for messages.
std::string scalar_type_name(int code);

}  // namespace offgraph_kv
