#include "delegate.h"

#include <executorch/runtime/platform/log.h>

#include <cstdlib>
#include <cstring>
#include <memory>
#include <new>
#include <string>

#include "backend_options.h"
#include "code_digest.h"
#include "compiled_program.h"
#include "executor.h"
#include "input_spec.h"
#include "manifest_reader.h"
#include "step_width.h"
#include "store_registry.h"
#include "weights.h"

namespace offgraph_kv {

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
  // One session: its own container (in the executor) and KV store; the
  // weights' memory is shared with the program's other sessions (weights.h).
  std::unique_ptr<BoundWeights> weights;  // declared before the executor: freed after the container that reads it
  std::unique_ptr<StepExecutor> executor;
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

// The locator must name a dim the manifest records as carrying the width.
Status check_step_width(const ManifestInfo& m, const StepWidthLocator& at) {
  if (at.input_index >= m.num_user_inputs)
    return Status(Error::InvalidProgram, "compile spec step_width names input " + std::to_string(at.input_index) +
                                             ", but the delegate has " + std::to_string(m.num_user_inputs) + " inputs");
  const auto& dims = m.inputs[at.input_index].dims;
  if (at.dim >= dims.size() || dims[at.dim].kind != DimKind::StepWidth)
    return Status(Error::InvalidProgram, "compile spec step_width names input " + std::to_string(at.input_index) +
                                             " dim " + std::to_string(at.dim) +
                                             ", which the manifest does not record as carrying the step width");
  return Status::ok_status();
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
  ManifestInfo m;
  Status s = read_manifest(processed->data(), processed->size(), &m);
  processed->Free();
  if (!s.ok()) return fail(s, "init");
  if (!(s = check_target(m.target, m.device)).ok()) return fail(s, "init");
  StepWidthLocator width_at;
  if (!(s = find_step_width(compile_specs, &width_at)).ok()) return fail(s, "init");
  if (!(s = check_step_width(m, width_at)).ok()) return fail(s, "init");

  const auto* data_map = context.get_named_data_map();
  if (data_map == nullptr)
    return fail(Status(Error::InvalidProgram, "no named data map: the compiled code cannot be found"), "init");
  Result<FreeableBuffer> code = data_map->get_data(m.compiled_code_key.c_str());
  if (!code.ok())
    return fail(Status(code.error(), "compiled code '" + m.compiled_code_key + "' is not in the program's named data"),
                "init");
  if (!(s = verify_code_digest(m.compiled_code_key, code->data(), code->size(), m.code_interface_bytes)).ok()) return fail(s, "init");
  // AOTI checks each run's inputs (dtype, sizes, strides) against what it was
  // compiled for only when this is set: a second line behind the load-time
  // check of the manifest against the code. The compiled code reads it once per
  // process, so opting out (OFFGRAPH_KV_AOTI_INPUT_CHECKS=0, for measuring
  // their cost) is per process, not per load.
  const char* opt_out = std::getenv("OFFGRAPH_KV_AOTI_INPUT_CHECKS");
  setenv("AOTI_RUNTIME_CHECK_INPUTS", opt_out != nullptr && std::strcmp(opt_out, "0") == 0 ? "0" : "1", 1);
  std::unique_ptr<CompiledProgram> program = CompiledProgram::load(
      code->data(), code->size(), m.compiled_code_key, m.device == DeviceKind::CUDA ? "cuda" : "cpu", &s);
  code->Free();
  if (!program) return fail(s, "init");
  const size_t expected_inputs = m.num_compiled_inputs();
  if (program->num_inputs() != expected_inputs || program->num_outputs() != m.num_outputs)
    return fail(Status(Error::InvalidProgram,
                       "manifest describes " + std::to_string(expected_inputs) + " inputs and " +
                           std::to_string(m.num_outputs) + " outputs, the compiled code has " +
                           std::to_string(program->num_inputs()) + " and " + std::to_string(program->num_outputs())),
                "init");
  // Weights kept outside the code (weights.h): checked against the code, then
  // bound; the first session of this program in the process reads and checks
  // the bytes, later ones share them.
  if (m.weights_outside_code()) {
    state->weights =
        BoundWeights::bind(*program, m.compiled_code_key, m.weights, *data_map, m.device == DeviceKind::CUDA, &s);
    if (!state->weights) return fail(s, "init");
  }

  if (!(s = check_runtime_specs(context.runtime_specs())).ok()) return fail(s, "init");
  const GrowthPolicy policy = resolve_policy(m.defaults, context.runtime_specs());
  const std::string bad = policy.validate(m.capacity_bound);
  if (!bad.empty()) return fail(Status(Error::InvalidArgument, "load policy: " + bad), "init");
  state->executor = StepExecutor::create(m, width_at, std::move(program), policy, &s);
  if (!state->executor) return fail(s, "init");
  register_store(state->executor->store());
  return state.release();
}

Error OffGraphKVDelegate::execute(BackendExecutionContext&, DelegateHandle* handle, Span<EValue*> args) const {
  Status s = static_cast<DelegateState*>(handle)->executor->execute(args);
  return s.ok() ? Error::Ok : fail(s, "execute");
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
