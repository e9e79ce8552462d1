// XLA FFI handler of the n-gram hash on CUDA: decodes the call (hash_args.h),
// launches the framework-free kernel from kernels/ngram_hash.cuh on XLA's
// stream and turns a launch error into an ffi::Error. No host copies.
#include <cuda_runtime.h>

#include "handlers/cuda_errors.h"
#include "handlers/hash_args.h"
#include "handlers/no_throw.h"
#include "handlers/symbols.h"
#include "kernels/ngram_hash.cuh"
#include "runtime/capture_count.h"
#include "runtime/stream_capture.h"

namespace engram {
namespace {

ffi::Error NgramHashCudaImpl(cudaStream_t stream, ffi::Buffer<ffi::S32> tokens, ffi::Buffer<ffi::S32> segments,
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
  if (cudaError_t err = LaunchNgramHash(params, stream); err != cudaSuccess) {
    return CudaError("hash_ngrams launch", err);
  }
  bool capturing = false;
  if (cudaError_t err = IsCapturing(stream, &capturing); err != cudaSuccess) {
    return CudaError("hash_ngrams capture status", err);
  }
  if (capturing) CaptureCounter(CapturedCall::kNgramHash).fetch_add(1, std::memory_order_relaxed);
  return ffi::Error::Success();
}

}  // namespace
}  // namespace engram

// Command-buffer compatible: one kernel launch whose every input is an operand,
// so a graph replaying it stays right; XLA need not split its graph at the hash.
XLA_FFI_DEFINE_HANDLER_SYMBOL(EngramNgramHashCuda, engram::NoThrow<engram::NgramHashCudaImpl>,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()  // XLA's compute stream
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()         // tokens [T]: compressed ids, -1 DEAD
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()         // segments [T]: sequence (state row)
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()         // positions [T]: position in sequence
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()         // state [B, N-1]: lookback ids
                                  .Arg<xla::ffi::Buffer<xla::ffi::U32>>()         // multipliers [L, N, 2]: lo/hi halves
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()         // primes [L, C]: column table sizes
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()         // offsets [L, C]: column first rows
                                  .Ret<xla::ffi::Buffer<xla::ffi::S32>>()         // row ids [T, L, C]
                                  .Attr<int64_t>("pad_id")                        // compressed pad id
                                  .Attr<int64_t>("vocab_size"),                   // compressed vocabulary size
                              {xla::ffi::Traits::kCmdBufferCompatible});
