#include "manifest_reader.h"

#include <algorithm>
#include <set>

#include "manifest_generated.h"

namespace offgraph_kv {

namespace fb = offgraph_kv::schema;

namespace {
Status invalid(const std::string& what) {
  return Status(Error::InvalidProgram, "manifest: " + what);
}
}  // namespace

Status read_manifest(const void* data, size_t size, ManifestInfo* out) {
  if (data == nullptr || size < 8) return invalid("truncated (" + std::to_string(size) + " bytes)");
  const auto* bytes = static_cast<const uint8_t*>(data);
  if (!fb::ManifestBufferHasIdentifier(bytes))
    return invalid("missing the 'OGKV' file identifier; not an offgraph-kv manifest");
  flatbuffers::Verifier verifier(bytes, size);
  // Also rejects a manifest missing a required field (target, code key, tensors).
  if (!fb::VerifyManifestBuffer(verifier))
    return invalid("corrupt or truncated FlatBuffer, or a required field is missing");
  const fb::Manifest* m = fb::GetManifest(bytes);
  if (m->version() < kOldestManifestVersion || m->version() > kManifestVersion)
    return invalid("version " + std::to_string(m->version()) + " is not supported (this runtime reads version " +
                   std::to_string(kManifestVersion) + ")");
  if (m->layout() != fb::Layout::SequenceMajor) return invalid("unknown layout " + std::to_string(int(m->layout())));
  if (m->device() != fb::Device::CPU && m->device() != fb::Device::CUDA)
    return invalid("unknown device " + std::to_string(int(m->device())));
  if (m->batch() != 1) return invalid("batch " + std::to_string(m->batch()) + " is not supported (expected 1)");
  if (m->max_write() == 0) return invalid("max_write is 0");
  if (m->capacity_bound() == 0) return invalid("capacity_bound is 0");
  // Bounds no real program reaches; past them sizes overflow or allocate absurdly.
  if (m->capacity_bound() > (uint64_t(1) << 32))
    return invalid("capacity_bound " + std::to_string(m->capacity_bound()) + " above 2^32 rows");
  if (m->max_write() > m->capacity_bound())
    return invalid("max_write " + std::to_string(m->max_write()) + " above capacity_bound " +
                   std::to_string(m->capacity_bound()));
  if (m->tensors()->size() == 0) return invalid("no private tensors");

  out->version = m->version();
  out->device = m->device() == fb::Device::CUDA ? DeviceKind::CUDA : DeviceKind::CPU;
  out->target = m->target()->str();
  out->batch = m->batch();
  out->num_user_inputs = m->num_user_inputs();
  out->num_outputs = m->num_outputs();
  out->max_write = m->max_write();
  out->capacity_bound = m->capacity_bound();
  out->defaults.initial_capacity = m->initial_capacity();
  out->defaults.max_capacity = m->max_capacity();
  out->defaults.growth_factor = m->growth_factor();
  out->defaults.rewind_budget = m->rewind_budget();
  out->compiled_code_key = m->compiled_code_key()->str();
  out->tensors.clear();

  // Version 2 on: every delegate input as compiled, checked before each step.
  if (m->inputs() == nullptr) return invalid("inputs is missing (re-export with this version)");
  if (m->inputs()->size() != out->num_user_inputs)
    return invalid("inputs describes " + std::to_string(m->inputs()->size()) + " delegate inputs, num_user_inputs is " +
                   std::to_string(out->num_user_inputs));
  out->width_bound = m->width_bound();
  if (out->max_write > out->width_bound)
    return invalid("max_write " + std::to_string(out->max_write) + " exceeds the step width's export bound " +
                   std::to_string(out->width_bound));
  out->inputs.clear();
  bool any_width = false;
  for (uint32_t i = 0; i < m->inputs()->size(); ++i) {
    const fb::UserInput* u = m->inputs()->Get(i);
    const std::string where = "input " + std::to_string(i);
    if (u->dims()->size() > 16) return invalid(where + ": rank " + std::to_string(u->dims()->size()) + " above 16");
    InputSpec spec;
    spec.dtype = u->dtype();
    for (uint32_t d = 0; d < u->dims()->size(); ++d) {
      const fb::InputDim* dim = u->dims()->Get(d);
      if (dim->kind() != fb::DimKind::Static && dim->kind() != fb::DimKind::StepWidth &&
          dim->kind() != fb::DimKind::Dynamic)
        return invalid(where + " dim " + std::to_string(d) + ": unknown kind " + std::to_string(int(dim->kind())));
      if (dim->extent() < 0 || dim->extent() > (int64_t(1) << 40))
        return invalid(where + " dim " + std::to_string(d) + ": extent " + std::to_string(dim->extent()) +
                       " out of range");
      spec.dims.push_back({static_cast<DimKind>(dim->kind()), dim->extent()});
      any_width = any_width || dim->kind() == fb::DimKind::StepWidth;
    }
    out->inputs.push_back(std::move(spec));
  }
  if (!any_width) return invalid("no delegate input dim carries the step width");

  std::set<uint32_t> inputs;
  out->has_length_input = m->has_length_input();
  out->length_input = m->length_input();
  const uint32_t num_inputs = out->num_user_inputs + m->tensors()->size() + (out->has_length_input ? 1 : 0);
  if (out->has_length_input) {
    if (out->length_input < out->num_user_inputs || out->length_input >= num_inputs)
      return invalid("length_input " + std::to_string(out->length_input) + " outside the private inputs");
    inputs.insert(out->length_input);
  }
  for (uint32_t i = 0; i < m->tensors()->size(); ++i) {
    const fb::PrivateTensor* p = m->tensors()->Get(i);
    const std::string where = "tensor " + std::to_string(i) + " (layer " + std::to_string(p->layer()) + ")";
    if (!is_supported(int(p->storage_dtype())))
      return invalid(where + ": storage dtype " + std::to_string(int(p->storage_dtype())) +
                     " is not supported by this build (fp32, fp16, bf16)");
    if (p->kind() != fb::LayerKind::Flat && p->kind() != fb::LayerKind::Ring)
      return invalid(where + ": unknown layer kind " + std::to_string(int(p->kind())));
    if (p->role() != fb::TensorRole::Key && p->role() != fb::TensorRole::Value)
      return invalid(where + ": unknown role " + std::to_string(int(p->role())));
    if (p->kind() == fb::LayerKind::Ring && p->window() == 0) return invalid(where + ": ring with window 0");
    if (p->kind() == fb::LayerKind::Flat && p->window() != 0) return invalid(where + ": flat layer with a window");
    if (p->num_heads() == 0 || p->head_dim() == 0) return invalid(where + ": zero heads or head dim");
    // Far above any real model; past them a row's size is nonsense and allocations absurd.
    if (p->num_heads() > 1024 || p->head_dim() > 4096)
      return invalid(where + ": " + std::to_string(p->num_heads()) + " heads x " + std::to_string(p->head_dim()) +
                     " head dim is out of range (at most 1024 x 4096)");
    if (p->window() > m->capacity_bound())
      return invalid(where + ": window " + std::to_string(p->window()) + " above capacity_bound");
    if (p->compiled_input() < out->num_user_inputs || p->compiled_input() >= num_inputs)
      return invalid(where + ": compiled_input " + std::to_string(p->compiled_input()) + " outside [" +
                     std::to_string(out->num_user_inputs) + ", " + std::to_string(num_inputs) + ")");
    if (!inputs.insert(p->compiled_input()).second)
      return invalid(where + ": compiled_input " + std::to_string(p->compiled_input()) + " bound twice");
    TensorSpec t;
    t.layer = p->layer();
    t.role = p->role() == fb::TensorRole::Key ? TensorRole::Key : TensorRole::Value;
    t.kind = p->kind() == fb::LayerKind::Ring ? LayerKind::Ring : LayerKind::Flat;
    t.window = p->window();
    t.num_heads = p->num_heads();
    t.head_dim = p->head_dim();
    t.dtype = static_cast<StorageDType>(p->storage_dtype());
    t.compiled_input = p->compiled_input();
    if (!out->tensors.empty() && t.dtype != out->tensors.front().dtype)
      return invalid(where + ": mixed storage dtypes in one store");
    if (t.kind == LayerKind::Ring && !out->has_length_input)
      return invalid(where + ": a ring layer needs the length input, which the manifest lacks");
    out->tensors.push_back(t);
  }
  Status s = read_weight_specs(m, &out->weights);
  if (!s.ok()) return s;
  const auto* interface = m->compiled_interface();
  out->code_interface_bytes.clear();
  if (interface != nullptr) out->code_interface_bytes.assign(interface->data(), interface->data() + interface->size());
  s = read_compiled_interface(out->code_interface_bytes.data(), out->code_interface_bytes.size(), &out->code);
  if (!s.ok()) return s;
  return check_manifest_against_code(*out);
}

Status check_target(const std::string& target, DeviceKind device) {
  // Parsed strictly: an unknown target must not skip the check below.
  const std::string expected = device == DeviceKind::CUDA ? "cuda:" : "cpu:";
  if (target.compare(0, expected.size(), expected) != 0)
    return Status(Error::InvalidProgram, "manifest: target '" + target + "' does not name the manifest's device ('" +
                                             expected + "...' expected)");
  const std::string isa = target.substr(expected.size());
  if (device == DeviceKind::CUDA) {
    const bool sm = isa.size() > 3 && isa.compare(0, 3, "sm_") == 0 &&
                    isa.find_first_not_of("0123456789", 3) == std::string::npos && isa.size() <= 6;
    if (!sm) return Status(Error::InvalidProgram, "manifest: target '" + target + "' is not 'cuda:sm_<digits>'");
    return Status::ok_status();
  }
  // inductor names the ISA as a base ("avx512") plus extensions ("avx512_vnni", "amx_tile").
  std::vector<std::string> parts;
  for (size_t at = 0; at <= isa.size();) {
    const size_t end = std::min(isa.find(' ', at), isa.size());
    parts.push_back(isa.substr(at, end - at));
    at = end + 1;
  }
  static const std::set<std::string> bases = {"avx512", "avx2", "scalar", "asimd", "neon", "vsx", "zvector"};
  static const std::set<std::string> extensions = {"avx512_vnni", "amx_tile"};
  if (!bases.count(parts[0])) return Status(Error::InvalidProgram, "manifest: target '" + target + "': unknown CPU vector ISA");
  for (size_t i = 1; i < parts.size(); ++i)
    if (!extensions.count(parts[i]))
      return Status(Error::InvalidProgram, "manifest: target '" + target + "': unknown ISA extension '" + parts[i] + "'");
  const std::string& base = parts[0];
  bool ok = true;
#if defined(__x86_64__) || defined(__i386__)
  if (base == "avx512") ok = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw");
  else if (base == "avx2") ok = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  else if (base != "scalar") ok = false;
  for (size_t i = 1; i < parts.size(); ++i) {
    if (parts[i] == "avx512_vnni") ok = ok && __builtin_cpu_supports("avx512vnni");
    if (parts[i] == "amx_tile") ok = ok && __builtin_cpu_supports("amx-tile");
  }
#elif defined(__aarch64__)
  ok = parts.size() == 1 && (base == "scalar" || base == "asimd" || base == "neon");
#else
  ok = parts.size() == 1 && base == "scalar";
#endif
  if (!ok)
    return Status(Error::NotSupported, "compiled code targets " + target +
                                           ", which this CPU does not support; export on (or for) the machine that runs it");
  return Status::ok_status();
}

}  // namespace offgraph_kv
