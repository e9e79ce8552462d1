// The Python bindings of the hot-row cache and the cached lookup's workspace
// size, added to the one NB_MODULE by bindings/module.cc.
#pragma once

#include <nanobind/nanobind.h>

namespace engram {

void BindCache(nanobind::module_& m);

}  // namespace engram
