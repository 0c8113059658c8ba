// Weights outside the compiled code: the manifest's weight list is read and
// each entry's own consistency checked (the binding itself needs compiled code:
// tests/test_weights_outside_code.py).
#include <cstdint>
#include <string>
#include <vector>

#include "harness.h"
#include "manifest_fixture.h"
#include "manifest_reader.h"

using namespace offgraph_kv;
using namespace offgraph_kv::testing;

namespace {
// A valid manifest plus one weight of the given geometry (weights outside the code).
std::vector<uint8_t> manifest_with_weight(std::vector<int64_t> sizes, std::vector<int64_t> strides, uint64_t nbytes,
                                          int32_t dtype, int copies = 1) {
  namespace fb = offgraph_kv::schema;
  return build_manifest(kManifestVersion, 2, true, true, [&](flatbuffers::FlatBufferBuilder& b) {
    std::vector<flatbuffers::Offset<fb::Weight>> ws;
    for (int i = 0; i < copies; ++i)
      ws.push_back(fb::CreateWeight(b, b.CreateString("layers_0_w"), b.CreateString("layers.0.w"),
                                    b.CreateString("key0"), dtype, nbytes, b.CreateVector(sizes),
                                    b.CreateVector(strides), 0));
    return b.CreateVector(ws);
  });
}
}  // namespace

TEST(weight_specs_are_read_and_views_outside_their_bytes_are_named) {
  ManifestInfo info;
  auto good = manifest_with_weight({4, 8}, {8, 1}, 4 * 8 * 2, 15);  // bf16 [4, 8]
  CHECK(read_manifest(good.data(), good.size(), &info).ok());
  CHECK(info.weights_outside_code() && info.weights.size() == 1 && info.weights[0].fqn == "layers.0.w" &&
        info.weights[0].sizes == std::vector<int64_t>({4, 8}) && info.weights[0].nbytes == 64);
  auto past_end = manifest_with_weight({5, 8}, {8, 1}, 64, 15);
  Status s = read_manifest(past_end.data(), past_end.size(), &info);
  CHECK(!s.ok() && s.message().find("'layers.0.w': its view reads element 39 of 32") != std::string::npos);
  auto odd_dtype = manifest_with_weight({4, 8}, {8, 1}, 64, 42);
  s = read_manifest(odd_dtype.data(), odd_dtype.size(), &info);
  CHECK(!s.ok() && s.message().find("dtype code 42 is not supported") != std::string::npos);
  auto ragged = manifest_with_weight({4, 8}, {8}, 64, 15);
  s = read_manifest(ragged.data(), ragged.size(), &info);
  CHECK(!s.ok() && s.message().find("2 sizes but 1 strides") != std::string::npos);
  auto huge = manifest_with_weight({int64_t(1) << 40, int64_t(1) << 40}, {int64_t(1) << 40, 1}, 64, 15);
  s = read_manifest(huge.data(), huge.size(), &info);
  CHECK(!s.ok());
  auto twice = manifest_with_weight({4, 8}, {8, 1}, 64, 15, 2);
  s = read_manifest(twice.data(), twice.size(), &info);
  CHECK(!s.ok() && s.message().find("listed twice") != std::string::npos);
}
