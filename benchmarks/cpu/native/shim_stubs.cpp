// Definitions of the AOTI shim functions the kernels reference, for running them outside
// libtorch (benchmarks/cpu/native/run.sh): the benchmarks call the kernels directly, never these.
#include <torch/csrc/inductor/aoti_torch/c/shim.h>
extern "C" {
AOTITorchError aoti_torch_get_dim(AtenTensorHandle, int64_t*) { return 1; }
AOTITorchError aoti_torch_get_sizes(AtenTensorHandle, int64_t**) { return 1; }
AOTITorchError aoti_torch_get_strides(AtenTensorHandle, int64_t**) { return 1; }
AOTITorchError aoti_torch_get_dtype(AtenTensorHandle, int32_t*) { return 1; }
AOTITorchError aoti_torch_get_data_ptr(AtenTensorHandle, void**) { return 1; }
AOTITorchError aoti_torch_empty_strided(int64_t, const int64_t*, const int64_t*, int32_t, int32_t, int32_t, AtenTensorHandle*) { return 1; }
AOTITorchError aoti_torch_delete_tensor_object(AtenTensorHandle) { return 1; }
int32_t aoti_torch_dtype_float32() { return 6; }
int32_t aoti_torch_dtype_bfloat16() { return 15; }
int32_t aoti_torch_dtype_float16() { return 5; }
int32_t aoti_torch_dtype_uint8() { return 0; }
int32_t aoti_torch_dtype_int8() { return 1; }
int32_t aoti_torch_dtype_int32() { return 3; }
int32_t aoti_torch_device_type_cpu() { return 0; }
}
