#include "host_runner.h"

#include <executorch/extension/tensor/tensor.h>

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

Status HostRunner::run(const std::vector<HostTensor>& inputs, std::vector<HostTensor>* outputs) {
  // Module::execute keeps the previous call's value of any input not given; refuse instead.
  auto meta = module_->method_meta(method_);
  if (!meta.ok()) return Status(meta.error(), error_text(("reading method '" + method_ + "'").c_str(), meta.error()));
  if (inputs.size() != meta->num_inputs())
    return Status(Error::InvalidArgument, "method '" + method_ + "' takes " + std::to_string(meta->num_inputs()) +
                                              " inputs, got " + std::to_string(inputs.size()));
  std::vector<executorch::extension::TensorPtr> owned;  // alive until execute returns
  std::vector<EValue> values;
  owned.reserve(inputs.size());
  for (size_t i = 0; i < inputs.size(); ++i) {
    const HostTensor& in = inputs[i];
    ScalarType type;
    if (!scalar_type_of(in.dtype, &type))
      return Status(Error::InvalidArgument, "input " + std::to_string(i) + ": unsupported dtype '" + in.dtype + "'");
    std::vector<executorch::aten::SizesType> sizes(in.sizes.begin(), in.sizes.end());
    owned.push_back(executorch::extension::from_blob(const_cast<void*>(in.data), std::move(sizes), type));
    values.emplace_back(*owned.back());
  }
  auto result = module_->execute(method_, values);
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

}  // namespace offgraph_kv
