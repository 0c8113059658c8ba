// Each step's inputs against what was compiled.
#include "input_spec.h"
#include "manifest_reader.h"
#include "harness.h"
#include "manifest_fixture.h"

using namespace offgraph_kv;
using namespace offgraph_kv::testing;

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
