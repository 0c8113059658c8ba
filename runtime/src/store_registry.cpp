#include "store_registry.h"

#include <algorithm>
#include <mutex>

namespace offgraph_kv {

namespace {
std::mutex& registry_mutex() {
  static std::mutex m;
  return m;
}
std::vector<std::weak_ptr<KVStore>>& registry() {
  static std::vector<std::weak_ptr<KVStore>> r;
  return r;
}
thread_local std::weak_ptr<KVStore> t_last;
}  // namespace

void register_store(const std::shared_ptr<KVStore>& store) {
  t_last = store;
  std::lock_guard<std::mutex> lock(registry_mutex());
  auto& r = registry();
  r.erase(std::remove_if(r.begin(), r.end(), [](const std::weak_ptr<KVStore>& w) { return w.expired(); }), r.end());
  r.push_back(store);
}

std::vector<std::shared_ptr<KVStore>> live_stores() {
  std::lock_guard<std::mutex> lock(registry_mutex());
  std::vector<std::shared_ptr<KVStore>> out;
  for (const auto& w : registry())
    if (auto s = w.lock()) out.push_back(std::move(s));
  return out;
}

std::shared_ptr<KVStore> take_last_store_on_this_thread() {
  std::shared_ptr<KVStore> store = t_last.lock();
  t_last.reset();
  return store;
}

}  // namespace offgraph_kv
