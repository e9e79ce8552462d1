// Keeps C++ exceptions from crossing the XLA FFI boundary, where nothing
// catches them: NoThrow<Impl> is handler Impl with any exception (std::bad_alloc,
// std::system_error from a mutex, anything else) returned as an ffi::Error.
// Bind every handler through it: XLA_FFI_DEFINE_HANDLER_SYMBOL(Name, NoThrow<Impl>, ...).
#pragma once

#include <exception>
#include <new>
#include <string>
#include <utility>

#include "xla/ffi/api/ffi.h"

namespace engram {

template <auto kImpl>
struct NoThrowHandler;

template <typename... Args, xla::ffi::Error (*kImpl)(Args...)>
struct NoThrowHandler<kImpl> {
  static xla::ffi::Error Call(Args... args) noexcept {
    // Messages of 15 characters or fewer fit std::string's inline buffer, so
    // the fallbacks allocate nothing.
    try {
      return kImpl(std::move(args)...);
    } catch (const std::bad_alloc&) {
      return xla::ffi::Error(xla::ffi::ErrorCode::kResourceExhausted, "out of memory");
    } catch (const std::exception& e) {
      try {
        return xla::ffi::Error::Internal(std::string("engram_jax: ") + e.what());
      } catch (const std::exception&) {
      }
    } catch (...) {
    }
    return xla::ffi::Error::Internal("C++ exception");
  }
};

template <auto kImpl>
constexpr auto NoThrow = &NoThrowHandler<kImpl>::Call;

}  // namespace engram
