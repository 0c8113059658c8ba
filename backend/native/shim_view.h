// A tensor handle's shape, strides, dtype and data, read through the stable
// AOTI C shim in one place for every CPU kernel (decode_attention.cpp,
// decode_linear.cpp). False when any read fails or the rank differs.
#pragma once

#include <torch/csrc/inductor/aoti_torch/c/shim.h>

#include <cstdint>

namespace offgraph_kv_native {

struct View {
  int64_t dims = 0;
  const int64_t* sizes = nullptr;
  const int64_t* strides = nullptr;
  int32_t dtype = 0;
  void* data = nullptr;
};

inline bool view_of(AtenTensorHandle t, int64_t dims, View* v) {
  if (t == nullptr) return false;
  return aoti_torch_get_dim(t, &v->dims) == AOTI_TORCH_SUCCESS && v->dims == dims &&
         aoti_torch_get_sizes(t, const_cast<int64_t**>(&v->sizes)) == AOTI_TORCH_SUCCESS &&
         aoti_torch_get_strides(t, const_cast<int64_t**>(&v->strides)) == AOTI_TORCH_SUCCESS &&
         aoti_torch_get_dtype(t, &v->dtype) == AOTI_TORCH_SUCCESS &&
         aoti_torch_get_data_ptr(t, &v->data) == AOTI_TORCH_SUCCESS;
}

}  // namespace offgraph_kv_native
