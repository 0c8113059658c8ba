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
  const std::string key = "offgraph_kv_" + sha256_hex(code.data(), code.size()).substr(0, 32) + "_so";
  CHECK(verify_code_digest(key, code.data(), code.size()).ok());
  code[4242] ^= 1;
  Status bad = verify_code_digest(key, code.data(), code.size());
  CHECK(!bad.ok() && bad.message().find("corrupt") != std::string::npos);
  CHECK(!verify_code_digest("code", code.data(), code.size()).ok());
}
