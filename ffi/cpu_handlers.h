// Symbols of the CPU FFI handlers, for module.cc's registrations().
#pragma once

#include "xla/ffi/api/api.h"

XLA_FFI_DECLARE_HANDLER_SYMBOL(EngramLookupCpu);
