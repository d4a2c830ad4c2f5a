// Declaration-only stand-in, see ../../README.md.
#pragma once

namespace gloo {
namespace transport {
// Held only through smart pointers by ProcessGroupGloo and its Options.
class Device;
class UnboundBuffer;
} // namespace transport
} // namespace gloo
