#include "step_width.h"

#include <cctype>

namespace offgraph_kv {

namespace {
bool parse_index(const std::string& s, size_t* out) {
  if (s.empty() || s.size() > 9) return false;
  size_t v = 0;
  for (char c : s) {
    if (!std::isdigit(static_cast<unsigned char>(c))) return false;
    v = v * 10 + size_t(c - '0');
  }
  *out = v;
  return true;
}
}  // namespace

Status parse_step_width(const std::string& spec, StepWidthLocator* out) {
  const size_t colon = spec.find(':');
  if (colon == std::string::npos || !parse_index(spec.substr(0, colon), &out->input_index) ||
      !parse_index(spec.substr(colon + 1), &out->dim)) {
    return Status(Error::InvalidProgram,
                  "compile spec step_width '" + spec + "' is not of the form 'input_index:dim'");
  }
  return Status::ok_status();
}

}  // namespace offgraph_kv
