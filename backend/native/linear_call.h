// The C boundary the linear kernels share (decode_linear.cpp,
// dynamic_linear.cpp): a new output for the activations' rows, the
// activation dtypes they take, and one way to return (a failure deletes what
// was made; no exception crosses into AOTInductor's generated code).
#pragma once

#include <torch/csrc/inductor/aoti_torch/c/shim.h>

#include "float16.h"
#include "shim_view.h"

#include <cstdint>

namespace offgraph_kv_native {

inline bool contiguous(const View& v) {
  int64_t expect = 1;
  for (int64_t d = v.dims - 1; d >= 0; --d) {
    if (v.sizes[d] != 1 && v.strides[d] != expect) return false;
    expect *= v.sizes[d];
  }
  return true;
}

// The activations [R, K] (any strides: they are read once, into fp32) and a new output [R, N] of their dtype.
inline bool activations(AtenTensorHandle x, int64_t k, int64_t n, View* xv, AtenTensorHandle* out, void** out_data) {
  if (!view_of(x, 2, xv) || xv->sizes[1] != k || xv->sizes[0] < 0) return false;
  const int64_t sizes[2] = {xv->sizes[0], n}, strides[2] = {n, 1};
  if (aoti_torch_empty_strided(2, sizes, strides, xv->dtype, aoti_torch_device_type_cpu(), 0, out)) return false;
  if (aoti_torch_get_data_ptr(*out, out_data)) {
    aoti_torch_delete_tensor_object(*out);
    return false;
  }
  return true;
}

// Calls fn with the activations' element type (fp32, bf16 or fp16); false for any other.
template <typename Fn>
inline bool with_float_type(int32_t dtype, Fn&& fn) {
  if (dtype == aoti_torch_dtype_float32()) return fn(float{}), true;
  if (dtype == aoti_torch_dtype_bfloat16()) return fn(Bf16{}), true;
  if (dtype == aoti_torch_dtype_float16()) return fn(Half{}), true;
  return false;
}

// One result for every entry point: the output on success, nothing on failure
// (the generated code then fails the step).
inline AOTITorchError finish(bool ok, AtenTensorHandle out, AtenTensorHandle* ret) {
  if (!ok) {
    if (out) aoti_torch_delete_tensor_object(out);
    return AOTI_TORCH_FAILURE;
  }
  *ret = out;
  return AOTI_TORCH_SUCCESS;
}

// No exception crosses the C boundary (a failed allocation fails the step instead).
template <typename Fn>
inline AOTITorchError guarded(Fn&& fn) {
  try {
    return fn();
  } catch (...) {
    return AOTI_TORCH_FAILURE;
  }
}

}  // namespace offgraph_kv_native
