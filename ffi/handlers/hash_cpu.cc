// XLA FFI handler of the n-gram hash on the CPU platform: decodes the call
// (hash_args.h) and runs the framework-free hash in kernels/ngram_hash.h.
#include "handlers/hash_args.h"
#include "handlers/no_throw.h"
#include "handlers/symbols.h"
#include "kernels/ngram_hash.h"

namespace engram {
namespace {

ffi::Error NgramHashCpuImpl(ffi::Buffer<ffi::S32> tokens, ffi::Buffer<ffi::S32> segments,
                            ffi::Buffer<ffi::S32> positions, ffi::Buffer<ffi::S32> state,
                            ffi::Buffer<ffi::U32> multipliers, ffi::Buffer<ffi::S32> primes,
                            ffi::Buffer<ffi::S32> offsets, ffi::ResultBuffer<ffi::S32> out, int64_t pad_id,
                            int64_t vocab_size) {
  NgramHashParams params;
  if (ffi::Error err = PrepareNgramHash(tokens, segments, positions, state, multipliers, primes, offsets, out, pad_id,
                                        vocab_size, &params);
      err.failure()) {
    return err;
  }
  NgramHashCpu(params);
  return ffi::Error::Success();
}

}  // namespace
}  // namespace engram

XLA_FFI_DEFINE_HANDLER_SYMBOL(EngramNgramHashCpu, engram::NoThrow<engram::NgramHashCpuImpl>,
                              xla::ffi::Ffi::Bind()
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()  // tokens [T]: compressed ids, -1 DEAD
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()  // segments [T]: sequence (state row)
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()  // positions [T]: position in sequence
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()  // state [B, N-1]: lookback ids
                                  .Arg<xla::ffi::Buffer<xla::ffi::U32>>()  // multipliers [L, N, 2]: lo/hi halves
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()  // primes [L, C]: column table sizes
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()  // offsets [L, C]: column first rows
                                  .Ret<xla::ffi::Buffer<xla::ffi::S32>>()  // row ids [T, L, C]
                                  .Attr<int64_t>("pad_id")                 // compressed pad id
                                  .Attr<int64_t>("vocab_size"));           // compressed vocabulary size
