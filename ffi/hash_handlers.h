// Symbols of the n-gram hash FFI handlers, for module.cc's registrations().
// The CUDA one is defined only in builds with ENGRAM_HAS_CUDA.
#pragma once

#include "xla/ffi/api/api.h"

XLA_FFI_DECLARE_HANDLER_SYMBOL(EngramNgramHashCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(EngramNgramHashCuda);
