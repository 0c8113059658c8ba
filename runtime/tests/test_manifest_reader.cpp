// The manifest reader: valid manifests read, bad ones named.
#include <string>

#include "manifest_reader.h"
#include "harness.h"
#include "manifest_fixture.h"

using namespace offgraph_kv;
using namespace offgraph_kv::testing;

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

TEST(manifest_that_disagrees_with_the_compiled_interface_is_refused_naming_the_field) {
  ManifestInfo info;
  auto expect = [&](const CodeFacts& code, const std::string& words) {
    auto bytes = build_manifest(kManifestVersion, 2, true, true, {}, code);
    Status s = read_manifest(bytes.data(), bytes.size(), &info);
    CHECK(!s.ok() && s.message().find(words) != std::string::npos);
  };
  CodeFacts heads;
  heads.heads = 4;  // the code was built for 4 KV heads, the manifest says 2
  expect(heads, "tensor 0 (layer 0 K) is BFloat16 [1, *, 2, 8] at compiled input 2, the code takes BFloat16 [1, *, 4, 8]");
  CodeFacts dim;
  dim.head_dim = 16;
  expect(dim, "[1, *, 2, 16]");
  CodeFacts dtype;
  dtype.kv_dtype = 6;
  expect(dtype, "the code takes Float [1, *, 2, 8]");
  CodeFacts tokens;
  tokens.tokens_dtype = 3;
  expect(tokens, "delegate input 0: manifest says Long, the code takes Int");
  CodeFacts bound;
  bound.width_bound = 8;
  expect(bound, "width_bound is 32, the code was compiled for 8");
  CodeFacts outputs;
  outputs.num_outputs = 2;
  expect(outputs, "num_outputs is 1, the code returns 2");
  CodeFacts missing;
  missing.present = false;
  expect(missing, "compiled_interface is missing");
  CodeFacts packaged;
  packaged.weights_in_code = true;
  auto bytes = build_manifest(kManifestVersion, 2, true, true, {}, packaged);
  CHECK(read_manifest(bytes.data(), bytes.size(), &info).ok() && !info.weights_outside_code());
}
