// Benchmark hooks (offgraph_kv.runtime._bench): built only with
// -DOFFGRAPH_KV_BENCHMARKS=ON, so the shipped runtime carries no benchmark code.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <chrono>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>
#include <algorithm>

#include "code_digest.h"
#include "growth_benchmark.h"

namespace py = pybind11;
using namespace offgraph_kv;

PYBIND11_MODULE(_bench, m) {
  m.doc() = "offgraph-kv benchmark hooks: the store's growth timed alone, the copy kernel's grid, the code digest";
  m.def(
      "sha256_seconds",
      [](size_t nbytes, int repeats) {
        std::vector<uint8_t> data(nbytes);
        for (size_t i = 0; i < nbytes; ++i) data[i] = uint8_t(i * 2654435761u >> 13);
        double best = 1e30;
        for (int r = 0; r < repeats; ++r) {
          const auto t0 = std::chrono::steady_clock::now();
          volatile size_t sink = sha256_hex(data.data(), data.size()).size();
          (void)sink;
          best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
        }
        return best;
      },
      py::arg("nbytes"), py::arg("repeats") = 3,
      "Benchmark hook: best-of-repeats seconds of the runtime's SHA-256 (the load's code digest) over nbytes.");
  m.def(
      "time_growth",
      [](const std::string& device, size_t layers, size_t heads, size_t head_dim, const std::string& dtype,
         size_t rows_before, size_t rows_after, int repeats, const std::string& copy_mode, bool fresh_memory,
         const std::string& growth, bool touch) {
        const int code = dtype == "fp32" ? 0 : dtype == "fp16" ? 1 : dtype == "bf16" ? 2 : -1;
        GrowthTiming t;
        Status s;
        {
          py::gil_scoped_release unlocked;
          s = time_growth(device, layers, heads, head_dim, code, rows_before, rows_after, repeats, copy_mode,
                          fresh_memory, growth, touch, &t);
        }
        if (!s.ok()) throw std::runtime_error(s.message());
        py::dict d;
        d["seconds"] = t.seconds;
        d["device_seconds"] = t.device_seconds;
        d["copy_device_seconds"] = t.copy_device_seconds;
        d["bytes_copied"] = t.bytes_copied;
        d["peak_bytes"] = t.peak_bytes;
        d["allocated_bytes"] = t.allocated_bytes;
        d["device_peak_bytes"] = t.device_peak_bytes;
        d["growth"] = t.growth;
        return d;
      },
      py::arg("device"), py::arg("layers"), py::arg("heads"), py::arg("head_dim"), py::arg("dtype"),
      py::arg("rows_before"), py::arg("rows_after"), py::arg("repeats"), py::arg("copy_mode") = "auto",
      py::arg("fresh_memory") = true, py::arg("growth") = "copy", py::arg("touch") = false,
      "Benchmark hook: mean seconds of one store growth (copy: allocate, copy, release; map: back the new rows) by "
      "the host clock and, on CUDA, on the stream (events); the bytes it copies; the store's peak and, on CUDA, the "
      "device memory in use right after the growth. touch: also write the new rows inside the timed span.");
  m.def(
      "reservation_cost",
      [](const std::string& device, size_t layers, size_t heads, size_t head_dim, const std::string& dtype,
         size_t initial_rows, size_t max_rows) {
        const int code = dtype == "fp32" ? 0 : dtype == "fp16" ? 1 : dtype == "bf16" ? 2 : -1;
        ReservationCost c;
        Status s = reservation_cost(device, layers, heads, head_dim, code, initial_rows, max_rows, &c);
        if (!s.ok()) throw std::runtime_error(s.message());
        py::dict d;
        d["reserved_bytes"] = c.reserved_bytes;
        d["allocated_bytes"] = c.allocated_bytes;
        d["device_used_delta"] = c.device_used_delta;
        d["growth"] = c.growth;
        d["note"] = c.note;
        return d;
      },
      py::arg("device"), py::arg("layers"), py::arg("heads"), py::arg("head_dim"), py::arg("dtype"),
      py::arg("initial_rows"), py::arg("max_rows"),
      "Benchmark hook: a map-growth store for max_rows rows: address space reserved, bytes backed, and (CUDA) the "
      "device memory its creation took (cudaMemGetInfo after less before).");
  m.def(
      "set_copy_kernel_grid",
      [](int blocks_per_sm) {
        const auto [in_effect, resident] = set_copy_kernel_grid(blocks_per_sm);
        py::dict d;
        d["blocks_per_sm"] = in_effect;
        d["resident_blocks_per_sm"] = resident;
        return d;
      },
      py::arg("blocks_per_sm"),
      "Benchmark hook: blocks per multiprocessor of the CUDA growth copy kernel (0: the default), process-wide; "
      "returns the value in effect and how many blocks fit on one multiprocessor (0 and 0 without the kernel).");
}
