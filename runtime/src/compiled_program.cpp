#include "compiled_program.h"

#include <dlfcn.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <map>
#include <mutex>

namespace offgraph_kv {

namespace {

template <typename Fn>
bool resolve(void* lib, const char* name, Fn* out, std::string* missing) {
  *out = reinterpret_cast<Fn>(dlsym(lib, name));
  if (*out == nullptr && missing->empty()) *missing = name;
  return *out != nullptr;
}

// The code lives only in the .pte; dlopen needs a file, so write a private one
// and unlink it as soon as it is mapped.
Status write_temp(const void* code, size_t size, std::string* path) {
  const char* dir = std::getenv("TMPDIR");
  std::string tmpl = std::string(dir && *dir ? dir : "/tmp") + "/offgraph_kv_XXXXXX.so";
  std::vector<char> name(tmpl.begin(), tmpl.end());
  name.push_back('\0');
  const int fd = mkstemps(name.data(), 3);
  if (fd < 0) return Status(Error::AccessFailed, "cannot create a temporary file for the compiled code in " + tmpl);
  const char* p = static_cast<const char*>(code);
  size_t left = size;
  while (left > 0) {
    const ssize_t n = ::write(fd, p, left);
    if (n <= 0) {
      ::close(fd);
      ::unlink(name.data());
      return Status(Error::AccessFailed, "cannot write the compiled code to " + std::string(name.data()));
    }
    p += n;
    left -= size_t(n);
  }
  ::close(fd);
  *path = name.data();
  return Status::ok_status();
}

// The compiled code, mapped once per process per distinct code and kept: the
// AOTI runtime leaves thread-local state behind (its last-error string, cached
// outputs) whose pending destructors pin a library in memory until its threads
// exit, so dlclose cannot unmap it anyway. Mapping each load's own copy would
// leak the code's size per load; sharing it costs that once. Containers (and
// their buffers) stay per load.
void* map_code(const void* code, size_t size, const std::string& key, Status* status) {
  static std::mutex mutex;
  static std::map<std::string, void*> mapped;
  std::lock_guard<std::mutex> lock(mutex);
  auto it = mapped.find(key);
  if (it != mapped.end()) return it->second;
  std::string path;
  *status = write_temp(code, size, &path);
  if (!status->ok()) return nullptr;
  void* library = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  const char* err = library ? nullptr : dlerror();
  ::unlink(path.c_str());
  if (library == nullptr) {
    *status = Status(Error::InvalidProgram, std::string("cannot load the compiled code: ") + (err ? err : "?") +
                                                " (is torch imported / libtorch on the library path?)");
    return nullptr;
  }
  mapped.emplace(key, library);
  return library;
}

}  // namespace

std::unique_ptr<CompiledProgram> CompiledProgram::load(const void* code, size_t size, const std::string& key,
                                                       const std::string& device, Status* status) {
  std::unique_ptr<CompiledProgram> prog(new CompiledProgram());
  *status = Status::ok_status();
  prog->library_ = map_code(code, size, key, status);
  if (prog->library_ == nullptr) return nullptr;
  std::string missing;
  ContainerCreateWithDeviceFn create = nullptr;
  ContainerGetCountFn get_inputs = nullptr, get_outputs = nullptr;
  CodeFn cpu_code = nullptr, cuda_code = nullptr;
  void* lib = prog->library_;
  resolve(lib, "AOTInductorModelContainerCreateWithDevice", &create, &missing);
  resolve(lib, "AOTInductorModelContainerDelete", &prog->delete_container_, &missing);
  // Every run of a method comes from one thread at a time (a container per
  // load), which the single-threaded entry asks for; it skips the model pool
  // and its per-run CUDA event. Older code has only the threaded one.
  std::string optional_missing;  // entry points the load does without
  prog->single_threaded_ =
      resolve(lib, "AOTInductorModelContainerRunSingleThreaded", &prog->run_, &optional_missing);
  if (!prog->single_threaded_) resolve(lib, "AOTInductorModelContainerRun", &prog->run_, &missing);
  resolve(lib, "AOTInductorModelContainerGetNumInputs", &get_inputs, &missing);
  resolve(lib, "AOTInductorModelContainerGetNumOutputs", &get_outputs, &missing);
  resolve(lib, "aoti_torch_create_tensor_from_blob", &prog->from_blob_, &missing);
  resolve(lib, "aoti_torch_get_data_ptr", &prog->data_ptr_, &missing);
  resolve(lib, "aoti_torch_get_sizes", &prog->sizes_, &missing);
  resolve(lib, "aoti_torch_get_dim", &prog->dim_, &missing);
  resolve(lib, "aoti_torch_get_dtype", &prog->dtype_, &missing);
  resolve(lib, "aoti_torch_delete_tensor_object", &prog->delete_tensor_, &missing);
  resolve(lib, "aoti_torch_device_type_cpu", &cpu_code, &missing);
  if (device == "cuda") resolve(lib, "aoti_torch_device_type_cuda", &cuda_code, &missing);
  if (!missing.empty()) {
    *status = Status(Error::InvalidProgram, "compiled code lacks the AOTI entry point " + missing);
    return nullptr;
  }
  resolve(lib, "AOTInductorGetLastError", &prog->last_error_, &optional_missing);
  prog->device_type_ = device == "cuda" ? cuda_code() : cpu_code();
  if (create(&prog->container_, 1, device.c_str(), nullptr) != 0 || prog->container_ == nullptr) {
    *status = Status(Error::InvalidProgram, "AOTInductor could not create the model container for " + device);
    return nullptr;
  }
  if (get_inputs(prog->container_, &prog->num_inputs_) != 0 || get_outputs(prog->container_, &prog->num_outputs_) != 0) {
    *status = Status(Error::InvalidProgram, "AOTInductor could not report the compiled inputs/outputs");
    return nullptr;
  }
  *status = Status::ok_status();
  return prog;
}

CompiledProgram::~CompiledProgram() {
  if (container_ != nullptr) delete_container_(container_);
  // The library stays mapped, once per process (map_code).
}

Status CompiledProgram::run_raw(const std::vector<TensorDesc>& inputs, void* stream) {
  if (inputs.size() != num_inputs_)
    return Status(Error::InvalidArgument, "compiled code takes " + std::to_string(num_inputs_) + " inputs, got " +
                                              std::to_string(inputs.size()));
  std::vector<AtenTensorHandle>& handles = input_handles_;
  handles.assign(inputs.size(), nullptr);
  for (size_t i = 0; i < inputs.size(); ++i) {
    const TensorDesc& d = inputs[i];
    if (from_blob_(d.data, int64_t(d.sizes.size()), d.sizes.data(), d.strides.data(), 0, d.dtype, device_type_, 0,
                   &handles[i]) != 0) {
      for (size_t j = 0; j < i; ++j) delete_tensor_(handles[j]);
      return Status(Error::Internal, "cannot describe compiled input " + std::to_string(i));
    }
  }
  std::vector<AtenTensorHandle>* outputs = &output_handles_;
  outputs->assign(num_outputs_, nullptr);
  // A successful run takes ownership of the input handles (they only borrow our
  // memory). On failure their ownership is unknowable from outside, so they are
  // left alone: a few bytes leaked per failed run rather than a double free.
  const AOTIRuntimeError rc = run_(container_, handles.data(), handles.size(), outputs->data(), outputs->size(),
                                   reinterpret_cast<AOTInductorStreamHandle>(stream), nullptr);
  if (rc != 0) {
    const char* msg = nullptr;
    if (last_error_ != nullptr) last_error_(&msg);
    outputs->clear();
    std::string text = msg && *msg ? msg : "(no message)";
    text = text.substr(0, text.find('\n'));  // the cause, not torch's frame dump
    return Status(Error::Internal, "compiled code failed: " + text);
  }
  return Status::ok_status();
}

Status CompiledProgram::launch(const std::vector<TensorDesc>& inputs, void* stream, std::vector<OutputView>* outputs) {
  Status s = run_raw(inputs, stream);
  if (!s.ok()) return s;
  outputs->assign(output_handles_.size(), OutputView());
  for (size_t i = 0; i < output_handles_.size() && s.ok(); ++i) s = describe(output_handles_[i], &(*outputs)[i]);
  // Released at once: their memory stays in the capturing graph's private pool.
  for (AtenTensorHandle h : output_handles_) release(h);
  return s;
}

std::string CompiledProgram::last_error() const {
  const char* msg = nullptr;
  if (last_error_ != nullptr) last_error_(&msg);
  const std::string text = msg && *msg ? msg : "no message";
  return text.substr(0, text.find('\n'));
}

Status CompiledProgram::describe(AtenTensorHandle h, OutputView* out) const {
  void* data = nullptr;
  int64_t* sizes = nullptr;
  int64_t dim = 0;
  if (data_ptr_(h, &data) != 0 || dim_(h, &dim) != 0 || sizes_(h, &sizes) != 0 || dtype_(h, &out->dtype) != 0)
    return Status(Error::Internal, "cannot read a compiled output");
  out->data = data;
  out->sizes.assign(sizes, sizes + dim);
  return Status::ok_status();
}

void CompiledProgram::release(AtenTensorHandle h) const {
  if (h != nullptr) delete_tensor_(h);
}

}  // namespace offgraph_kv
