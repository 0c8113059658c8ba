// The slice of AOTInductor's C ABI this runtime uses, declared locally.
//
// Declaring it here (rather than including torch headers) keeps libtorch out of
// the build: the functions are resolved with dlsym from the compiled shared
// object, which itself depends on the libtorch already loaded in the process.
#pragma once

#include <cstddef>
#include <cstdint>

extern "C" {
using AOTIRuntimeError = int32_t;  // 0 = success
using AOTITorchError = int32_t;    // 0 = success
struct AtenTensorOpaque;
using AtenTensorHandle = AtenTensorOpaque*;
struct AOTInductorModelContainerOpaque;
using AOTInductorModelContainerHandle = AOTInductorModelContainerOpaque*;
struct AOTInductorStreamOpaque;
using AOTInductorStreamHandle = AOTInductorStreamOpaque*;
struct AOTIProxyExecutorOpaque;
using AOTIProxyExecutorHandle = AOTIProxyExecutorOpaque*;

using ContainerCreateWithDeviceFn = AOTIRuntimeError (*)(
    AOTInductorModelContainerHandle*, size_t num_models, const char* device,
    const char* cubin_dir);
using ContainerDeleteFn = AOTIRuntimeError (*)(AOTInductorModelContainerHandle);
// Input handles are stolen by a run that gets past its input checks; output
// handles are new references owned by the caller.
using ContainerRunFn = AOTIRuntimeError (*)(
    AOTInductorModelContainerHandle, AtenTensorHandle* inputs, size_t num_inputs,
    AtenTensorHandle* outputs, size_t num_outputs, AOTInductorStreamHandle,
    AOTIProxyExecutorHandle);
using ContainerGetCountFn =
    AOTIRuntimeError (*)(AOTInductorModelContainerHandle, size_t*);
using GetLastErrorFn = AOTIRuntimeError (*)(const char**);

using CreateTensorFromBlobFn = AOTITorchError (*)(
    void* data, int64_t ndim, const int64_t* sizes, const int64_t* strides,
    int64_t storage_offset, int32_t dtype, int32_t device_type,
    int32_t device_index, AtenTensorHandle* out);
using GetDataPtrFn = AOTITorchError (*)(AtenTensorHandle, void**);
using GetInt64ArrayFn = AOTITorchError (*)(AtenTensorHandle, int64_t**);
using GetInt64Fn = AOTITorchError (*)(AtenTensorHandle, int64_t*);
using GetInt32Fn = AOTITorchError (*)(AtenTensorHandle, int32_t*);
using DeleteTensorFn = AOTITorchError (*)(AtenTensorHandle);
using CodeFn = int32_t (*)();
}
