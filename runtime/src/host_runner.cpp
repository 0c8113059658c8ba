#include "host_runner.h"

#include <executorch/extension/tensor/tensor.h>
#include <executorch/runtime/core/exec_aten/util/scalar_type_util.h>

#include <chrono>
#include <cstring>
#include <utility>

#include "store_registry.h"

namespace offgraph_kv {
namespace {

using executorch::aten::ScalarType;
using executorch::runtime::EValue;

struct DTypeName {
  const char* name;
  ScalarType type;
};
constexpr DTypeName kDTypes[] = {
    {"float32", ScalarType::Float}, {"float16", ScalarType::Half},  {"bfloat16", ScalarType::BFloat16},
    {"int64", ScalarType::Long},    {"int32", ScalarType::Int},     {"bool", ScalarType::Bool},
    {"uint8", ScalarType::Byte},    {"float64", ScalarType::Double},
};

bool scalar_type_of(const std::string& name, ScalarType* out) {
  for (const DTypeName& d : kDTypes)
    if (name == d.name) {
      *out = d.type;
      return true;
    }
  return false;
}

const char* name_of(ScalarType type) {
  for (const DTypeName& d : kDTypes)
    if (d.type == type) return d.name;
  return nullptr;
}

size_t elements_of(const std::vector<int64_t>& sizes) {
  size_t n = 1;
  for (int64_t d : sizes) n *= d < 0 ? 0 : size_t(d);
  return n;
}

// Index of the largest of `n` values of `type` at `data` (the first one on ties, as torch.argmax).
template <typename T>
size_t argmax_of(const T* data, size_t n) {
  size_t best = 0;
  float top = float(data[0]);
  for (size_t i = 1; i < n; ++i) {
    const float v = float(data[i]);
    if (v > top) {
      top = v;
      best = i;
    }
  }
  return best;
}

// The argmax of the last row of `logits`, whose element type the method's metadata gave (checked before the loop).
size_t argmax_last_row(const HostTensor& logits, ScalarType type) {
  const size_t vocab = size_t(logits.sizes.back());
  const size_t rows = logits.nbytes / (vocab * executorch::runtime::elementSize(type));
  const size_t last = (rows - 1) * vocab;
  switch (type) {
    case ScalarType::BFloat16:
      return argmax_of(static_cast<const executorch::aten::BFloat16*>(logits.data) + last, vocab);
    case ScalarType::Half:
      return argmax_of(static_cast<const executorch::aten::Half*>(logits.data) + last, vocab);
    default:
      return argmax_of(static_cast<const float*>(logits.data) + last, vocab);
  }
}

std::string error_text(const char* what, executorch::runtime::Error e) {
  return std::string(what) + " failed with ExecuTorch error " + std::to_string(int(e)) + " (the log above says why)";
}

}  // namespace

using executorch::extension::module::Module;

HostRunner::HostRunner(std::shared_ptr<Module> module, std::string method, std::shared_ptr<Module> origin)
    : module_(std::move(module)), origin_(std::move(origin)), method_(std::move(method)) {}

Status HostRunner::load_method() {
  take_last_store_on_this_thread();  // forget a store of an earlier load on this thread
  auto e = module_->load_method(method_);
  if (e != executorch::runtime::Error::Ok)
    return Status(e, error_text(("loading method '" + method_ + "'").c_str(), e));
  store_ = take_last_store_on_this_thread();
  return Status::ok_status();
}

std::unique_ptr<HostRunner> HostRunner::load(const std::string& path, const std::string& method, Status* status) {
  auto module = std::make_shared<Module>(path, Module::LoadMode::Mmap);
  std::unique_ptr<HostRunner> runner(new HostRunner(module, method, module));
  // Verify the program's own FlatBuffer: a corrupt one must be an error here, not a crash in Init.
  auto e = module->load(executorch::runtime::Program::Verification::InternalConsistency);
  if (e != executorch::runtime::Error::Ok) {
    *status = Status(e, error_text(("loading program " + path).c_str(), e));
    return nullptr;
  }
  *status = runner->load_method();
  if (!status->ok()) return nullptr;
  return runner;
}

std::unique_ptr<HostRunner> HostRunner::new_session(Status* status) const {
  auto module = std::make_shared<Module>(module_->program());
  std::unique_ptr<HostRunner> runner(new HostRunner(std::move(module), method_, origin_));
  *status = runner->load_method();
  if (!status->ok()) return nullptr;
  return runner;
}

Status HostRunner::wrap_inputs(const std::vector<HostTensor>& inputs, WrappedInputs* wrapped) {
  // Module::execute keeps the previous call's value of any input not given; refuse instead.
  auto meta = module_->method_meta(method_);
  if (!meta.ok()) return Status(meta.error(), error_text(("reading method '" + method_ + "'").c_str(), meta.error()));
  if (inputs.size() != meta->num_inputs())
    return Status(Error::InvalidArgument, "method '" + method_ + "' takes " + std::to_string(meta->num_inputs()) +
                                              " inputs, got " + std::to_string(inputs.size()));
  wrapped->owned.clear();
  wrapped->values.clear();
  wrapped->owned.reserve(inputs.size());
  for (size_t i = 0; i < inputs.size(); ++i) {
    const HostTensor& in = inputs[i];
    ScalarType type;
    if (!scalar_type_of(in.dtype, &type))
      return Status(Error::InvalidArgument, "input " + std::to_string(i) + ": unsupported dtype '" + in.dtype + "'");
    std::vector<executorch::aten::SizesType> sizes(in.sizes.begin(), in.sizes.end());
    wrapped->owned.push_back(executorch::extension::from_blob(const_cast<void*>(in.data), std::move(sizes), type));
    wrapped->values.emplace_back(*wrapped->owned.back());
  }
  return Status::ok_status();
}

Status HostRunner::execute_wrapped(const WrappedInputs& wrapped, std::vector<HostTensor>* outputs) {
  auto result = module_->execute(method_, wrapped.values);
  if (!result.ok()) return Status(result.error(), error_text(("executing '" + method_ + "'").c_str(), result.error()));
  last_outputs_ = std::move(result.get());
  outputs->clear();
  for (size_t i = 0; i < last_outputs_.size(); ++i) {
    if (!last_outputs_[i].isTensor())
      return Status(Error::NotSupported, "output " + std::to_string(i) + " is not a tensor");
    const executorch::aten::Tensor t = last_outputs_[i].toTensor();
    const char* name = name_of(t.scalar_type());
    if (name == nullptr)
      return Status(Error::NotSupported, "output " + std::to_string(i) + " has an unsupported dtype");
    HostTensor out;
    out.dtype = name;
    out.sizes.assign(t.sizes().begin(), t.sizes().end());
    out.data = t.const_data_ptr();
    out.nbytes = t.nbytes();
    outputs->push_back(std::move(out));
  }
  return Status::ok_status();
}

Status HostRunner::run(const std::vector<HostTensor>& inputs, std::vector<HostTensor>* outputs) {
  WrappedInputs wrapped;  // alive until execute returns
  Status s = wrap_inputs(inputs, &wrapped);
  return s.ok() ? execute_wrapped(wrapped, outputs) : s;
}

Status HostRunner::decode_greedy(const GreedyRequest& req, GreedyResult* result) {
  result->tokens.clear();
  result->step_ns.clear();
  const size_t n = req.inputs.size();
  if (req.token_input >= n || req.position_input >= n || req.token_input == req.position_input)
    return Status(Error::InvalidArgument, "token_input " + std::to_string(req.token_input) + " and position_input " +
                                              std::to_string(req.position_input) + " must be two of the " +
                                              std::to_string(n) + " inputs");
  const HostTensor& tok = req.inputs[req.token_input];
  const HostTensor& pos = req.inputs[req.position_input];
  const size_t tok_elements = elements_of(tok.sizes), pos_elements = elements_of(pos.sizes);
  if (tok.dtype != "int64" || tok_elements != 1)
    return Status(Error::InvalidArgument, "token input " + std::to_string(req.token_input) +
                                              ": expected one int64 token id (a width-1 step), got " +
                                              std::to_string(tok_elements) + " " + tok.dtype + " values");
  if (pos.dtype != "int64" || pos_elements == 0)
    return Status(Error::InvalidArgument, "position input " + std::to_string(req.position_input) +
                                              ": expected int64 positions, got " + std::to_string(pos_elements) + " " +
                                              pos.dtype + " values");
  // The logits output is checked before any step runs: a bad request must not advance the cache.
  auto meta = module_->method_meta(method_);
  if (!meta.ok()) return Status(meta.error(), error_text(("reading method '" + method_ + "'").c_str(), meta.error()));
  if (req.logits_output >= meta->num_outputs())
    return Status(Error::InvalidArgument, "logits_output " + std::to_string(req.logits_output) + ": the method has " +
                                              std::to_string(meta->num_outputs()) + " outputs");
  auto out_meta = meta->output_tensor_meta(req.logits_output);
  const ScalarType out_type = out_meta.ok() ? out_meta->scalar_type() : ScalarType::Undefined;
  if (out_type != ScalarType::Float && out_type != ScalarType::BFloat16 && out_type != ScalarType::Half)
    return Status(Error::InvalidArgument, "output " + std::to_string(req.logits_output) +
                                              " is not floating-point logits (float32, bfloat16 or float16)");
  // The loop owns its token and positions; every other input stays the caller's.
  int64_t token = 0;
  std::memcpy(&token, tok.data, sizeof(token));
  std::vector<int64_t> positions(pos_elements);
  std::memcpy(positions.data(), pos.data, pos_elements * sizeof(int64_t));
  std::vector<HostTensor> inputs = req.inputs;
  inputs[req.token_input].data = &token;
  inputs[req.position_input].data = positions.data();
  // Wrapped once: every step reads the token and positions where the loop updates them.
  WrappedInputs wrapped;
  Status wrap = wrap_inputs(inputs, &wrapped);
  if (!wrap.ok()) return wrap;
  std::vector<HostTensor> outputs;
  // (No reserve of `steps` entries: a request far past any capacity ends at its first failed step.)
  for (size_t step = 0; step < req.steps; ++step) {
    const auto start = std::chrono::steady_clock::now();
    Status s = execute_wrapped(wrapped, &outputs);
    if (!s.ok()) return s;
    const HostTensor& logits = outputs[req.logits_output];
    if (logits.sizes.empty() || logits.sizes.back() <= 0 || logits.nbytes == 0)
      return Status(Error::InvalidArgument, "output " + std::to_string(req.logits_output) + " holds no logits");
    token = int64_t(argmax_last_row(logits, out_type));
    for (int64_t& p : positions) ++p;
    result->tokens.push_back(token);
    result->step_ns.push_back(
        std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - start).count());
    for (int64_t stop : req.stop_ids)
      if (token == stop) return Status::ok_status();
  }
  return Status::ok_status();
}

}  // namespace offgraph_kv
