// Declaration-only stand-in, see ../../README.md. ProcessGroupGloo.hpp includes this
// header but uses none of its names.
#pragma once
