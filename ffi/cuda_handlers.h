// Symbols of the CUDA FFI handlers, for module.cc's registrations(); only
// compiled into builds with ENGRAM_HAS_CUDA.
#pragma once

#include "xla/ffi/api/api.h"

XLA_FFI_DECLARE_HANDLER_SYMBOL(EngramLookupCuda);
