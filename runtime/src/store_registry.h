// The stores of the methods loaded in this process, oldest first: the control
// face (metrics, reset) that Python reaches through offgraph_kv.runtime.stores().
#pragma once

#include <memory>
#include <vector>

#include "kv_store.h"

namespace offgraph_kv {

void register_store(const std::shared_ptr<KVStore>& store);
// Live stores only; a store whose method was destroyed drops out.
std::vector<std::shared_ptr<KVStore>> live_stores();

}  // namespace offgraph_kv
