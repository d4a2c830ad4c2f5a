// Declaration-only stand-in, see ../README.md.
#pragma once
#include <chrono>

namespace gloo {
// Only held through std::shared_ptr by ProcessGroupGloo; its inline setTimeout()
// names this member, which the shim never calls.
class Context {
 public:
  void setTimeout(std::chrono::milliseconds timeout);
};
} // namespace gloo
