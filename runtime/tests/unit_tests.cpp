// Unit tests of the store, growth, manifest and option logic: no model, no torch.
// Run by tests/test_runtime_unit.py; exits non-zero on the first failure count.
#include <cstdio>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "code_digest.h"
#include "growth_policy.h"
#include "kv_store.h"
#include "backend_options.h"
#include "manifest_generated.h"
#include "manifest_reader.h"
#include "step_io.h"
#include "step_width.h"

#ifdef OFFGRAPH_KV_WITH_CUDA
#include <cuda_runtime.h>
#endif

using namespace offgraph_kv;

static int g_failures = 0;
static std::vector<std::pair<const char*, std::function<void()>>>& registry() {
  static std::vector<std::pair<const char*, std::function<void()>>> r;
  return r;
}
struct Register {
  Register(const char* name, std::function<void()> fn) { registry().emplace_back(name, std::move(fn)); }
};
#define TEST(name)                                 \
  static void name();                              \
  static Register register_##name(#name, name);    \
  static void name()
#define CHECK(cond)                                                              \
  do {                                                                           \
    if (!(cond)) {                                                               \
      std::fprintf(stderr, "  FAILED %s:%d: %s\n", __FILE__, __LINE__, #cond);   \
      ++g_failures;                                                              \
    }                                                                            \
  } while (0)

namespace {

// Host memory that counts what the store asks of it and can be told to refuse
// the next allocations.
class FailingMemory final : public DeviceMemory {
 public:
  int fail_after = -1;  // allocations left before refusing; -1 = never refuse
  int allocations = 0;
  int batches = 0;
  size_t batch_copies = 0;
  int returns = 0;  // return_unused calls
  void* allocate(size_t bytes) override {
    if (fail_after == 0) return nullptr;
    if (fail_after > 0) --fail_after;
    ++allocations;
    return host_memory()->allocate(bytes);
  }
  void copy_many(const std::vector<CopyOp>& copies) override {
    ++batches;
    batch_copies += copies.size();
    DeviceMemory::copy_many(copies);
  }
  void release(void* p) override { host_memory()->release(p); }
  void copy(void* d, const void* s, size_t n) override { host_memory()->copy(d, s, n); }
  void zero(void* d, size_t n) override { host_memory()->zero(d, n); }
  void return_unused() override { ++returns; }
  const char* name() const override { return "failing"; }
};

std::vector<TensorSpec> flat_layers(size_t layers, StorageDType dtype, uint32_t heads = 2, uint32_t head_dim = 4) {
  return flat_layer_specs(layers, heads, head_dim, dtype, 2);
}

GrowthPolicy policy(size_t initial, size_t max, double factor = 2.0) {
  GrowthPolicy p;
  p.initial_capacity = initial;
  p.max_capacity = max;
  p.growth_factor = factor;
  return p;
}

// Writes `width` rows of the prepared step with a recognisable byte pattern.
void fill_step(KVStore& s, size_t width) {
  for (size_t i = 0; i < s.tensors().size(); ++i) {
    const Binding b = s.binding(i);
    const size_t rb = s.tensors()[i].row_bytes();
    for (size_t r = size_t(b.rows) - width; r < size_t(b.rows); ++r)
      std::memset(static_cast<char*>(b.data) + r * rb, int((r * 7 + i) & 0xff), rb);
  }
}

bool rows_intact(const KVStore& s, size_t upto) {
  for (size_t i = 0; i < s.tensors().size(); ++i) {
    const size_t rb = s.tensors()[i].row_bytes();
    for (size_t r = 0; r < upto; ++r) {
      // Idle, a binding is the committed rows: its data is row 0.
      const auto* p = static_cast<const unsigned char*>(s.binding(i).data) + r * rb;
      for (size_t b = 0; b < rb; ++b)
        if (p[b] != ((r * 7 + i) & 0xff)) return false;
    }
  }
  return true;
}

}  // namespace

TEST(growth_is_geometric_and_clamped_at_max_capacity) {
  GrowthPolicy p = policy(4, 100);
  CHECK(next_capacity(p, 4, 5) == 8);
  CHECK(next_capacity(p, 4, 9) == 16);
  CHECK(next_capacity(p, 64, 65) == 100);
  CHECK(next_capacity(p, 64, 101) == 0);
  p.growth_factor = 1.5;
  CHECK(next_capacity(p, 4, 5) == 6);
  p.growth_factor = 1.01;  // tiny factors still make progress
  CHECK(next_capacity(p, 4, 5) == 5);
}

TEST(growth_policy_validation_names_the_field) {
  CHECK(policy(4, 100).validate(100).empty());
  CHECK(policy(4, 200).validate(100).find("max_capacity 200 exceeds") != std::string::npos);
  CHECK(policy(0, 100).validate(100).find("initial_capacity") != std::string::npos);
  CHECK(policy(4, 100, 1.0).validate(100).find("growth_factor") != std::string::npos);
}

TEST(allocated_bytes_follow_dtype_heads_head_dim_and_capacity) {
  for (StorageDType d : {StorageDType::Float32, StorageDType::Float16, StorageDType::BFloat16}) {
    Status st;
    auto s = KVStore::create(flat_layers(3, d, 2, 8), policy(16, 1024), 8, host_memory(), &st);
    CHECK(st.ok());
    CHECK(s->metrics().allocated_bytes == 3 * 2 * 16 * 2 * 8 * element_size(d));
  }
}

TEST(growth_preserves_committed_rows_and_counts_transient_peak) {
  Status st;
  auto s = KVStore::create(flat_layers(2, StorageDType::Float32), policy(4, 64), 8, host_memory(), &st);
  const size_t row = 2 * 4 * 4, tensors = 4;
  size_t length = 0;
  for (size_t w : {3, 1, 1, 4, 1, 7, 2}) {
    CHECK(s->prepare_step(w).ok());
    fill_step(*s, w);
    s->commit_step();
    length += w;
    CHECK(s->length() == length);
    CHECK(rows_intact(*s, length));
  }
  StoreMetrics m = s->metrics();
  CHECK(m.capacity == 32);  // 4 -> 8 -> 16 -> 32
  CHECK(m.growths == 3);
  CHECK(m.allocated_bytes == tensors * 32 * row);
  CHECK(m.peak_bytes == tensors * (16 + 32) * row);
}

TEST(rejected_steps_change_nothing) {
  Status st;
  auto s = KVStore::create(flat_layers(1, StorageDType::BFloat16), policy(4, 10), 8, host_memory(), &st);
  CHECK(s->prepare_step(3).ok());
  fill_step(*s, 3);
  s->commit_step();
  const StoreMetrics before = s->metrics();
  Status zero = s->prepare_step(0);
  CHECK(!zero.ok() && zero.message().find("width is 0") != std::string::npos);
  Status over = s->prepare_step(8);
  CHECK(!over.ok() && over.message().find("max_capacity 10") != std::string::npos);
  CHECK(over.message().find("7 remaining") != std::string::npos);
  CHECK(s->length() == 3 && s->metrics().capacity == before.capacity);
  CHECK(rows_intact(*s, 3));
}

TEST(aborted_step_keeps_length_and_rows) {
  Status st;
  auto s = KVStore::create(flat_layers(2, StorageDType::Float16), policy(2, 64), 8, host_memory(), &st);
  CHECK(s->prepare_step(2).ok());
  fill_step(*s, 2);
  s->commit_step();
  CHECK(s->prepare_step(5).ok());  // grows, then the run "fails"
  std::memset(s->binding(0).data, 0, 0);
  s->abort_step();
  CHECK(s->length() == 2);
  CHECK(rows_intact(*s, 2));
  CHECK(s->prepare_step(1).ok());
  CHECK(s->binding(0).rows == 3);
}

TEST(failed_growth_allocation_leaves_store_unchanged) {
  auto mem = std::make_shared<FailingMemory>();
  Status st;
  auto s = KVStore::create(flat_layers(2, StorageDType::Float32), policy(2, 64), 8, mem, &st);
  CHECK(st.ok());
  CHECK(s->prepare_step(2).ok());
  fill_step(*s, 2);
  s->commit_step();
  const StoreMetrics before = s->metrics();
  mem->fail_after = 0;  // the growth's one allocation (all four tensors) fails
  Status g = s->prepare_step(1);
  CHECK(!g.ok() && g.code() == Error::MemoryAllocationFailed);
  CHECK(g.message().find("to grow to 4 rows") != std::string::npos);
  const StoreMetrics after = s->metrics();
  CHECK(after.capacity == before.capacity && after.allocated_bytes == before.allocated_bytes);
  CHECK(s->length() == 2 && rows_intact(*s, 2));
  mem->fail_after = -1;
  CHECK(s->prepare_step(1).ok());
}

TEST(growth_is_one_allocation_and_one_copy_batch_whatever_the_layer_count) {
  auto mem = std::make_shared<FailingMemory>();
  Status st;
  auto s = KVStore::create(flat_layers(32, StorageDType::BFloat16), policy(4, 64), 8, mem, &st);
  CHECK(st.ok() && mem->allocations == 1);
  CHECK(s->prepare_step(3).ok());
  fill_step(*s, 3);
  s->commit_step();
  CHECK(s->prepare_step(4).ok());  // 4 -> 8 rows
  CHECK(mem->allocations == 2 && mem->batches == 1 && mem->batch_copies == 64);
  s->abort_step();
  CHECK(rows_intact(*s, 3));
  // Every tensor gets its own non-overlapping rows, 256-byte aligned within the arena.
  for (size_t i = 0; i + 1 < s->tensors().size(); ++i) {
    const auto a = reinterpret_cast<uintptr_t>(s->binding(i).data);
    const auto b = reinterpret_cast<uintptr_t>(s->binding(i + 1).data);
    CHECK((b - a) % 256 == 0 && b >= a + 8 * s->tensors()[i].row_bytes());
  }
}

TEST(old_arena_memory_is_returned_once_the_step_after_a_growth_commits) {
  auto mem = std::make_shared<FailingMemory>();
  Status st;
  auto s = KVStore::create(flat_layers(2, StorageDType::Float32), policy(4, 64), 8, mem, &st);
  CHECK(st.ok());
  CHECK(s->prepare_step(3).ok());
  s->commit_step();
  CHECK(mem->returns == 0);  // no growth, nothing released
  CHECK(s->prepare_step(4).ok() && s->capacity() == 8);
  CHECK(mem->returns == 0);  // the copy out of the old arena may still be running
  s->abort_step();
  CHECK(mem->returns == 0);
  CHECK(s->prepare_step(1).ok());
  s->commit_step();
  CHECK(mem->returns == 1);  // the next completed step returns it
  CHECK(s->prepare_step(1).ok());
  s->commit_step();
  CHECK(mem->returns == 1);  // once
  CHECK(s->reset(true).ok());
  CHECK(mem->returns == 2);  // shrinking releases an arena too
}

TEST(reset_with_release_returns_to_initial_allocation) {
  Status st;
  auto s = KVStore::create(flat_layers(2, StorageDType::BFloat16), policy(4, 64), 8, host_memory(), &st);
  const size_t initial = s->metrics().allocated_bytes;
  for (int i = 0; i < 20; ++i) {
    CHECK(s->prepare_step(1).ok());
    s->commit_step();
  }
  CHECK(s->metrics().allocated_bytes > initial);
  CHECK(s->reset(false).ok());
  CHECK(s->length() == 0 && s->metrics().allocated_bytes > initial);
  CHECK(s->reset(true).ok());
  CHECK(s->metrics().allocated_bytes == initial && s->capacity() == 4);
}

TEST(ring_layers_are_allocated_once_and_bound_max_write) {
  auto tensors = flat_layers(2, StorageDType::Float32);
  for (auto& t : tensors)
    if (t.layer == 1) {
      t.kind = LayerKind::Ring;
      t.window = 6;
    }
  Status st;
  auto s = KVStore::create(tensors, policy(4, 1000), 3, host_memory(), &st);
  CHECK(st.ok());
  const size_t ring_bytes = 2 * (6 + 3 - 1) * 2 * 4 * 4;
  StoreMetrics m = s->metrics();
  CHECK(m.layers.size() == 2 && m.layers[1].rows == 8 && m.layers[1].bytes == ring_bytes);
  Status wide = s->prepare_step(4);
  CHECK(!wide.ok() && wide.message().find("max_write 3") != std::string::npos);
  for (int i = 0; i < 100; ++i) {
    CHECK(s->prepare_step(3).ok());
    CHECK(s->binding(2).rows == 8);
    s->commit_step();
  }
  CHECK(s->metrics().layers[1].bytes == ring_bytes);
  CHECK(s->length() == 300);
}

TEST(step_width_spec_parses_or_names_the_problem) {
  StepWidthLocator at;
  CHECK(parse_step_width("0:1", &at).ok() && at.input_index == 0 && at.dim == 1);
  CHECK(parse_step_width("12:3", &at).ok() && at.input_index == 12 && at.dim == 3);
  for (const char* bad : {"", "1", "a:1", "1:", ":1", "1:2:3", "-1:0"}) {
    Status s = parse_step_width(bad, &at);
    CHECK(!s.ok() && s.message().find("input_index:dim") != std::string::npos);
  }
}

namespace {
std::vector<uint8_t> build_manifest(uint32_t version, int8_t dtype = 2, bool with_key = true, bool with_inputs = true) {
  namespace fb = offgraph_kv::schema;
  flatbuffers::FlatBufferBuilder b;
  // tokens Long [1, T], positions Long [T, 1]
  const fb::InputDim tokens[] = {{fb::DimKind::Static, 1}, {fb::DimKind::StepWidth, 0}};
  const fb::InputDim pos[] = {{fb::DimKind::StepWidth, 0}, {fb::DimKind::Static, 1}};
  std::vector<flatbuffers::Offset<fb::UserInput>> us = {
      fb::CreateUserInput(b, 4, b.CreateVectorOfStructs(tokens, 2)),
      fb::CreateUserInput(b, 4, b.CreateVectorOfStructs(pos, 2))};
  auto inputs = b.CreateVector(us);
  std::vector<flatbuffers::Offset<fb::PrivateTensor>> ts;
  for (uint32_t i = 0; i < 2; ++i)
    ts.push_back(fb::CreatePrivateTensor(b, 0, i == 0 ? fb::TensorRole::Key : fb::TensorRole::Value,
                                         fb::LayerKind::Flat, 0, 2, 8, static_cast<fb::StorageDType>(dtype), 2 + i));
  auto target = b.CreateString("cpu:scalar");
  auto key = with_key ? b.CreateString("code") : 0;
  auto vec = b.CreateVector(ts);
  fb::ManifestBuilder mb(b);
  mb.add_version(version);
  mb.add_target(target);
  if (with_key) mb.add_compiled_code_key(key);
  mb.add_tensors(vec);
  mb.add_batch(1);
  mb.add_num_user_inputs(2);
  mb.add_num_outputs(1);
  mb.add_max_write(32);
  mb.add_capacity_bound(1 << 20);
  mb.add_initial_capacity(16);
  mb.add_max_capacity(1024);
  mb.add_growth_factor(2.0f);
  mb.add_width_bound(32);
  if (with_inputs) mb.add_inputs(inputs);
  b.Finish(mb.Finish(), fb::ManifestIdentifier());
  return {b.GetBufferPointer(), b.GetBufferPointer() + b.GetSize()};
}
}  // namespace

TEST(manifest_reader_accepts_valid_and_rejects_bad_manifests) {
  ManifestInfo info;
  auto good = build_manifest(kManifestVersion);
  CHECK(read_manifest(good.data(), good.size(), &info).ok());
  CHECK(info.tensors.size() == 2 && info.tensors[1].compiled_input == 3 && info.defaults.max_capacity == 1024);

  Status truncated = read_manifest(good.data(), good.size() / 2, &info);
  CHECK(!truncated.ok());
  auto corrupt = good;
  for (size_t i = 8; i < corrupt.size(); i += 3) corrupt[i] ^= 0x5a;
  CHECK(!read_manifest(corrupt.data(), corrupt.size(), &info).ok());
  const char junk[] = "definitely not a manifest";
  Status j = read_manifest(junk, sizeof(junk), &info);
  CHECK(!j.ok() && j.message().find("OGKV") != std::string::npos);

  auto future = build_manifest(kManifestVersion + 1);
  Status v = read_manifest(future.data(), future.size(), &info);
  CHECK(!v.ok() && v.message().find("version " + std::to_string(kManifestVersion + 1)) != std::string::npos);
  auto odd_dtype = build_manifest(kManifestVersion, 9);
  Status d = read_manifest(odd_dtype.data(), odd_dtype.size(), &info);
  CHECK(!d.ok() && d.message().find("storage dtype 9") != std::string::npos);
  auto keyless = build_manifest(kManifestVersion, 2, false);
  Status k = read_manifest(keyless.data(), keyless.size(), &info);
  CHECK(!k.ok() && k.message().find("required field") != std::string::npos);
  auto no_inputs = build_manifest(kManifestVersion, 2, true, false);
  Status n = read_manifest(no_inputs.data(), no_inputs.size(), &info);
  CHECK(!n.ok() && n.message().find("inputs is missing") != std::string::npos);
}

TEST(code_digest_is_sha256_and_a_flipped_byte_is_named_at_load) {
  CHECK(sha256_hex("", 0) == "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
  CHECK(sha256_hex("abc", 3) == "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
  const std::string two_blocks = "abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq";  // 56 bytes: padding spills
  CHECK(sha256_hex(two_blocks.data(), two_blocks.size()) ==
        "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1");
  std::vector<uint8_t> code(100000);
  for (size_t i = 0; i < code.size(); ++i) code[i] = uint8_t(i * 7 + 3);
  const std::string key = "offgraph_kv_" + sha256_hex(code.data(), code.size()).substr(0, 32) + "_so";
  CHECK(verify_code_digest(key, code.data(), code.size()).ok());
  code[4242] ^= 1;
  Status bad = verify_code_digest(key, code.data(), code.size());
  CHECK(!bad.ok() && bad.message().find("corrupt") != std::string::npos);
  CHECK(!verify_code_digest("code", code.data(), code.size()).ok());
}

TEST(step_inputs_must_match_what_was_compiled) {
  ManifestInfo info;
  auto good = build_manifest(kManifestVersion);
  CHECK(read_manifest(good.data(), good.size(), &info).ok());
  CHECK(info.inputs.size() == 2 && info.inputs[1].dims[0].kind == DimKind::StepWidth);
  const int kLong = 4, kInt = 3, kFloat = 6;
  const int32_t tokens[] = {1, 7}, pos[] = {7, 1}, pos_other[] = {5, 1}, batch2[] = {2, 7}, pos3[] = {7, 1, 1};
  CHECK(check_input(0, info.inputs[0], kLong, tokens, 2, 7).ok());
  CHECK(check_input(1, info.inputs[1], kLong, pos, 2, 7).ok());
  Status w = check_input(1, info.inputs[1], kLong, pos_other, 2, 7);
  CHECK(!w.ok() && w.message().find("input 1") != std::string::npos &&
        w.message().find("step width is 7") != std::string::npos);
  Status b = check_input(0, info.inputs[0], kLong, batch2, 2, 7);
  CHECK(!b.ok() && b.message().find("dim 0: extent 2, compiled for 1") != std::string::npos);
  Status r = check_input(1, info.inputs[1], kLong, pos3, 3, 7);
  CHECK(!r.ok() && r.message().find("rank 3") != std::string::npos);
  Status i32 = check_input(0, info.inputs[0], kInt, tokens, 2, 7);
  CHECK(!i32.ok() && i32.message().find("dtype Int, compiled for Long") != std::string::npos);
  Status f = check_input(1, info.inputs[1], kFloat, pos, 2, 7);
  CHECK(!f.ok() && f.message().find("dtype Float") != std::string::npos);
}

TEST(backend_options_override_defaults_all_or_nothing) {
  executorch::runtime::BackendOption opts[2] = {};
  std::strcpy(opts[0].key, "max_capacity");
  opts[0].value = 512;
  std::strcpy(opts[1].key, "bogus");
  opts[1].value = 1;
  Status bad = apply_options({opts, 2});
  CHECK(!bad.ok() && bad.message().find("bogus") != std::string::npos);
  GrowthPolicy defaults = policy(16, 4096);
  CHECK(resolve_policy(defaults, {}).max_capacity == 4096);  // nothing applied
  CHECK(apply_options({opts, 1}).ok());
  CHECK(resolve_policy(defaults, {}).max_capacity == 512);
  opts[0].value = 0;
  CHECK(apply_options({opts, 1}).ok());
  CHECK(resolve_policy(defaults, {}).max_capacity == 4096);
}

#ifdef OFFGRAPH_KV_WITH_CUDA
// On a GPU: a growth through each copy mode keeps every committed byte of
// every tensor, including rows that are not a multiple of 16 bytes and tensors
// large enough to need many blocks. Without a usable device it says SKIP.
TEST(cuda_growth_keeps_every_byte_in_each_copy_mode) {
  const char* modes[] = {"kernel", "batch", "each"};
  for (const char* name : modes) {
    CopyMode mode = CopyMode::Auto;
    CHECK(parse_copy_mode(name, &mode));
    Status st;
    std::unique_ptr<StepIO> io = cuda_step_io(&st, mode);
    if (!io) {
      std::printf("  SKIP %s: %s\n", name, st.message().c_str());
      continue;
    }
    // 3 fp16 heads x 5 dims = 30-byte rows (ragged), and 8 x 128 bf16 = 2 KiB rows.
    std::vector<TensorSpec> tensors = flat_layer_specs(2, 3, 5, StorageDType::Float16, 0);
    for (const TensorSpec& t : flat_layer_specs(3, 8, 128, StorageDType::BFloat16, 0)) tensors.push_back(t);
    auto s = KVStore::create(tensors, policy(1000, 4000), 1000, io->memory(), &st);
    CHECK(st.ok() && s != nullptr);
    if (!s) continue;
    CHECK(s->prepare_step(999).ok());
    std::vector<std::vector<unsigned char>> written(tensors.size());
    for (size_t i = 0; i < tensors.size(); ++i) {
      written[i].resize(999 * tensors[i].row_bytes());
      for (size_t b = 0; b < written[i].size(); ++b) written[i][b] = (unsigned char)((b * 131 + i * 17) >> 3);
      CHECK(cudaMemcpy(s->binding(i).data, written[i].data(), written[i].size(), cudaMemcpyHostToDevice) ==
            cudaSuccess);
    }
    s->commit_step();
    CHECK(s->prepare_step(2).ok() && s->capacity() == 2000);  // the growth under test
    io->memory()->synchronize();
    for (size_t i = 0; i < tensors.size(); ++i) {
      std::vector<unsigned char> back(written[i].size());
      CHECK(cudaMemcpy(back.data(), s->binding(i).data, back.size(), cudaMemcpyDeviceToHost) == cudaSuccess);
      CHECK(back == written[i]);
    }
    s->abort_step();
    std::printf("  %s: ok\n", name);
  }
}

// On a GPU: after each growth's step, the device holds the arena in use, not
// every arena the store ever had (the pool gives old arenas back).
TEST(cuda_device_memory_follows_the_arena_after_each_growth) {
  Status st;
  std::unique_ptr<StepIO> io = cuda_step_io(&st);
  if (!io) {
    std::printf("  SKIP: %s\n", st.message().c_str());
    return;
  }
  auto used = [] {
    size_t free_bytes = 0, total = 0;
    cudaMemGetInfo(&free_bytes, &total);
    return total - free_bytes;
  };
  const size_t baseline = used();
  // 4 layers of 8 x 128 bf16: 16 KiB per row; 32 MiB at 2048 rows, 256 MiB at 16384.
  auto s = KVStore::create(flat_layer_specs(4, 8, 128, StorageDType::BFloat16, 0), policy(2048, 16384), 1, io->memory(),
                           &st);
  CHECK(st.ok() && s != nullptr);
  if (!s) return;
  size_t grown_to = 0;
  for (size_t rows : {2048, 4096, 8192, 16384}) {
    CHECK(s->prepare_step(rows - s->length()).ok() && s->capacity() == rows);
    s->commit_step();
    grown_to = s->metrics().allocated_bytes;
    const double used_mib = double(used() - baseline) / (1 << 20);
    std::printf("  capacity %zu: arena %.0f MiB, device memory used %.0f MiB\n", rows, grown_to / 1048576.0, used_mib);
    // Pool granularity and driver bookkeeping, not a second arena (the previous one is half the size).
    CHECK(used() - baseline <= grown_to + (16u << 20));
  }
  s.reset();
  io->memory()->return_unused();
  CHECK(used() - baseline <= (16u << 20));
}
#endif

int main() {
  for (auto& [name, fn] : registry()) {
    const int before = g_failures;
    fn();
    std::printf("%s %s\n", g_failures == before ? "PASS" : "FAIL", name);
  }
  std::printf("%zu tests, %d failed checks\n", registry().size(), g_failures);
  return g_failures == 0 ? 0 : 1;
}
