// SharedCache: per-process objects shared by key and reference-counted. Used
// for what every session (delegate init) of one program reads but never writes
// (the weights, weights.cpp): the first session builds it, later ones get the
// same object, and it is destroyed when the last session lets go. A later
// acquire of that key builds it again.
//
// Thread-safety: acquire may be called from any thread. Builds of one key are
// serialised (a second caller waits for the first build and takes its result
// rather than building its own copy); builds of different keys run in parallel.
// The map and the weak references are guarded by one mutex, never held while
// building.
#pragma once

#include <cstddef>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "status.h"

namespace offgraph_kv {

template <typename T>
class SharedCache {
 public:
  struct Entry {
    std::string key;
    long users = 0;                  // references besides this entry's own
    std::shared_ptr<const T> value;  // kept alive only while the caller holds the entry
  };

  // The live object under `key`, or one built by `build(Status*)` (which
  // returns a std::unique_ptr<T>, null with *status set on failure). A failed
  // build leaves nothing behind: the next acquire tries again.
  template <typename Build>
  std::shared_ptr<T> acquire(const std::string& key, Build&& build, Status* status) {
    std::shared_ptr<Slot> slot;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      sweep_locked(key);
      std::shared_ptr<Slot>& s = slots_[key];
      if (!s) s = std::make_shared<Slot>();
      if (std::shared_ptr<T> live = s->value.lock()) {
        *status = Status::ok_status();
        return live;
      }
      slot = s;
    }
    std::lock_guard<std::mutex> building(slot->build);
    {
      std::lock_guard<std::mutex> lock(mutex_);  // built by another thread while this one waited?
      if (std::shared_ptr<T> live = slot->value.lock()) {
        *status = Status::ok_status();
        return live;
      }
    }
    std::unique_ptr<T> made = build(status);
    if (!made) return nullptr;  // the empty slot goes at the next sweep
    // The deleter only destroys the object: the slot (a weak reference) stays
    // until a sweep finds it expired, so no deleter ever touches the map.
    std::shared_ptr<T> value(made.release());
    std::lock_guard<std::mutex> lock(mutex_);
    slot->value = value;
    *status = Status::ok_status();
    return value;
  }

  // The live objects, their keys and how many references (sessions) each has.
  std::vector<Entry> entries() const {
    std::lock_guard<std::mutex> lock(mutex_);
    std::vector<Entry> out;
    for (const auto& [key, slot] : slots_) {
      std::shared_ptr<T> value = slot->value.lock();
      if (!value) continue;
      const long users = value.use_count() - 1;
      out.push_back({key, users, std::move(value)});
    }
    return out;
  }

 private:
  struct Slot {
    std::mutex build;          // serialises builds of this key
    std::weak_ptr<T> value;    // guarded by mutex_
  };

  // Drops slots whose object is gone and that no acquire is using (the map
  // holds the only reference), so the map does not grow with every key ever seen.
  void sweep_locked(const std::string& keep) {
    for (auto it = slots_.begin(); it != slots_.end();) {
      if (it->first != keep && it->second->value.expired() && it->second.use_count() == 1) it = slots_.erase(it);
      else ++it;
    }
  }

  mutable std::mutex mutex_;
  std::map<std::string, std::shared_ptr<Slot>> slots_;
};

}  // namespace offgraph_kv
