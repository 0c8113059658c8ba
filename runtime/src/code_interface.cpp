#include "code_interface.h"

#include <string>

#include "compiled_program.h"
#include "input_spec.h"
#include "manifest_generated.h"
#include "manifest_reader.h"

namespace offgraph_kv {

namespace fb = offgraph_kv::schema;

namespace {

Status mismatch(const std::string& what) {
  return Status(Error::InvalidProgram, "manifest does not match the compiled code: " + what);
}

std::string sizes_text(const std::vector<int64_t>& sizes) {
  std::string out = "[";
  for (size_t i = 0; i < sizes.size(); ++i) {
    if (i) out += ", ";
    out += sizes[i] < 0 ? std::string("*") : std::to_string(sizes[i]);
  }
  return out + "]";
}

std::string dtype_text(int32_t code) { return scalar_type_name(code); }

// One delegate input: same dtype and rank; a static extent must be compiled
// static; a width or dynamic dim must be a run-time extent (a static-width
// export compiles the width as the one extent max_write allows).
Status check_user_input(size_t i, const InputSpec& spec, const CompiledInterfaceInfo::Input& code,
                        uint32_t max_write) {
  const std::string where = "delegate input " + std::to_string(i) + ": manifest says ";
  if (spec.dtype != code.dtype)
    return mismatch(where + dtype_text(spec.dtype) + ", the code takes " + dtype_text(code.dtype));
  if (spec.dims.size() != code.sizes.size())
    return mismatch(where + "rank " + std::to_string(spec.dims.size()) + ", the code takes " + sizes_text(code.sizes));
  for (size_t d = 0; d < spec.dims.size(); ++d) {
    const InputDim& dim = spec.dims[d];
    const int64_t compiled = code.sizes[d];
    bool ok = false;
    switch (dim.kind) {
      case DimKind::Static: ok = compiled == dim.extent; break;
      case DimKind::StepWidth: ok = compiled < 0 || (compiled == int64_t(max_write)); break;
      case DimKind::Dynamic: ok = compiled < 0; break;
    }
    if (!ok) {
      const std::string said = dim.kind == DimKind::Static ? "extent " + std::to_string(dim.extent)
                               : dim.kind == DimKind::StepWidth ? std::string("the step width")
                                                                : std::string("a run-time extent");
      return mismatch(where + "dim " + std::to_string(d) + " is " + said + ", the code takes " +
                      sizes_text(code.sizes));
    }
  }
  return Status::ok_status();
}

}  // namespace

Status read_compiled_interface(const uint8_t* data, size_t size, CompiledInterfaceInfo* out) {
  if (data == nullptr || size == 0)
    return Status(Error::InvalidProgram, "manifest: compiled_interface is missing (re-export with this version)");
  flatbuffers::Verifier verifier(data, size);
  if (!verifier.VerifyBuffer<fb::CompiledInterface>(nullptr))
    return Status(Error::InvalidProgram, "manifest: compiled_interface is a corrupt or truncated FlatBuffer");
  const fb::CompiledInterface* code = flatbuffers::GetRoot<fb::CompiledInterface>(data);
  if (code->inputs()->size() > 65536)
    return Status(Error::InvalidProgram, "manifest: compiled_interface lists " +
                                             std::to_string(code->inputs()->size()) + " inputs (at most 65536)");
  out->inputs.clear();
  for (uint32_t i = 0; i < code->inputs()->size(); ++i) {
    const fb::CompiledInput* in = code->inputs()->Get(i);
    CompiledInterfaceInfo::Input input;
    input.dtype = in->dtype();
    if (in->sizes()->size() > 16)
      return Status(Error::InvalidProgram, "manifest: compiled input " + std::to_string(i) + " has rank " +
                                               std::to_string(in->sizes()->size()) + " (at most 16)");
    for (const int64_t s : *in->sizes()) {
      if (s < -1) return Status(Error::InvalidProgram, "manifest: compiled input " + std::to_string(i) +
                                                           " has extent " + std::to_string(s));
      input.sizes.push_back(s);
    }
    out->inputs.push_back(std::move(input));
  }
  out->num_outputs = code->num_outputs();
  out->width_bound = code->width_bound();
  out->weights_in_code = code->weights_in_code();
  out->lengths_from_device = code->lengths_from_device();
  out->ring_windows.clear();
  if (const auto* windows = code->ring_windows()) out->ring_windows.assign(windows->begin(), windows->end());
  return Status::ok_status();
}

Status check_manifest_against_code(const ManifestInfo& m) {
  const CompiledInterfaceInfo& code = m.code;
  if (code.inputs.size() != m.num_compiled_inputs())
    return mismatch("it describes " + std::to_string(m.num_compiled_inputs()) + " compiled inputs, the code takes " +
                    std::to_string(code.inputs.size()));
  if (code.num_outputs != m.num_outputs)
    return mismatch("num_outputs is " + std::to_string(m.num_outputs) + ", the code returns " +
                    std::to_string(code.num_outputs));
  if (m.width_bound != code.width_bound)
    return mismatch("width_bound is " + std::to_string(m.width_bound) + ", the code was compiled for " +
                    std::to_string(code.width_bound));
  if (m.max_write > code.width_bound)
    return mismatch("max_write " + std::to_string(m.max_write) + " exceeds the code's width bound " +
                    std::to_string(code.width_bound));
  for (size_t i = 0; i < m.inputs.size(); ++i) {
    Status s = check_user_input(i, m.inputs[i], code.inputs[i], m.max_write);
    if (!s.ok()) return s;
  }
  for (size_t i = 0; i < m.tensors.size(); ++i) {
    const TensorSpec& t = m.tensors[i];
    if (!code.ring_windows.empty()) {
      const uint32_t window = t.kind == LayerKind::Ring ? t.window : 0;
      if (t.layer >= code.ring_windows.size())
        return mismatch("tensor " + std::to_string(i) + " is of layer " + std::to_string(t.layer) + ", the code has " +
                        std::to_string(code.ring_windows.size()) + " layers");
      if (code.ring_windows[t.layer] != window)
        return mismatch("layer " + std::to_string(t.layer) + " is " +
                        (window ? "a ring of window " + std::to_string(window) : std::string("flat")) +
                        ", the code attends it " +
                        (code.ring_windows[t.layer] ? "as a ring of window " + std::to_string(code.ring_windows[t.layer])
                                                    : std::string("as a flat layer")));
    }
    const CompiledInterfaceInfo::Input& in = code.inputs[t.compiled_input];
    const std::vector<int64_t> want = {1, -1, int64_t(t.num_heads), int64_t(t.head_dim)};
    if (in.dtype != aoti_dtype(t.dtype) || in.sizes != want)
      return mismatch("tensor " + std::to_string(i) + " (layer " + std::to_string(t.layer) +
                      (t.role == TensorRole::Key ? " K" : " V") + ") is " + dtype_text(aoti_dtype(t.dtype)) + " " +
                      sizes_text(want) + " at compiled input " + std::to_string(t.compiled_input) +
                      ", the code takes " + dtype_text(in.dtype) + " " + sizes_text(in.sizes) + " there");
  }
  if (m.has_length_input) {
    const CompiledInterfaceInfo::Input& in = code.inputs[m.length_input];
    if (in.dtype != int32_t(AotiDType::Int64) || in.sizes != std::vector<int64_t>{1})
      return mismatch("length_input " + std::to_string(m.length_input) + " is a Long [1], the code takes " +
                      dtype_text(in.dtype) + " " + sizes_text(in.sizes) + " there");
  }
  if (code.weights_in_code && !m.weights.empty())
    return mismatch("it lists " + std::to_string(m.weights.size()) +
                    " weights to bind, but the code packages its own constants");
  return Status::ok_status();
}

}  // namespace offgraph_kv
