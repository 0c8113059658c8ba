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
}  // namespace

void register_store(const std::shared_ptr<KVStore>& store) {
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

}  // namespace offgraph_kv
