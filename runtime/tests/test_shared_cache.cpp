// The per-process sharing behind sessions (shared_cache.h, weights_share_key):
// one object per key while anyone holds it, rebuilt after the last lets go,
// one build per key however many threads ask at once, and a key that changes
// with anything that changes the bytes a program computes with.
#include <atomic>
#include <chrono>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "harness.h"
#include "shared_cache.h"
#include "weights.h"

using namespace offgraph_kv;

namespace {
struct Thing {
  explicit Thing(int v, std::atomic<int>* alive) : value(v), alive(alive) { ++*alive; }
  ~Thing() { --*alive; }
  int value;
  std::atomic<int>* alive;
};

std::vector<WeightSpec> two_weights() {
  WeightSpec a;
  a.name = "w0";
  a.fqn = "layers.0.w";
  a.data_key = "k0";
  a.dtype = 6;
  a.nbytes = 64;
  a.sizes = {4, 4};
  a.strides = {4, 1};
  a.crc32 = 0x1234;
  WeightSpec b = a;
  b.name = "w1";
  b.data_key = "k1";
  return {a, b};
}
}  // namespace

TEST(shared_cache_gives_one_object_per_key_while_held_and_builds_again_after_release) {
  SharedCache<Thing> cache;
  std::atomic<int> alive{0};
  int builds = 0;
  auto build = [&](int v) {
    return [&, v](Status*) {
      ++builds;
      return std::make_unique<Thing>(v, &alive);
    };
  };
  Status s;
  std::shared_ptr<Thing> a = cache.acquire("k", build(1), &s);
  std::shared_ptr<Thing> b = cache.acquire("k", build(2), &s);
  CHECK(s.ok() && a && a == b && a->value == 1 && builds == 1 && alive == 1);
  std::shared_ptr<Thing> other = cache.acquire("other", build(3), &s);
  CHECK(other && other != a && other->value == 3 && builds == 2);
  auto entries = cache.entries();
  CHECK(entries.size() == 2 && entries[0].key == "k" && entries[0].users == 2 && entries[1].users == 1);
  entries.clear();
  a.reset();
  CHECK(alive == 2);  // b still holds it
  b.reset();
  CHECK(alive == 1 && cache.entries().size() == 1);  // released with the last user
  std::shared_ptr<Thing> again = cache.acquire("k", build(4), &s);
  CHECK(again && again->value == 4 && builds == 3);
}

TEST(shared_cache_failed_build_leaves_nothing_and_the_next_acquire_builds) {
  SharedCache<Thing> cache;
  std::atomic<int> alive{0};
  Status s;
  std::shared_ptr<Thing> none = cache.acquire(
      "k", [](Status* st) {
        *st = Status(Error::InvalidProgram, "weights: 'w' is damaged");
        return std::unique_ptr<Thing>();
      }, &s);
  CHECK(!none && !s.ok() && s.message() == "weights: 'w' is damaged" && cache.entries().empty());
  std::shared_ptr<Thing> built = cache.acquire("k", [&](Status*) { return std::make_unique<Thing>(7, &alive); }, &s);
  CHECK(s.ok() && built && built->value == 7);
}

TEST(shared_cache_builds_a_key_once_when_many_threads_ask_at_once) {
  SharedCache<Thing> cache;
  std::atomic<int> alive{0};
  std::atomic<int> builds{0};
  std::vector<std::shared_ptr<Thing>> got(8);
  std::vector<std::thread> threads;
  for (size_t i = 0; i < got.size(); ++i)
    threads.emplace_back([&, i] {
      Status s;
      got[i] = cache.acquire("k", [&](Status*) {
        ++builds;
        std::this_thread::sleep_for(std::chrono::milliseconds(20));  // others arrive while this builds
        return std::make_unique<Thing>(1, &alive);
      }, &s);
    });
  for (std::thread& t : threads) t.join();
  CHECK(builds == 1 && alive == 1);
  for (const auto& g : got) CHECK(g && g == got[0]);
  // Released and re-acquired from many threads: every acquire gets an object,
  // and none is left once all let go. (An object whose last user is leaving
  // may still be in its destructor while the next one is built.)
  threads.clear();
  got.clear();
  for (int t = 0; t < 4; ++t)
    threads.emplace_back([&] {
      for (int i = 0; i < 200; ++i) {
        Status s;
        auto p = cache.acquire("k", [&](Status*) { return std::make_unique<Thing>(2, &alive); }, &s);
        CHECK(p != nullptr && p->value == 2);
      }
    });
  for (std::thread& t : threads) t.join();
  CHECK(alive == 0 && cache.entries().empty());
}

TEST(weights_share_key_changes_with_the_code_the_place_and_every_field_of_the_list) {
  const auto specs = two_weights();
  const std::string key = weights_share_key("offgraph_kv_abc_so", specs, "cpu");
  CHECK(key == weights_share_key("offgraph_kv_abc_so", two_weights(), "cpu"));
  CHECK(key.rfind("offgraph_kv_abc_so|cpu|", 0) == 0);
  CHECK(key != weights_share_key("offgraph_kv_abd_so", specs, "cpu"));
  CHECK(key != weights_share_key("offgraph_kv_abc_so", specs, "cuda:0"));
  std::vector<std::vector<WeightSpec>> edits(7, specs);
  edits[0][1].crc32 ^= 1;
  edits[1][0].data_key = "k9";
  edits[2][1].dtype = 15;
  edits[3][0].nbytes = 128;
  edits[4][0].strides = {1, 4};
  edits[5][1].storage_offset = 4;
  edits[6].pop_back();
  for (const auto& e : edits) CHECK(weights_share_key("offgraph_kv_abc_so", e, "cpu") != key);
  // Fields that run together must not collide: "ab"+"c" vs "a"+"bc".
  auto x = specs, y = specs;
  x[0].name = "ab";
  x[0].fqn = "c";
  y[0].name = "a";
  y[0].fqn = "bc";
  CHECK(weights_share_key("k", x, "cpu") != weights_share_key("k", y, "cpu"));
}

TEST(no_shared_weights_are_held_when_no_program_is_loaded) { CHECK(shared_weights_in_use().empty()); }
