#include "backend_options.h"

#include <cctype>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>
#include <variant>

namespace offgraph_kv {

namespace {

struct Overrides {
  size_t initial_capacity = 0;
  size_t max_capacity = 0;
  double growth_factor = 0;
  long rewind_budget = -1;  // -1: the export default (0 is a budget)
  size_t num_threads = 0;
  int growth = -1;  // -1: the default (auto); else a GrowthMode
  int cuda_graphs = -1;  // -1: the default (on); else 0 / 1
};

std::mutex& overrides_mutex() {
  static std::mutex m;
  return m;
}

Overrides& overrides() {
  static Overrides o;
  return o;
}

// Parses one option into `o`; false with a message when key or type is wrong.
bool apply_one(const BackendOption& opt, Overrides* o, std::string* why) {
  const std::string key = opt.key;
  if (key == "num_threads") {
    const int* v = std::get_if<int>(&opt.value);
    if (v == nullptr || *v < 0 || *v > 1024) {
      *why = "backend option num_threads must be an int in [0, 1024] (0: the default, one thread), got " +
             (v == nullptr ? std::string(std::holds_alternative<bool>(opt.value) ? "a bool" : "a string")
                           : std::to_string(*v));
      return false;
    }
    o->num_threads = size_t(*v);
    return true;
  }
  if (key == "initial_capacity" || key == "max_capacity") {
    const int* v = std::get_if<int>(&opt.value);
    if (v == nullptr || *v < 0) {
      *why = "backend option " + key + " must be a non-negative int";
      return false;
    }
    (key == "initial_capacity" ? o->initial_capacity : o->max_capacity) = size_t(*v);
    return true;
  }
  if (key == "rewind_budget") {
    const int* v = std::get_if<int>(&opt.value);
    if (v == nullptr || *v < -1) {
      *why = "backend option rewind_budget must be an int >= 0 (-1: the export default)";
      return false;
    }
    o->rewind_budget = *v;
    return true;
  }
  if (key == "growth") {
    const auto* s = std::get_if<std::array<char, executorch::runtime::kMaxOptionValueLength>>(&opt.value);
    GrowthMode mode = GrowthMode::Auto;
    if (s == nullptr || !parse_growth_mode(s->data(), &mode)) {
      *why = std::string("backend option growth must be the string \"map\", \"copy\" or \"auto\"") +
             (s == nullptr ? "" : std::string(", got '") + s->data() + "'");
      return false;
    }
    o->growth = s->data()[0] == '\0' ? -1 : int(mode);
    return true;
  }
  if (key == "cuda_graphs") {
    const auto* s = std::get_if<std::array<char, executorch::runtime::kMaxOptionValueLength>>(&opt.value);
    const std::string v = s == nullptr ? std::string() : std::string(s->data());
    if (s == nullptr || (v != "on" && v != "off" && !v.empty())) {
      *why = std::string("backend option cuda_graphs must be the string \"on\" or \"off\"") +
             (s == nullptr ? "" : ", got '" + v + "'");
      return false;
    }
    o->cuda_graphs = v.empty() ? -1 : int(v == "on");
    return true;
  }
  if (key == "growth_factor") {
    const auto* s = std::get_if<std::array<char, executorch::runtime::kMaxOptionValueLength>>(&opt.value);
    if (s == nullptr) {
      *why = "backend option growth_factor must be a string such as \"1.5\"";
      return false;
    }
    const char* text = s->data();
    if (*text == '\0') {
      o->growth_factor = 0;
      return true;
    }
    char* end = nullptr;
    const double f = std::strtod(text, &end);
    // Decimal only (strtod would also read hex and leading blanks), finite and above 1.
    const bool decimal = std::isdigit(static_cast<unsigned char>(text[0])) && std::strchr(text, 'x') == nullptr &&
                         std::strchr(text, 'X') == nullptr;
    if (!decimal || end == text || *end != '\0' || !(f > 1.0) || !std::isfinite(f)) {
      *why = std::string("backend option growth_factor '") + text + "' must be a finite decimal number > 1";
      return false;
    }
    o->growth_factor = f;
    return true;
  }
  *why = "unknown backend option '" + key + "' (expected initial_capacity, max_capacity, growth_factor, rewind_budget, num_threads, growth, cuda_graphs)";
  return false;
}

void merge(const Overrides& o, GrowthPolicy* p) {
  if (o.initial_capacity) p->initial_capacity = o.initial_capacity;
  if (o.max_capacity) p->max_capacity = o.max_capacity;
  if (o.growth_factor > 0) p->growth_factor = o.growth_factor;
  if (o.rewind_budget >= 0) p->rewind_budget = size_t(o.rewind_budget);
  if (o.num_threads) p->num_threads = o.num_threads;
  if (o.growth >= 0) p->growth = GrowthMode(o.growth);
  if (o.cuda_graphs >= 0) p->cuda_graphs = o.cuda_graphs == 1;
}

}  // namespace

Status apply_options(Span<BackendOption> options) {
  std::lock_guard<std::mutex> lock(overrides_mutex());
  Overrides next = overrides();
  std::string why;
  for (const BackendOption& opt : options) {
    if (!apply_one(opt, &next, &why)) return Status(Error::InvalidArgument, why);
  }
  overrides() = next;  // all or nothing
  return Status::ok_status();
}

Status read_options(Span<BackendOption> options) {
  std::lock_guard<std::mutex> lock(overrides_mutex());
  const Overrides& o = overrides();
  for (BackendOption& opt : options) {
    const std::string key = opt.key;
    if (key == "initial_capacity") opt.value = int(o.initial_capacity);
    else if (key == "max_capacity") opt.value = int(o.max_capacity);
    else if (key == "rewind_budget") opt.value = int(o.rewind_budget);
    else if (key == "num_threads") opt.value = int(o.num_threads);
    else if (key == "growth") {
      std::array<char, executorch::runtime::kMaxOptionValueLength> text{};
      if (o.growth >= 0) std::snprintf(text.data(), text.size(), "%s", growth_mode_name(GrowthMode(o.growth)));
      opt.value = text;
    } else if (key == "cuda_graphs") {
      std::array<char, executorch::runtime::kMaxOptionValueLength> text{};
      if (o.cuda_graphs >= 0) std::snprintf(text.data(), text.size(), "%s", o.cuda_graphs ? "on" : "off");
      opt.value = text;
    } else if (key == "growth_factor") {
      std::array<char, executorch::runtime::kMaxOptionValueLength> text{};
      if (o.growth_factor > 0) std::snprintf(text.data(), text.size(), "%g", o.growth_factor);
      opt.value = text;
    } else {
      return Status(Error::InvalidArgument, "unknown backend option '" + key + "'");
    }
  }
  return Status::ok_status();
}

Status check_runtime_specs(Span<const BackendOption> runtime_specs) {
  Overrides per_load;
  std::string why;
  for (const BackendOption& opt : runtime_specs)
    if (!apply_one(opt, &per_load, &why)) return Status(Error::InvalidArgument, "runtime spec: " + why);
  return Status::ok_status();
}

GrowthPolicy resolve_policy(const GrowthPolicy& defaults, Span<const BackendOption> runtime_specs) {
  GrowthPolicy p = defaults;
  {
    std::lock_guard<std::mutex> lock(overrides_mutex());
    merge(overrides(), &p);
  }
  Overrides per_load;
  std::string ignored;
  for (const BackendOption& opt : runtime_specs) apply_one(opt, &per_load, &ignored);
  merge(per_load, &p);
  return p;
}

}  // namespace offgraph_kv
