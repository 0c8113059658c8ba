// SHA-256 of the compiled code and its check at load.
#include <cstdint>
#include <string>
#include <vector>

#include "code_digest.h"
#include "harness.h"

using namespace offgraph_kv;
using namespace offgraph_kv::testing;

TEST(code_digest_is_sha256_and_a_flipped_byte_is_named_at_load) {
  CHECK(sha256_hex("", 0) == "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
  CHECK(sha256_hex("abc", 3) == "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
  const std::string two_blocks = "abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq";  // 56 bytes: padding spills
  CHECK(sha256_hex(two_blocks.data(), two_blocks.size()) ==
        "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1");
  std::vector<uint8_t> code(100000);
  for (size_t i = 0; i < code.size(); ++i) code[i] = uint8_t(i * 7 + 3);
  std::vector<uint8_t> interface = {1, 2, 3, 4, 5};
  std::vector<uint8_t> both(code);
  both.insert(both.end(), interface.begin(), interface.end());
  // The key covers the code, then its interface.
  const std::string key = "offgraph_kv_" + sha256_hex(both.data(), both.size()).substr(0, 32) + "_so";
  CHECK(verify_code_digest(key, code.data(), code.size(), interface).ok());
  interface[2] ^= 1;
  CHECK(!verify_code_digest(key, code.data(), code.size(), interface).ok());
  interface[2] ^= 1;
  code[4242] ^= 1;
  Status bad = verify_code_digest(key, code.data(), code.size(), interface);
  CHECK(!bad.ok() && bad.message().find("corrupt") != std::string::npos);
  CHECK(!verify_code_digest("code", code.data(), code.size(), interface).ok());
}

TEST(incremental_sha256_equals_one_shot_at_every_split) {
  std::vector<uint8_t> data(300);
  for (size_t i = 0; i < data.size(); ++i) data[i] = uint8_t(i * 13 + 1);
  const std::string whole = sha256_hex(data.data(), data.size());
  for (size_t split : {size_t(0), size_t(1), size_t(55), size_t(63), size_t(64), size_t(65), size_t(200), size_t(300)}) {
    Sha256 h;
    h.update(data.data(), split);
    h.update(data.data() + split, data.size() - split);
    CHECK(h.hex() == whole);
  }
}
