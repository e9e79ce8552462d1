// Symbol of the CPU lookup FFI handler, for module.cc's registrations(); the
// prefetch, cached-lookup and hash handlers are declared in their own headers.
#pragma once

#include "xla/ffi/api/api.h"

XLA_FFI_DECLARE_HANDLER_SYMBOL(EngramLookupCpu);
