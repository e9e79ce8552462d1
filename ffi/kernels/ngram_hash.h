// DeepSeek's Engram n-gram hash: compressed token ids -> int32 row ids of each
// layer's concatenated table, exact 64-bit products and XOR. One element is a
// pure function shared verbatim by the CPU loop and the CUDA kernel, so both
// backends return the same ids. No XLA types here.
#pragma once

#include <cstdint>

#include "kernels/host_device.h"

namespace engram {

constexpr int32_t kDeadToken = -1;  // a token outside every n-gram (padding, image slots)
constexpr int32_t kDeadRow = -1;    // DEAD_ID: the row id a DEAD token gets in every column
// Longest n-gram accepted: the CPU path keeps a window array of this size.
constexpr int kMaxNgram = 16;

struct NgramHashParams {
  const int32_t* tokens;        // [num_tokens] compressed ids, -1 = DEAD
  const int32_t* segments;      // [num_tokens] which sequence (state row) each token continues
  const int32_t* positions;     // [num_tokens] position of each token in its sequence (0 = first)
  const int32_t* state;         // [num_states, max_ngram - 1] last ids before this call, oldest first
  const uint32_t* multipliers;  // [num_layers, max_ngram, 2] (low, high) 32-bit halves of the odd multipliers
  const int32_t* primes;        // [num_layers, num_cols] table size of each column
  const int32_t* offsets;       // [num_layers, num_cols] first row of each column in the layer table
  int32_t* out;                 // [num_tokens, num_layers, num_cols]
  int64_t num_tokens;
  int64_t num_states;
  int32_t num_layers;
  int32_t num_cols;
  int32_t max_ngram;   // N: orders 2..N, window of N ids
  int32_t n_heads;     // columns per order
  int32_t pad_id;      // compressed pad id
  int32_t vocab_size;  // compressed vocabulary size; ids outside [0, vocab) hash as pad
};

ENGRAM_HD uint64_t HashInput(const NgramHashParams& p, int32_t id) {
  return static_cast<uint64_t>((id >= 0 && id < p.vocab_size) ? id : p.pad_id);
}

// Walks back from token t, yielding the id hashed at each shift s = 1, 2, ...
// (call Next with s in increasing order; shift 0 is the token itself). Shift
// s reads, in order: pad if position - s is before the sequence start; token
// t - s of this call if every token between is the same sequence at
// consecutive positions; else the sequence's lookback state. A DEAD id (or a
// state row that does not exist) turns that shift and every older one to pad.
// No arrays, so the CUDA kernel keeps everything in registers.
struct WindowWalker {
  const NgramHashParams& p;
  int64_t t;
  int32_t segment;
  int64_t position;
  bool in_call = true;
  bool blocked = false;
  int64_t run = 0;  // how many tokens before t in this call belong to its sequence

  ENGRAM_HD WindowWalker(const NgramHashParams& params, int64_t token)
      : p(params), t(token), segment(params.segments[token]), position(params.positions[token]) {}

  ENGRAM_HD uint64_t Next(int s) {
    if (!blocked && position - s < 0) blocked = true;
    if (!blocked && in_call) {
      in_call = t - s >= 0 && p.segments[t - s] == segment && p.positions[t - s] == position - s;
      if (in_call) run = s;
    }
    int32_t id = kDeadToken;
    if (!blocked) {
      if (in_call) {
        id = p.tokens[t - s];
      } else if (segment >= 0 && segment < p.num_states) {
        const int64_t window = p.max_ngram - 1;
        id = p.state[segment * window + window - (s - run)];
      }
      if (id == kDeadToken) blocked = true;
    }
    return blocked ? static_cast<uint64_t>(p.pad_id) : HashInput(p, id);
  }
};

ENGRAM_HD uint64_t Multiplier(const NgramHashParams& p, int layer, int s) {
  const uint32_t* m = p.multipliers + (static_cast<int64_t>(layer) * p.max_ngram + s) * 2;
  return static_cast<uint64_t>(m[0]) | (static_cast<uint64_t>(m[1]) << 32);
}

ENGRAM_HD int32_t RowOf(const NgramHashParams& p, uint64_t h, int layer, int col) {
  const int64_t at = static_cast<int64_t>(layer) * p.num_cols + col;
  const int32_t prime = p.primes[at];
  if (prime <= 0) return kDeadRow;  // never from a valid layout; avoids a division by zero
  // In 64 bits: residue + offset passes int32 for an offset near 2**31. A row
  // past int32 comes from no valid layout (every row id is an int32), so it
  // is DEAD rather than a wrapped id.
  const int64_t row = static_cast<int64_t>(h % static_cast<uint64_t>(prime)) + p.offsets[at];
  return row <= INT32_MAX ? static_cast<int32_t>(row) : kDeadRow;
}

// One output element (token, layer, column), a pure function of the inputs,
// flat index (token * num_layers + layer) * num_cols + col:
// XOR of x[s] * mult[s] over s = 0..order-1 (exact: the layout bounds each
// product below 2**63), modulo the column's prime, plus its offset. The CUDA
// kernel runs one thread per element so the stores are coalesced. Needs
// num_layers * num_cols <= INT32_MAX (handlers/hash_args.h checks it): the position
// inside a token is kept in 32 bits, which keeps the kernel's divisions cheap.
ENGRAM_HD void HashElement(const NgramHashParams& p, int64_t element) {
  const int64_t per_token = static_cast<int64_t>(p.num_layers) * p.num_cols;
  const int64_t t = element / per_token;
  const int32_t rest = static_cast<int32_t>(element - t * per_token);
  const int layer = rest / p.num_cols;
  const int col = rest - layer * p.num_cols;
  const int32_t token = p.tokens[t];
  if (token == kDeadToken) {
    p.out[element] = kDeadRow;
    return;
  }
  const int depth = col / p.n_heads + 1;
  uint64_t h = HashInput(p, token) * Multiplier(p, layer, 0);
  WindowWalker walk(p, t);
  for (int s = 1; s <= depth; ++s) h ^= walk.Next(s) * Multiplier(p, layer, s);
  p.out[element] = RowOf(p, h, layer, col);
}

// Every column of one token, the window walked once (the CPU path).
ENGRAM_HD void HashToken(const NgramHashParams& p, int64_t t) {
  const int64_t per_token = static_cast<int64_t>(p.num_layers) * p.num_cols;
  int32_t* out = p.out + t * per_token;
  const int32_t token = p.tokens[t];
  if (token == kDeadToken) {
    for (int64_t i = 0; i < per_token; ++i) out[i] = kDeadRow;
    return;
  }
  uint64_t x[kMaxNgram];
  x[0] = HashInput(p, token);
  WindowWalker walk(p, t);
  for (int s = 1; s < p.max_ngram; ++s) x[s] = walk.Next(s);
  for (int layer = 0; layer < p.num_layers; ++layer) {
    uint64_t h = x[0] * Multiplier(p, layer, 0);
    for (int s = 1; s < p.max_ngram; ++s) {
      h ^= x[s] * Multiplier(p, layer, s);
      for (int k = 0; k < p.n_heads; ++k) {
        const int col = (s - 1) * p.n_heads + k;
        out[static_cast<int64_t>(layer) * p.num_cols + col] = RowOf(p, h, layer, col);
      }
    }
  }
}

inline void NgramHashCpu(const NgramHashParams& p) {
  for (int64_t t = 0; t < p.num_tokens; ++t) HashToken(p, t);
}

}  // namespace engram
