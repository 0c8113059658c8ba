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
// The store registered last on the calling thread since the previous call
// (a delegate's init runs on the thread that loads the method), or null; the
// call forgets it. How a host that loads a method finds that method's store
// even while other threads load theirs: take (and drop) before the load, take after.
std::shared_ptr<KVStore> take_last_store_on_this_thread();

}  // namespace offgraph_kv
