// A result code plus the message that names the problem. The delegate boundary
// turns it into an ExecuTorch Error and logs the message.
#pragma once

#include <executorch/runtime/core/error.h>

#include <string>
#include <utility>

namespace offgraph_kv {

using executorch::runtime::Error;

class Status {
 public:
  Status() = default;
  Status(Error code, std::string message) : code_(code), message_(std::move(message)) {}
  static Status ok_status() { return {}; }
  bool ok() const { return code_ == Error::Ok; }
  Error code() const { return code_; }
  const std::string& message() const { return message_; }

 private:
  Error code_ = Error::Ok;
  std::string message_;
};

}  // namespace offgraph_kv
