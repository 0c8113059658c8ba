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

// `weights`, when given, adds the manifest's weight list (weights outside the code).
inline std::vector<uint8_t> build_manifest(uint32_t version, int8_t dtype = 2, bool with_key = true,
                                           bool with_inputs = true,
                                           const std::function<WeightList(flatbuffers::FlatBufferBuilder&)>& weights = {}) {
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
  b.Finish(mb.Finish(), fb::ManifestIdentifier());
  return {b.GetBufferPointer(), b.GetBufferPointer() + b.GetSize()};
}

}  // namespace offgraph_kv::testing
