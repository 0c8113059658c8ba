// Python face of the runtime: importing registers the delegate; stores() and
// configure() are the control face for a Python host.
#include <executorch/runtime/backend/interface.h>
#include <executorch/runtime/platform/runtime.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstring>

#include "delegate.h"
#include "host_runner.h"
#include "kv_store.h"
#include "store_registry.h"
#include "weights.h"

namespace py = pybind11;
using namespace offgraph_kv;

#ifdef OFFGRAPH_KV_WITH_CUDA_GRAPHS
namespace offgraph_kv {
void register_cuda_step_graphs();  // cuda_graph.cpp
}
#endif

namespace {

const char* kind_name(LayerKind k) { return k == LayerKind::Ring ? "ring" : "flat"; }

py::dict metrics_dict(const KVStore& store) {
  const StoreMetrics m = store.metrics();
  py::list layers;
  for (const LayerMetrics& l : m.layers) {
    py::dict d;
    d["layer"] = l.layer;
    d["kind"] = kind_name(l.kind);
    d["window"] = l.window;
    d["rows"] = l.rows;
    d["bytes"] = l.bytes;
    layers.append(d);
  }
  py::dict d;
  d["length"] = m.length;
  d["capacity"] = m.capacity;
  d["allocated_bytes"] = m.allocated_bytes;
  d["peak_bytes"] = m.peak_bytes;
  d["reserved_bytes"] = m.reserved_bytes;
  d["growth"] = growth_mode_name(m.growth);
  d["growth_note"] = m.growth_note;
  d["growths"] = m.growths;
  d["steps"] = m.steps;
  d["graph_captures"] = m.graph_captures;
  d["graph_replays"] = m.graph_replays;
  d["host_us_per_step"] = m.steps ? double(m.host_ns) / 1000.0 / double(m.steps) : 0.0;
  d["storage_dtype"] = dtype_name(m.dtype);
  d["max_capacity"] = store.policy().max_capacity;
  d["initial_capacity"] = store.policy().initial_capacity;
  d["growth_factor"] = store.policy().growth_factor;
  d["layers"] = layers;
  return d;
}

executorch::runtime::BackendOption make_int(const char* key, int value) {
  executorch::runtime::BackendOption o{};
  std::strncpy(o.key, key, sizeof(o.key) - 1);
  o.value = value;
  return o;
}

executorch::runtime::BackendOption make_text(const char* key, const std::string& value) {
  executorch::runtime::BackendOption o{};
  std::strncpy(o.key, key, sizeof(o.key) - 1);
  std::array<char, executorch::runtime::kMaxOptionValueLength> text{};
  std::strncpy(text.data(), value.c_str(), text.size() - 1);
  o.value = text;
  return o;
}

// A dense host tensor as Python hands it over: (data_ptr, sizes, dtype name).
using HostInput = std::tuple<uintptr_t, std::vector<int64_t>, std::string>;

std::vector<HostTensor> host_tensors(const std::vector<HostInput>& inputs) {
  std::vector<HostTensor> out;
  out.reserve(inputs.size());
  for (const auto& [ptr, sizes, dtype] : inputs) {
    HostTensor t;
    t.data = reinterpret_cast<const void*>(ptr);
    t.sizes = sizes;
    t.dtype = dtype;
    out.push_back(std::move(t));
  }
  return out;
}

}  // namespace

PYBIND11_MODULE(_runtime, m) {
#ifdef OFFGRAPH_KV_WITH_CUDA_GRAPHS
  register_cuda_step_graphs();
#endif
  m.doc() = "offgraph-kv runtime: the OffGraphKVBackend delegate and its control face";
  executorch::runtime::runtime_init();
  const auto err = register_delegate();
  if (err != executorch::runtime::Error::Ok)
    throw std::runtime_error("could not register OffGraphKVBackend with the ExecuTorch runtime (error " +
                             std::to_string(int(err)) + ")");

  py::class_<KVStore, std::shared_ptr<KVStore>>(m, "Store", "The KV storage one loaded method owns.")
      .def("metrics", &metrics_dict, "length, capacity, bytes allocated and peak, growths, per-layer rows and bytes")
      .def(
          "reset",
          [](KVStore& s, bool release_memory) {
            Status st = s.reset(release_memory);
            if (!st.ok()) throw std::runtime_error(st.message());
          },
          py::arg("release_memory") = false, "Forget the history; optionally shrink to the initial allocation.")
      .def(
          "rewind",
          [](KVStore& s, size_t n) {
            Status st = s.rewind(n);
            if (!st.ok()) throw std::invalid_argument(st.message());
          },
          py::arg("n"), "Forget the newest n committed positions (rings: within max_write + rewind_budget).")
      .def(
          "truncate",
          [](KVStore& s, size_t length) {
            if (length > s.length())
              throw std::invalid_argument("truncate to " + std::to_string(length) + ": the store holds only " +
                                          std::to_string(s.length()));
            Status st = s.rewind(s.length() - length);
            if (!st.ok()) throw std::invalid_argument(st.message());
          },
          py::arg("length"), "Keep the first `length` committed positions.")
      .def(
          "addresses",
          [](const KVStore& s) {
            std::vector<uintptr_t> out;
            for (size_t i = 0; i < s.tensors().size(); ++i) out.push_back(reinterpret_cast<uintptr_t>(s.binding(i).data));
            return out;
          },
          "Where each private tensor's storage starts (device or host addresses, in manifest order): map growth "
          "keeps them; copy growth moves flat tensors at every growth.")
      .def("can_extend", &KVStore::can_extend, py::arg("n"), "Whether n more tokens fit under max_capacity.")
      .def(
          "save",
          [](const KVStore& s, const std::string& path) {
            Status st = s.save_context(path);
            if (st.code() == Error::InvalidArgument) throw std::invalid_argument(st.message());  // the path's fault
            if (!st.ok()) throw std::runtime_error(st.message());
          },
          py::arg("path"), "Write the committed context (rows, length, program identity) to path, atomically.")
      .def(
          "load",
          [](KVStore& s, const std::string& path) {
            Status st = s.load_context(path);
            if (!st.ok()) throw std::invalid_argument(st.message());
          },
          py::arg("path"), "Restore a saved context into this (empty) store.")
      .def_property_readonly("length", &KVStore::length)
      .def_property_readonly("capacity", &KVStore::capacity);

  py::class_<HostRunner>(m, "HostRunner",
                         "A method of a .pte run through ExecuTorch's C++ Module, with raw host buffers in and out.")
      .def(py::init([](const std::string& path, const std::string& method) {
             Status s;
             std::unique_ptr<HostRunner> r = HostRunner::load(path, method, &s);
             if (!r) throw std::runtime_error(s.message());
             return r;
           }),
           py::arg("path"), py::arg("method") = "forward")
      .def(
          "new_session",
          [](const HostRunner& r) {
            Status s;
            std::unique_ptr<HostRunner> session = r.new_session(&s);
            if (!session) throw std::runtime_error(s.message());
            return session;
          },
          "The method loaded again over the same Program: its own KV store, the code and weights shared.")
      .def_property_readonly("store", &HostRunner::store, "The KV store this method owns (None without this backend).")
      .def(
          "run",
          [](HostRunner& r, const std::vector<HostInput>& inputs) {
            std::vector<HostTensor> in = host_tensors(inputs);
            std::vector<HostTensor> out;
            Status s;
            {
              py::gil_scoped_release unlocked;
              s = r.run(in, &out);
            }
            if (!s.ok()) throw std::runtime_error(s.message());
            py::list result;
            for (const HostTensor& t : out)
              result.append(py::make_tuple(t.dtype, t.sizes,
                                           py::bytearray(static_cast<const char*>(t.data), t.nbytes)));
            return result;
          },
          py::arg("inputs"), "inputs: (data_ptr, sizes, dtype) of dense host tensors; returns (dtype, sizes, bytearray).")
      .def(
          "decode_greedy",
          [](HostRunner& r, const std::vector<HostInput>& inputs, size_t token_input, size_t position_input,
             size_t steps, const std::vector<int64_t>& stop_ids, size_t logits_output) {
            GreedyRequest req;
            req.inputs = host_tensors(inputs);
            req.token_input = token_input;
            req.position_input = position_input;
            req.logits_output = logits_output;
            req.steps = steps;
            req.stop_ids = stop_ids;
            GreedyResult result;
            Status s;
            {
              py::gil_scoped_release unlocked;
              s = r.decode_greedy(req, &result);
            }
            if (!s.ok()) throw std::runtime_error(s.message());
            return py::make_tuple(result.tokens, result.step_ns);
          },
          py::arg("inputs"), py::arg("token_input"), py::arg("position_input"), py::arg("steps"),
          py::arg("stop_ids") = std::vector<int64_t>{}, py::arg("logits_output") = 0,
          "Greedy decode steps in a C++ loop (no Python per token): inputs as for run(), those of the first "
          "one-token step; returns (tokens, host ns per step). A failed step raises; the steps before it stand.");
  m.def("last_error", &last_error,
        "The last message the delegate failed with on this thread ('' if none since clear_last_error).");
  m.def("clear_last_error", &clear_last_error);
  m.def("stores", &live_stores, "The stores of the methods loaded in this process, oldest first.");
  m.def("take_last_store", &take_last_store_on_this_thread,
        "The store of the method loaded last on this thread since the previous call (None if none); forgets it.");
  m.def(
      "shared_weights",
      []() {
        py::list out;
        for (const SharedWeightsInfo& w : shared_weights_in_use()) {
          py::dict d;
          d["key"] = w.key;
          d["sessions"] = w.sessions;
          d["weight_bytes"] = w.weight_bytes;
          d["on_device"] = w.on_device;
          out.append(d);
        }
        return out;
      },
      "The weights held in this process, one entry per program, with how many sessions (loaded methods) share each.");
  m.def(
      "set_options",
      [](int initial_capacity, int max_capacity, const std::string& growth_factor, int rewind_budget,
         int num_threads, const std::string& growth, const std::string& cuda_graphs) {
        executorch::runtime::BackendOption opts[] = {
            make_int("initial_capacity", initial_capacity),
            make_int("max_capacity", max_capacity),
            make_text("growth_factor", growth_factor),
            make_int("rewind_budget", rewind_budget),
            make_int("num_threads", num_threads),
            make_text("growth", growth),
            make_text("cuda_graphs", cuda_graphs),
        };
        clear_last_error();
        const auto e = executorch::runtime::set_option(kBackendName, {opts, 7});
        if (e != executorch::runtime::Error::Ok) {
          const std::string why = last_error();  // the delegate's message names the option and the value
          throw std::invalid_argument("OffGraphKVBackend rejected the options (error " + std::to_string(int(e)) +
                                      "): " + (why.empty() ? "see the log" : why));
        }
      },
      py::arg("initial_capacity"), py::arg("max_capacity"), py::arg("growth_factor"), py::arg("rewind_budget") = -1, py::arg("num_threads") = 0,
      py::arg("growth") = "", py::arg("cuda_graphs") = "");
  m.def("get_options", []() {
    executorch::runtime::BackendOption opts[] = {make_int("initial_capacity", 0), make_int("max_capacity", 0),
                                                 make_text("growth_factor", ""), make_int("rewind_budget", -1),
                                                 make_int("num_threads", 0), make_text("growth", ""),
                                                 make_text("cuda_graphs", "")};
    const auto e = executorch::runtime::get_option(kBackendName, {opts, 7});
    if (e != executorch::runtime::Error::Ok) throw std::runtime_error("get_option failed");
    py::dict d;
    d["initial_capacity"] = std::get<int>(opts[0].value);
    d["max_capacity"] = std::get<int>(opts[1].value);
    d["growth_factor"] = std::string(std::get<2>(opts[2].value).data());
    d["rewind_budget"] = std::get<int>(opts[3].value);
    d["num_threads"] = std::get<int>(opts[4].value);
    d["growth"] = std::string(std::get<2>(opts[5].value).data());
    d["cuda_graphs"] = std::string(std::get<2>(opts[6].value).data());
    return d;
  });
}
