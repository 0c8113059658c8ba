// A valid manifest (two delegate inputs, one flat layer) that the tests edit.
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

// One test builds a manifest that lacks a required field on purpose; the
// builder's assert would abort a Debug build before the reader could refuse it.
#ifndef FLATBUFFERS_ASSERT
#define FLATBUFFERS_ASSERT(x) ((void)0)
#endif
#include "manifest_generated.h"

namespace offgraph_kv::testing {

using WeightList = flatbuffers::Offset<flatbuffers::Vector<flatbuffers::Offset<offgraph_kv::schema::Weight>>>;

// What the fixture's compiled interface says the code takes; the defaults agree
// with the manifest (Long [1, *] and [*, 1] inputs, K/V [1, *, 2, 8] in the
// manifest's storage dtype, one output, width bound 32).
struct CodeFacts {
  bool present = true;
  int64_t heads = 2;
  int64_t head_dim = 8;
  int32_t kv_dtype = -1;  // -1: the manifest's storage dtype
  int32_t tokens_dtype = 4;
  uint32_t width_bound = 32;
  uint32_t num_outputs = 1;
  bool weights_in_code = false;
};

inline std::vector<uint8_t> build_interface(int8_t storage_dtype, const CodeFacts& code) {
  namespace fb = offgraph_kv::schema;
  static const int32_t kAoti[] = {6, 5, 15};  // Float32, Float16, BFloat16
  const int32_t kv = code.kv_dtype >= 0 ? code.kv_dtype : (storage_dtype >= 0 && storage_dtype < 3 ? kAoti[storage_dtype] : 0);
  flatbuffers::FlatBufferBuilder b;
  std::vector<flatbuffers::Offset<fb::CompiledInput>> ins = {
      fb::CreateCompiledInput(b, code.tokens_dtype, b.CreateVector(std::vector<int64_t>{1, -1})),
      fb::CreateCompiledInput(b, 4, b.CreateVector(std::vector<int64_t>{-1, 1}))};
  for (int i = 0; i < 2; ++i)
    ins.push_back(fb::CreateCompiledInput(b, kv, b.CreateVector(std::vector<int64_t>{1, -1, code.heads, code.head_dim})));
  b.Finish(fb::CreateCompiledInterface(b, b.CreateVector(ins), code.num_outputs, code.width_bound, code.weights_in_code));
  return {b.GetBufferPointer(), b.GetBufferPointer() + b.GetSize()};
}

// `weights`, when given, adds the manifest's weight list (weights outside the code).
inline std::vector<uint8_t> build_manifest(uint32_t version, int8_t dtype = 2, bool with_key = true,
                                           bool with_inputs = true,
                                           const std::function<WeightList(flatbuffers::FlatBufferBuilder&)>& weights = {},
                                           const CodeFacts& code = {}) {
  namespace fb = offgraph_kv::schema;
  flatbuffers::FlatBufferBuilder b;
  const std::vector<uint8_t> interface_bytes = build_interface(dtype, code);
  auto interface = code.present ? b.CreateVector(interface_bytes) : 0;
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
  const WeightList weight_list = weights ? weights(b) : WeightList();
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
  if (weights) mb.add_weights(weight_list);
  if (code.present) mb.add_compiled_interface(interface);
  b.Finish(mb.Finish(), fb::ManifestIdentifier());
  return {b.GetBufferPointer(), b.GetBufferPointer() + b.GetSize()};
}

}  // namespace offgraph_kv::testing
