#include "weights.h"

#include <dlfcn.h>

#include <executorch/runtime/platform/log.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstring>
#include <map>
#include <set>
#include <thread>
#include <unordered_map>

#include "checksum.h"
#include "code_digest.h"
#include "compiled_program.h"
#include "manifest_generated.h"
#include "shared_cache.h"

#ifdef OFFGRAPH_KV_WITH_CUDA
#include <cuda_runtime.h>
#endif

namespace offgraph_kv {

using executorch::runtime::FreeableBuffer;
using executorch::runtime::NamedDataMap;
using executorch::runtime::Result;

extern "C" {
struct AOTInductorConstantMapEntryABI {  // AOTInductorConstantMapEntry
  const char* name;
  AtenTensorHandle handle;
};
using GetNumConstantsFn = AOTIRuntimeError (*)(AOTInductorModelContainerHandle, size_t*);
using GetConstantStringFn = AOTIRuntimeError (*)(AOTInductorModelContainerHandle, size_t, const char**);
using GetConstantDtypeFn = AOTIRuntimeError (*)(AOTInductorModelContainerHandle, size_t, int32_t*);
using GetConstantSizeFn = AOTIRuntimeError (*)(AOTInductorModelContainerHandle, size_t, size_t*);
using GetConstantFlagFn = AOTIRuntimeError (*)(AOTInductorModelContainerHandle, size_t, bool*);
using UpdatePairsFn = AOTIRuntimeError (*)(AOTInductorModelContainerHandle, const AOTInductorConstantMapEntryABI*,
                                           size_t, bool use_inactive, bool validate_full_update);
// Older containers take a std::unordered_map across the boundary; the .so and
// this runtime are built with the same toolchain's library where that is used.
using UpdateMapFn = AOTIRuntimeError (*)(AOTInductorModelContainerHandle, void* map, bool use_inactive,
                                         bool validate_full_update);
}

namespace {

Status invalid(const std::string& what) { return Status(Error::InvalidProgram, "weights: " + what); }

// Bytes per element of the dtypes a weight may have (c10::ScalarType codes).
size_t item_size(int32_t dtype) {
  switch (dtype) {
    case 0: case 1: case 11: return 1;  // uint8, int8, bool
    case 2: case 5: case 15: return 2;  // int16, float16, bfloat16
    case 3: case 6: return 4;           // int32, float32
    case 4: case 7: return 8;           // int64, float64
    default: return 0;
  }
}

std::string describe(const WeightSpec& w) { return "'" + (w.fqn.empty() ? w.name : w.fqn) + "'"; }

// The view must stay inside its bytes: the file is not trusted to say so.
Status check_geometry(const WeightSpec& w) {
  const size_t item = item_size(w.dtype);
  if (item == 0) return invalid(describe(w) + ": dtype code " + std::to_string(w.dtype) + " is not supported");
  if (w.sizes.size() != w.strides.size())
    return invalid(describe(w) + ": " + std::to_string(w.sizes.size()) + " sizes but " +
                   std::to_string(w.strides.size()) + " strides");
  if (w.storage_offset < 0) return invalid(describe(w) + ": negative storage offset");
  if (w.nbytes % item != 0) return invalid(describe(w) + ": " + std::to_string(w.nbytes) + " bytes is not a whole number of elements");
  bool empty = false;
  uint64_t last = uint64_t(w.storage_offset);  // the highest element the view reads
  for (size_t d = 0; d < w.sizes.size(); ++d) {
    if (w.sizes[d] < 0 || w.strides[d] < 0) return invalid(describe(w) + ": negative size or stride");
    if (w.sizes[d] == 0) empty = true;
    else if (w.sizes[d] > 1 && uint64_t(w.strides[d]) > (UINT64_MAX - last) / uint64_t(w.sizes[d] - 1))
      return invalid(describe(w) + ": geometry overflows");
    else last += uint64_t(w.sizes[d] - 1) * uint64_t(w.strides[d]);
  }
  if (!empty && last >= w.nbytes / item)
    return invalid(describe(w) + ": its view reads element " + std::to_string(last) + " of " +
                   std::to_string(w.nbytes / item));
  return Status::ok_status();
}

template <typename Fn>
Fn find(void* lib, const char* name) {
  return reinterpret_cast<Fn>(dlsym(lib, name));
}

constexpr uintptr_t kAlignment = 64;  // what the export asked of the file (backend/weights.py)

// Index of the first weight whose bytes fail their CRC, or order.size().
// Weights are independent: threads take them in turn (the check reads each
// byte once, as loading must anyway).
size_t first_corrupt(const std::vector<const WeightSpec*>& order, const std::vector<FreeableBuffer>& found) {
  std::atomic<size_t> next{0};
  std::vector<char> bad(order.size(), 0);
  auto work = [&]() {
    for (size_t i = next++; i < order.size(); i = next++)
      bad[i] = crc32(found[i].data(), found[i].size()) != order[i]->crc32;
  };
  const unsigned hw = std::max(1u, std::min(8u, std::thread::hardware_concurrency()));
  std::vector<std::thread> threads;
  for (unsigned k = 1; k < hw && k < order.size(); ++k) threads.emplace_back(work);
  work();
  for (std::thread& th : threads) th.join();
  for (size_t i = 0; i < order.size(); ++i)
    if (bad[i]) return i;
  return order.size();
}

}  // namespace

Status read_weight_specs(const schema::Manifest* m, std::vector<WeightSpec>* out) {
  out->clear();
  if (m->weights() == nullptr) return Status::ok_status();
  std::set<std::string> names;
  for (uint32_t i = 0; i < m->weights()->size(); ++i) {
    const schema::Weight* f = m->weights()->Get(i);
    WeightSpec w;
    w.name = f->name()->str();  // required: the verifier rejected a missing one
    w.fqn = f->fqn() ? f->fqn()->str() : std::string();
    w.data_key = f->data_key()->str();
    w.dtype = f->dtype();
    w.nbytes = f->nbytes();
    if (f->sizes()) w.sizes.assign(f->sizes()->begin(), f->sizes()->end());
    if (f->strides()) w.strides.assign(f->strides()->begin(), f->strides()->end());
    w.storage_offset = f->storage_offset();
    w.crc32 = f->crc32();
    Status s = check_geometry(w);
    if (!s.ok()) return s;
    if (!names.insert(w.name).second) return invalid(describe(w) + " is listed twice");
    out->push_back(std::move(w));
  }
  return Status::ok_status();
}

#ifdef OFFGRAPH_KV_WITH_CUDA
// Every weight in one device allocation, filled once, freed with the weights.
class SharedWeights::DeviceArena {
 public:
  static std::unique_ptr<DeviceArena> allocate(size_t bytes, Status* status) {
    std::unique_ptr<DeviceArena> arena(new DeviceArena());
    const cudaError_t e = cudaMalloc(&arena->base_, bytes);
    if (e != cudaSuccess) {
      cudaGetLastError();
      *status = Status(Error::MemoryAllocationFailed, "weights: cannot allocate " + std::to_string(bytes) +
                                                          " bytes of device memory: " + cudaGetErrorString(e));
      return nullptr;
    }
    arena->bytes_ = bytes;
    return arena;
  }
  ~DeviceArena() {
    if (base_ != nullptr) cudaFree(base_);  // every container is gone and every step has completed
  }
  Status upload(size_t offset, const void* src, size_t bytes) {
    const cudaError_t e = cudaMemcpy(static_cast<char*>(base_) + offset, src, bytes, cudaMemcpyHostToDevice);
    if (e != cudaSuccess) {
      cudaGetLastError();
      return Status(Error::Internal, std::string("weights: host-to-device copy failed: ") + cudaGetErrorString(e));
    }
    return Status::ok_status();
  }
  // A copy from pageable memory may return before its DMA lands.
  Status finish() {
    const cudaError_t e = cudaDeviceSynchronize();
    return e == cudaSuccess ? Status::ok_status()
                            : Status(Error::Internal, std::string("weights: upload failed: ") + cudaGetErrorString(e));
  }
  void* at(size_t offset) const { return static_cast<char*>(base_) + offset; }
  size_t bytes() const { return bytes_; }

 private:
  DeviceArena() = default;
  void* base_ = nullptr;
  size_t bytes_ = 0;
};
#else
class SharedWeights::DeviceArena {};
#endif

SharedWeights::~SharedWeights() = default;  // device_, host_copies_, mapped_: each frees its own memory

void* SharedWeights::at(const std::string& name) const {
  auto it = std::lower_bound(by_name_.begin(), by_name_.end(), name,
                             [](const std::pair<std::string, void*>& e, const std::string& n) { return e.first < n; });
  return it != by_name_.end() && it->first == name ? it->second : nullptr;
}

namespace {

// One per process, never destroyed: a session released during static
// destruction (a host's static Module) must still find it.
SharedCache<SharedWeights>& weights_cache() {
  static auto* cache = new SharedCache<SharedWeights>();
  return *cache;
}

void put_u64(std::string* out, uint64_t v) {
  for (int i = 0; i < 8; ++i) out->push_back(char((v >> (8 * i)) & 0xff));
}
void put_text(std::string* out, const std::string& text) {
  put_u64(out, text.size());
  out->append(text);
}

}  // namespace

std::string weights_share_key(const std::string& code_key, const std::vector<WeightSpec>& specs,
                              const std::string& place) {
  // Length-prefixed fields: no two different lists serialise alike.
  std::string blob;
  put_u64(&blob, specs.size());
  for (const WeightSpec& w : specs) {
    put_text(&blob, w.name);
    put_text(&blob, w.fqn);
    put_text(&blob, w.data_key);
    put_u64(&blob, uint64_t(uint32_t(w.dtype)));
    put_u64(&blob, w.nbytes);
    put_u64(&blob, w.sizes.size());
    for (int64_t v : w.sizes) put_u64(&blob, uint64_t(v));
    for (int64_t v : w.strides) put_u64(&blob, uint64_t(v));
    put_u64(&blob, uint64_t(w.storage_offset));
    put_u64(&blob, w.crc32);
  }
  return code_key + "|" + place + "|" + sha256_hex(blob.data(), blob.size());
}

std::vector<SharedWeightsInfo> shared_weights_in_use() {
  std::vector<SharedWeightsInfo> out;
  for (const auto& e : weights_cache().entries())
    out.push_back({e.key, e.users, e.value->weight_bytes(), e.value->on_device()});
  return out;
}

std::unique_ptr<SharedWeights> SharedWeights::build(const std::vector<const WeightSpec*>& order,
                                                    const NamedDataMap& data, bool cuda, Status* status) {
  std::unique_ptr<SharedWeights> shared(new SharedWeights());
  shared->mapped_.reserve(order.size());
  // Device layout first: one allocation for all, each weight 256-byte aligned.
  std::vector<size_t> offsets;
  size_t arena_bytes = 0;
  for (const WeightSpec* w : order) {
    offsets.push_back(arena_bytes);
    arena_bytes += (size_t(w->nbytes) + 255) / 256 * 256;
    shared->weight_bytes_ += w->nbytes;
  }
#ifdef OFFGRAPH_KV_WITH_CUDA
  if (cuda && arena_bytes > 0) {
    shared->device_ = SharedWeights::DeviceArena::allocate(arena_bytes, status);
    if (!shared->device_) return nullptr;
  }
#else
  if (cuda) {
    *status = Status(Error::NotSupported, "weights: this runtime was built without CUDA");
    return nullptr;
  }
#endif

  // Every weight's bytes first: present, the expected size, and intact.
  std::vector<FreeableBuffer> found;
  found.reserve(order.size());
  for (const WeightSpec* wp : order) {
    const WeightSpec& w = *wp;
    Result<FreeableBuffer> bytes = data.get_data(w.data_key.c_str());
    if (!bytes.ok()) {
      *status = invalid(describe(w) + ": its data '" + w.data_key + "' is not in the program's named data");
      return nullptr;
    }
    if (bytes->size() != w.nbytes) {
      *status = invalid(describe(w) + ": its data '" + w.data_key + "' holds " + std::to_string(bytes->size()) +
                        " bytes, the compiled code expects " + std::to_string(w.nbytes));
      return nullptr;
    }
    found.push_back(std::move(bytes.get()));
  }
  const size_t corrupt = first_corrupt(order, found);
  if (corrupt < order.size()) {
    *status = invalid(describe(*order[corrupt]) + ": its bytes do not match their checksum (the file is damaged)");
    return nullptr;
  }

  for (size_t i = 0; i < order.size(); ++i) {
    const WeightSpec& w = *order[i];
    FreeableBuffer* bytes = &found[i];
    void* ptr = const_cast<void*>(bytes->data());  // read-only mapping: the code never writes weights
    if (cuda) {
#ifdef OFFGRAPH_KV_WITH_CUDA
      if (w.nbytes > 0) {
        *status = shared->device_->upload(offsets[i], bytes->data(), w.nbytes);
        if (!status->ok()) return nullptr;
      }
      ptr = shared->device_->at(offsets[i]);
      shared->copied_bytes_ += w.nbytes;
#endif
      bytes->Free();  // on the device now: the file's pages can go
    } else if (reinterpret_cast<uintptr_t>(ptr) % kAlignment != 0 && w.nbytes > 0) {
      // A program loaded from an unaligned buffer: copy rather than hand
      // the compiled code memory its vector loads may not expect.
      Buffer copy = allocate_buffer(host_memory(), w.nbytes);
      if (copy.data() == nullptr) {
        *status = Status(Error::MemoryAllocationFailed, "weights: cannot copy " + describe(w));
        return nullptr;
      }
      std::memcpy(copy.data(), bytes->data(), w.nbytes);
      ptr = copy.data();
      shared->copied_bytes_ += w.nbytes;
      shared->host_copies_.push_back(std::move(copy));
      bytes->Free();
    } else {
      shared->mapped_.push_back(std::move(*bytes));
    }
    shared->by_name_.emplace_back(w.name, ptr);
  }
#ifdef OFFGRAPH_KV_WITH_CUDA
  if (shared->device_) {
    *status = shared->device_->finish();
    if (!status->ok()) return nullptr;
  }
#endif
  std::sort(shared->by_name_.begin(), shared->by_name_.end());
  if (shared->copied_bytes_ > 0 && !cuda)
    ET_LOG(Info, "OffGraphKVBackend: %llu weight bytes copied (the program's data was not 64-byte aligned)",
           static_cast<unsigned long long>(shared->copied_bytes_));
  *status = Status::ok_status();
  return shared;
}

namespace {

// Where the shared bytes live, as part of the key. CUDA: the device (the
// arena is filled from the file and owns its memory). CPU: the bytes are the
// data map's own views. Mapped and file loaders hand every request its own
// buffer that lives until freed, whoever loaded it, so sessions of any
// Program of the same file can share them. A loader over a caller's buffer
// (a program loaded from bytes) hands out the same address each time, valid
// only while that buffer is: such views are shared only by sessions that see
// the same buffer, so the key carries its address.
std::string weights_place(const std::vector<const WeightSpec*>& order, const NamedDataMap& data, bool cuda) {
#ifdef OFFGRAPH_KV_WITH_CUDA
  if (cuda) {
    int device = 0;
    if (cudaGetDevice(&device) != cudaSuccess) cudaGetLastError();
    return "cuda:" + std::to_string(device);
  }
#else
  (void)cuda;
#endif
  const WeightSpec* probe = nullptr;  // the smallest weight: the cheapest to ask for twice
  for (const WeightSpec* w : order)
    if (w->nbytes > 0 && (probe == nullptr || w->nbytes < probe->nbytes)) probe = w;
  if (probe == nullptr) return "cpu";
  Result<FreeableBuffer> a = data.get_data(probe->data_key.c_str());
  Result<FreeableBuffer> b = data.get_data(probe->data_key.c_str());
  if (!a.ok() || !b.ok()) return "cpu";  // the build reports the missing data by name
  if (a->data() != b->data()) return "cpu";
  char text[32];
  std::snprintf(text, sizeof text, "cpu@%p", a->data());
  return text;
}

}  // namespace

std::unique_ptr<BoundWeights> BoundWeights::bind(CompiledProgram& program, const std::string& code_key,
                                                 const std::vector<WeightSpec>& specs, const NamedDataMap& data,
                                                 bool cuda, Status* status) {
  void* lib = program.library();
  AOTInductorModelContainerHandle container = program.container();
  auto num_constants = find<GetNumConstantsFn>(lib, "AOTInductorModelContainerGetNumConstants");
  auto constant_name = find<GetConstantStringFn>(lib, "AOTInductorModelContainerGetConstantName");
  auto constant_dtype = find<GetConstantDtypeFn>(lib, "AOTInductorModelContainerGetConstantDtype");
  auto constant_size = find<GetConstantSizeFn>(lib, "AOTInductorModelContainerGetConstantDataSize");
  auto from_folded = find<GetConstantFlagFn>(lib, "AOTInductorModelContainerGetConstantFromFolded");
  auto update_pairs = find<UpdatePairsFn>(lib, "AOTInductorModelContainerUpdateUserManagedConstantBufferPairs");
  auto update_map = find<UpdateMapFn>(lib, "AOTInductorModelContainerUpdateUserManagedConstantBuffer");
  auto from_blob = find<CreateTensorFromBlobFn>(lib, "aoti_torch_create_tensor_from_blob");
  auto delete_tensor = find<DeleteTensorFn>(lib, "aoti_torch_delete_tensor_object");
  if (!num_constants || !constant_name || !constant_dtype || !constant_size || !from_blob || !delete_tensor ||
      (!update_pairs && !update_map)) {
    *status = invalid("the compiled code lacks the AOTI constant entry points this runtime binds weights through");
    return nullptr;
  }

  // The compiled code's own table is the reference: every constant it reads
  // must be supplied, with its dtype and byte size.
  std::unordered_map<std::string, const WeightSpec*> by_name;
  for (const WeightSpec& w : specs) by_name[w.name] = &w;
  size_t n = 0;
  if (num_constants(container, &n) != 0) {
    *status = invalid("the compiled code cannot report its constants");
    return nullptr;
  }
  std::vector<const WeightSpec*> order;
  std::set<std::string> expected;
  for (size_t i = 0; i < n; ++i) {
    bool folded = false;
    if (from_folded && from_folded(container, i, &folded) == 0 && folded) continue;  // computed, never supplied
    const char* name = nullptr;
    int32_t dtype = 0;
    size_t bytes = 0;
    if (constant_name(container, i, &name) != 0 || name == nullptr || constant_dtype(container, i, &dtype) != 0 ||
        constant_size(container, i, &bytes) != 0) {
      *status = invalid("the compiled code cannot describe its constant " + std::to_string(i));
      return nullptr;
    }
    expected.insert(name);
    auto it = by_name.find(name);
    if (it == by_name.end()) {
      *status = invalid("the compiled code reads constant '" + std::string(name) + "', which the manifest does not list");
      return nullptr;
    }
    const WeightSpec& w = *it->second;
    // AOTI reports a constant's size padded to its 64-byte alignment (a 352-byte
    // bias reads as 384): the manifest's exact size must round up to it.
    constexpr size_t kAlign = 64;
    const bool same_size = w.nbytes == bytes || (bytes % kAlign == 0 && w.nbytes < bytes && bytes - w.nbytes < kAlign);
    if (w.dtype != dtype || !same_size) {
      *status = invalid(describe(w) + ": the manifest says dtype " + std::to_string(w.dtype) + ", " +
                        std::to_string(w.nbytes) + " bytes; the compiled code expects dtype " + std::to_string(dtype) +
                        ", " + std::to_string(bytes) + " bytes");
      return nullptr;
    }
    order.push_back(&w);
  }
  for (const WeightSpec& w : specs)
    if (!expected.count(w.name)) {
      *status = invalid("the manifest lists " + describe(w) + " (constant '" + w.name +
                        "'), which the compiled code does not have");
      return nullptr;
    }

  // The bytes: this process's copy if a session of the same program holds
  // one, else read, checked and kept for the sessions to come.
  std::unique_ptr<BoundWeights> bound(new BoundWeights());
  bound->delete_tensor_ = delete_tensor;
  const std::string key = weights_share_key(code_key, specs, weights_place(order, data, cuda));
  bound->shared_ = weights_cache().acquire(
      key, [&](Status* st) { return SharedWeights::build(order, data, cuda, st); }, status);
  if (!bound->shared_) return nullptr;

  std::vector<AOTInductorConstantMapEntryABI> pairs;
  const int32_t device_type = program.device_type();
  for (const WeightSpec* wp : order) {
    const WeightSpec& w = *wp;
    void* ptr = bound->shared_->at(w.name);
    if (ptr == nullptr && w.nbytes > 0) {  // same key, same list: cannot happen unless the cache is wrong
      *status = Status(Error::Internal, "weights: the shared weights lack " + describe(w));
      return nullptr;
    }
    AtenTensorHandle h = nullptr;
    if (from_blob(ptr, int64_t(w.sizes.size()), w.sizes.data(), w.strides.data(), w.storage_offset, w.dtype,
                  device_type, 0, &h) != 0) {
      *status = invalid(describe(w) + ": cannot describe it to the compiled code");
      return nullptr;
    }
    bound->handles_.push_back(h);
    pairs.push_back({w.name.c_str(), h});
  }
  // User-managed: the container keeps views of our memory, never copies.
  AOTIRuntimeError rc = 0;
  if (update_pairs) {
    rc = update_pairs(container, pairs.data(), pairs.size(), false, true);
  } else {
    std::unordered_map<std::string, AtenTensorHandle> map;
    for (const auto& p : pairs) map.emplace(p.name, p.handle);
    rc = update_map(container, &map, false, true);
  }
  if (rc != 0) {
    *status = invalid("the compiled code refused its weights (" + program.last_error() + ")");
    return nullptr;
  }
  *status = Status::ok_status();
  return bound;
}

BoundWeights::~BoundWeights() {
  // Our views only; the memory goes with the last session's reference to shared_.
  for (AtenTensorHandle h : handles_) delete_tensor_(h);
}

}  // namespace offgraph_kv
