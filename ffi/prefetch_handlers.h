// Symbols of the prefetch (lookup_start / lookup_done) FFI handlers, for
// module.cc's registrations(). The CUDA ones are defined only in builds with
// ENGRAM_HAS_CUDA.
#pragma once

#include "xla/ffi/api/api.h"

XLA_FFI_DECLARE_HANDLER_SYMBOL(EngramLookupStartCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(EngramLookupDoneCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(EngramLookupStartCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(EngramLookupDoneCuda);
