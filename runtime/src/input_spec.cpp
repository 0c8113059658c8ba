#include "input_spec.h"

namespace offgraph_kv {

std::string scalar_type_name(int code) {
  static const char* names[] = {"Byte", "Char", "Short", "Int", "Long", "Half", "Float", "Double",
                                "ComplexHalf", "ComplexFloat", "ComplexDouble", "Bool", "QInt8", "QUInt8",
                                "QInt32", "BFloat16"};
  if (code >= 0 && code < int(sizeof(names) / sizeof(names[0]))) return names[code];
  return "ScalarType(" + std::to_string(code) + ")";
}

namespace {
std::string shape_text(const int32_t* sizes, size_t rank) {
  std::string s = "[";
  for (size_t d = 0; d < rank; ++d) s += (d ? ", " : "") + std::to_string(sizes[d]);
  return s + "]";
}
}  // namespace

Status check_input(size_t index, const InputSpec& spec, int dtype, const int32_t* sizes, size_t rank, size_t width) {
  const std::string where = "input " + std::to_string(index);
  if (dtype != spec.dtype)
    return Status(Error::InvalidArgument, where + ": dtype " + scalar_type_name(dtype) + ", compiled for " +
                                              scalar_type_name(spec.dtype));
  if (rank != spec.dims.size())
    return Status(Error::InvalidArgument, where + ": rank " + std::to_string(rank) + " " + shape_text(sizes, rank) +
                                              ", compiled for rank " + std::to_string(spec.dims.size()));
  for (size_t d = 0; d < rank; ++d) {
    const InputDim& dim = spec.dims[d];
    const int64_t size = sizes[d];
    const std::string at = where + " " + shape_text(sizes, rank) + " dim " + std::to_string(d) + ": extent " +
                           std::to_string(size);
    switch (dim.kind) {
      case DimKind::Static:
        if (size != dim.extent)
          return Status(Error::InvalidArgument, at + ", compiled for " + std::to_string(dim.extent));
        break;
      case DimKind::StepWidth:
        if (size != int64_t(width))
          return Status(Error::InvalidArgument,
                        at + " carries the step width, but the step width is " + std::to_string(width) +
                            " (every input's step-width dims must agree)");
        break;
      case DimKind::Dynamic:
        if (size < 0 || (dim.extent > 0 && size > dim.extent))
          return Status(Error::InvalidArgument, at + ", compiled for at most " + std::to_string(dim.extent));
        break;
    }
  }
  return Status::ok_status();
}

}  // namespace offgraph_kv
