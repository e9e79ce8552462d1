// Turning an n-gram hash call's buffers and attributes into kernel parameters,
// for the CPU and CUDA handlers alike: checks them against each other and
// fills NgramHashParams, or returns an ffi::Error naming what does not fit.
// Header-only.
#pragma once

#include <cstdint>
#include <string>

#include "kernels/ngram_hash.h"
#include "xla/ffi/api/ffi.h"

namespace engram {

namespace ffi = xla::ffi;

inline ffi::Error HashArgError(const std::string& what) {
  return ffi::Error::InvalidArgument("engram_jax hash_ngrams: " + what);
}

template <typename B>
std::string ShapeString(const B& buffer) {
  std::string s = "[";
  const auto dims = buffer.dimensions();
  for (size_t i = 0; i < dims.size(); ++i) s += (i ? ", " : "") + std::to_string(dims[i]);
  return s + "]";
}

inline ffi::Error PrepareNgramHash(ffi::Buffer<ffi::S32> tokens, ffi::Buffer<ffi::S32> segments,
                                   ffi::Buffer<ffi::S32> positions, ffi::Buffer<ffi::S32> state,
                                   ffi::Buffer<ffi::U32> multipliers, ffi::Buffer<ffi::S32> primes,
                                   ffi::Buffer<ffi::S32> offsets, ffi::ResultBuffer<ffi::S32> out, int64_t pad_id,
                                   int64_t vocab_size, NgramHashParams* p) {
  if (tokens.dimensions().size() != 1) return HashArgError("tokens must be 1-D, got " + ShapeString(tokens));
  const int64_t num_tokens = tokens.dimensions()[0];
  if (segments.dimensions().size() != 1 || segments.dimensions()[0] != num_tokens ||
      positions.dimensions().size() != 1 || positions.dimensions()[0] != num_tokens) {
    return HashArgError("segments and positions must be [" + std::to_string(num_tokens) + "], got " +
                        ShapeString(segments) + " and " + ShapeString(positions));
  }
  const auto mdims = multipliers.dimensions();
  if (mdims.size() != 3 || mdims[2] != 2 || mdims[0] < 1 || mdims[1] < 2 || mdims[1] > kMaxNgram) {
    return HashArgError("multipliers must be [layers, max_ngram in 2.." + std::to_string(kMaxNgram) + ", 2], got " +
                        ShapeString(multipliers));
  }
  const int64_t num_layers = mdims[0];
  const int64_t max_ngram = mdims[1];
  const auto pdims = primes.dimensions();
  if (pdims.size() != 2 || pdims[0] != num_layers || pdims[1] < 1 || pdims[1] % (max_ngram - 1) != 0) {
    return HashArgError("primes must be [layers, (max_ngram - 1) * n_heads], got " + ShapeString(primes));
  }
  const int64_t num_cols = pdims[1];
  // The kernels index a token's (layer, column) pairs in 32 bits.
  if (num_cols > INT32_MAX / num_layers) {
    return HashArgError("layers * columns must be at most 2**31 - 1, got " + std::to_string(num_layers) + " * " +
                        std::to_string(num_cols));
  }
  const auto odims = offsets.dimensions();
  if (odims.size() != 2 || odims[0] != num_layers || odims[1] != num_cols) {
    return HashArgError("offsets must have the shape of primes " + ShapeString(primes) + ", got " +
                        ShapeString(offsets));
  }
  const auto sdims = state.dimensions();
  if (sdims.size() != 2 || sdims[1] != max_ngram - 1) {
    return HashArgError("state must be [sequences, " + std::to_string(max_ngram - 1) + "], got " + ShapeString(state));
  }
  const auto rdims = out->dimensions();
  if (rdims.size() != 3 || rdims[0] != num_tokens || rdims[1] != num_layers || rdims[2] != num_cols) {
    return HashArgError("output must be [tokens, layers, columns] = [" + std::to_string(num_tokens) + ", " +
                        std::to_string(num_layers) + ", " + std::to_string(num_cols) + "]");
  }
  if (vocab_size < 1 || vocab_size > INT32_MAX || pad_id < 0 || pad_id >= vocab_size) {
    return HashArgError("need 0 <= pad_id < vocab_size <= 2**31 - 1, got pad_id " + std::to_string(pad_id) +
                        ", vocab_size " + std::to_string(vocab_size));
  }
  p->tokens = tokens.typed_data();
  p->segments = segments.typed_data();
  p->positions = positions.typed_data();
  p->state = state.typed_data();
  p->multipliers = multipliers.typed_data();
  p->primes = primes.typed_data();
  p->offsets = offsets.typed_data();
  p->out = out->typed_data();
  p->num_tokens = num_tokens;
  p->num_states = sdims[0];
  p->num_layers = static_cast<int32_t>(num_layers);
  p->num_cols = static_cast<int32_t>(num_cols);
  p->max_ngram = static_cast<int32_t>(max_ngram);
  p->n_heads = static_cast<int32_t>(num_cols / (max_ngram - 1));
  p->pad_id = static_cast<int32_t>(pad_id);
  p->vocab_size = static_cast<int32_t>(vocab_size);
  return ffi::Error::Success();
}

}  // namespace engram
