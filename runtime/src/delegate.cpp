#include "delegate.h"

#include <executorch/runtime/core/exec_aten/util/tensor_util.h>
#include <executorch/runtime/platform/log.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <new>
#include <string>
#include <vector>

#include "code_digest.h"
#include "compiled_program.h"
#include "device_memory.h"
#include "input_spec.h"
#include "kv_store.h"
#include "load_policy.h"
#include "manifest_reader.h"
#include "step_io.h"
#include "step_width.h"
#include "store_registry.h"

namespace offgraph_kv {

using executorch::aten::SizesType;
using executorch::aten::Tensor;
using executorch::runtime::ArrayRef;
using executorch::runtime::BackendExecutionContext;
using executorch::runtime::BackendInitContext;
using executorch::runtime::BackendOptionContext;
using executorch::runtime::CompileSpec;
using executorch::runtime::DelegateHandle;
using executorch::runtime::EValue;
using executorch::runtime::FreeableBuffer;
using executorch::runtime::Result;

namespace {

struct DelegateState {
  ManifestInfo manifest;
  StepWidthLocator width_at;
  std::unique_ptr<CompiledProgram> program;
  std::unique_ptr<StepIO> io;      // declared before the store: storage is freed on its stream first
  std::shared_ptr<KVStore> store;
  std::vector<TensorDesc> inputs;  // reused every step: no per-step allocation
};

// Messages quote strings read from the program (keys, specs); a Python host's
// log sink decodes them as UTF-8 and aborts the process on a bad byte, so
// anything outside printable ASCII is escaped.
std::string printable(const std::string& text) {
  static const char hex[] = "0123456789abcdef";
  std::string out;
  out.reserve(text.size());
  for (const unsigned char c : text) {
    if (c >= 0x20 && c < 0x7f) {
      out += char(c);
    } else {
      out += "\\x";
      out += hex[c >> 4];
      out += hex[c & 15];
    }
  }
  return out;
}

thread_local std::string t_last_error;

Error fail(const Status& s, const char* stage) {
  t_last_error = "OffGraphKVBackend " + std::string(stage) + ": " + printable(s.message());
  ET_LOG(Error, "%s", t_last_error.c_str());
  return s.code();
}

Status find_step_width(ArrayRef<CompileSpec> specs, StepWidthLocator* out) {
  for (const CompileSpec& spec : specs) {
    if (std::strcmp(spec.key, "step_width") == 0) {
      const std::string text(static_cast<const char*>(spec.value.buffer), spec.value.nbytes);
      return parse_step_width(text, out);
    }
  }
  return Status(Error::InvalidProgram, "compile spec step_width is missing; lower with OffGraphKVPartitioner");
}

std::unique_ptr<StepIO> io_for(DeviceKind device, Status* status) {
  if (device == DeviceKind::CPU) return host_step_io();
  return cuda_step_io(status);
}

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// Pairs prepare_step with commit or abort on every exit of execute.
class StepGuard {
 public:
  explicit StepGuard(KVStore& store) : store_(store) {}
  ~StepGuard() {
    if (!committed_) store_.abort_step();
  }
  void commit() {
    store_.commit_step();
    committed_ = true;
  }

 private:
  KVStore& store_;
  bool committed_ = false;
};

Status copy_output(StepIO& io, size_t index, const OutputView& out, EValue* value) {
  if (!value->isTensor()) return Status(Error::InvalidArgument, "output " + std::to_string(index) + " is not a tensor");
  Tensor t = value->toTensor();
  if (static_cast<int32_t>(t.scalar_type()) != out.dtype)
    return Status(Error::InvalidArgument, "output " + std::to_string(index) + ": compiled dtype " +
                                              std::to_string(out.dtype) + " differs from the method's " +
                                              std::to_string(int(t.scalar_type())));
  std::vector<SizesType> sizes(out.sizes.begin(), out.sizes.end());
  if (executorch::runtime::resize_tensor(t, {sizes.data(), sizes.size()}) != Error::Ok)
    return Status(Error::InvalidArgument, "output " + std::to_string(index) + " cannot take the compiled shape");
  return io.fetch_output(out, t.mutable_data_ptr(), t.nbytes());
}

}  // namespace

std::string last_error() { return t_last_error; }
void clear_last_error() { t_last_error.clear(); }

bool OffGraphKVDelegate::is_available() const { return true; }

Result<DelegateHandle*> OffGraphKVDelegate::init(BackendInitContext& context, FreeableBuffer* processed,
                                                 ArrayRef<CompileSpec> compile_specs) const {
  auto* raw = context.get_runtime_allocator()->allocateInstance<DelegateState>();
  if (raw == nullptr) return Error::MemoryAllocationFailed;
  // The runtime allocator owns the bytes; we own the object's lifetime.
  std::unique_ptr<DelegateState, void (*)(DelegateState*)> state(new (raw) DelegateState(),
                                                                 [](DelegateState* s) { s->~DelegateState(); });
  Status s = read_manifest(processed->data(), processed->size(), &state->manifest);
  processed->Free();
  if (!s.ok()) return fail(s, "init");
  const ManifestInfo& m = state->manifest;
  if (!(s = check_target(m.target, m.device)).ok()) return fail(s, "init");
  if (!(s = find_step_width(compile_specs, &state->width_at)).ok()) return fail(s, "init");
  if (state->width_at.input_index >= m.num_user_inputs)
    return fail(Status(Error::InvalidProgram, "compile spec step_width names input " +
                                                  std::to_string(state->width_at.input_index) + ", but the delegate has " +
                                                  std::to_string(m.num_user_inputs) + " inputs"),
                "init");
  {
    const auto& dims = m.inputs[state->width_at.input_index].dims;
    if (state->width_at.dim >= dims.size() || dims[state->width_at.dim].kind != DimKind::StepWidth)
      return fail(Status(Error::InvalidProgram,
                         "compile spec step_width names input " + std::to_string(state->width_at.input_index) +
                             " dim " + std::to_string(state->width_at.dim) +
                             ", which the manifest does not record as carrying the step width"),
                  "init");
  }

  const auto* data_map = context.get_named_data_map();
  if (data_map == nullptr)
    return fail(Status(Error::InvalidProgram, "no named data map: the compiled code cannot be found"), "init");
  Result<FreeableBuffer> code = data_map->get_data(m.compiled_code_key.c_str());
  if (!code.ok())
    return fail(Status(code.error(), "compiled code '" + m.compiled_code_key + "' is not in the program's named data"),
                "init");
  if (!(s = verify_code_digest(m.compiled_code_key, code->data(), code->size())).ok()) return fail(s, "init");
  // AOTI checks each run's inputs (dtype, sizes, strides) against what it was
  // compiled for only when this is set; the manifest that sized the arenas is
  // read from the file, so the compiled code must not trust it either.
  setenv("AOTI_RUNTIME_CHECK_INPUTS", "1", 1);
  state->program = CompiledProgram::load(code->data(), code->size(), m.compiled_code_key, m.device == DeviceKind::CUDA ? "cuda" : "cpu", &s);
  code->Free();
  if (!s.ok()) return fail(s, "init");
  const size_t expected_inputs = m.num_compiled_inputs();
  if (state->program->num_inputs() != expected_inputs || state->program->num_outputs() != m.num_outputs)
    return fail(Status(Error::InvalidProgram,
                       "manifest describes " + std::to_string(expected_inputs) + " inputs and " +
                           std::to_string(m.num_outputs) + " outputs, the compiled code has " +
                           std::to_string(state->program->num_inputs()) + " and " +
                           std::to_string(state->program->num_outputs())),
                "init");

  const GrowthPolicy policy = resolve_policy(m.defaults, context.runtime_specs());
  const std::string bad = policy.validate(m.capacity_bound);
  if (!bad.empty()) return fail(Status(Error::InvalidArgument, "load policy: " + bad), "init");
  state->io = io_for(m.device, &s);
  if (!state->io) return fail(s, "init");
  std::unique_ptr<KVStore> store = KVStore::create(m.tensors, policy, m.max_write, state->io->memory(), &s);
  if (!store) return fail(s, "init");
  state->store = std::move(store);
  register_store(state->store);
  state->inputs.resize(expected_inputs);
  // Dtype, heads and head dim of every private tensor never change: describe
  // them once; a step only rebinds the pointer and the row count.
  for (const TensorSpec& t : state->store->tensors()) {
    TensorDesc& d = state->inputs[t.compiled_input];
    d.dtype = aoti_dtype(t.dtype);
    d.sizes = {1, 0, int64_t(t.num_heads), int64_t(t.head_dim)};
    d.strides = {0, int64_t(t.num_heads) * t.head_dim, int64_t(t.head_dim), 1};
  }
  return state.release();
}

Error OffGraphKVDelegate::execute(BackendExecutionContext&, DelegateHandle* handle, Span<EValue*> args) const {
  auto* state = static_cast<DelegateState*>(handle);
  const ManifestInfo& m = state->manifest;
  if (args.size() != size_t(m.num_user_inputs) + m.num_outputs)
    return fail(Status(Error::InvalidArgument, "expected " + std::to_string(m.num_user_inputs) + " inputs and " +
                                                   std::to_string(m.num_outputs) + " outputs, got " +
                                                   std::to_string(args.size()) + " values"),
                "execute");
  // The width is the extent of the input the compile spec names: shape only.
  const StepWidthLocator& at = state->width_at;
  if (!args[at.input_index]->isTensor())
    return fail(Status(Error::InvalidArgument, "step_width input " + std::to_string(at.input_index) + " is not a tensor"),
                "execute");
  const Tensor width_input = args[at.input_index]->toTensor();
  if (at.dim >= size_t(width_input.dim()))
    return fail(Status(Error::InvalidArgument, "step_width names dim " + std::to_string(at.dim) + " of input " +
                                                   std::to_string(at.input_index) + ", which has " +
                                                   std::to_string(width_input.dim()) + " dims"),
                "execute");
  const size_t width = size_t(width_input.size(at.dim));
  if (width < 1 || width > m.max_write)
    return fail(Status(Error::InvalidArgument, "step width " + std::to_string(width) + " (input " +
                                                   std::to_string(at.input_index) + " dim " + std::to_string(at.dim) +
                                                   ") outside [1, max_write=" + std::to_string(m.max_write) + "]"),
                "execute");
  // Every input as compiled, before anything is grown or bound: the compiled
  // code trusts the shapes it is handed.
  for (size_t i = 0; i < m.num_user_inputs; ++i) {
    if (!args[i]->isTensor())
      return fail(Status(Error::InvalidArgument, "input " + std::to_string(i) + " is not a tensor"), "execute");
    const Tensor t = args[i]->toTensor();
    Status c = check_input(i, m.inputs[i], int(t.scalar_type()), t.sizes().data(), size_t(t.dim()), width);
    if (!c.ok()) return fail(c, "execute");
  }

  const int64_t host_start = now_ns();
  KVStore& store = *state->store;
  StepIO& io = *state->io;
  Status s = store.prepare_step(width);
  if (!s.ok()) return fail(s, "execute");
  StepGuard step(store);

  for (size_t i = 0; i < m.num_user_inputs; ++i) {
    if (!(s = io.stage_input(i, args[i]->toTensor(), &state->inputs[i])).ok()) return fail(s, "execute");
  }
  const auto& tensors = store.tensors();
  for (size_t i = 0; i < tensors.size(); ++i) {
    const Binding b = store.binding(i);
    TensorDesc& d = state->inputs[tensors[i].compiled_input];
    d.data = b.data;
    d.sizes[1] = b.rows;
    d.strides[0] = b.rows * d.strides[1];
  }
  if (m.has_length_input && !(s = io.stage_length(int64_t(store.length()), &state->inputs[m.length_input])).ok())
    return fail(s, "execute");
  const int64_t run_start = now_ns();
  s = state->program->run(
      state->inputs, io.stream(),
      [&](size_t i, const OutputView& out) { return copy_output(io, i, out, args[m.num_user_inputs + i]); },
      [&]() { return io.finish(); });
  const int64_t run_end = now_ns();
  if (!s.ok()) return fail(s, "execute");
  step.commit();
  // Host work of the step, apart from the compiled code and its output copy.
  store.record_host_time(uint64_t((run_start - host_start) + (now_ns() - run_end)));
  return Error::Ok;
}

void OffGraphKVDelegate::destroy(DelegateHandle* handle) const {
  if (handle != nullptr) static_cast<DelegateState*>(handle)->~DelegateState();
}

Error OffGraphKVDelegate::set_option(BackendOptionContext&, const Span<BackendOption>& options) {
  Status s = apply_options(options);
  return s.ok() ? Error::Ok : fail(s, "set_option");
}

Error OffGraphKVDelegate::get_option(BackendOptionContext&, Span<BackendOption>& options) {
  Status s = read_options(options);
  return s.ok() ? Error::Ok : fail(s, "get_option");
}

Error register_delegate() {
  static OffGraphKVDelegate delegate;
  static executorch::runtime::Backend entry{kBackendName, &delegate};
  static Error result = executorch::runtime::register_backend(entry);
  return result;
}

}  // namespace offgraph_kv
