// How many times each command-buffer-compatible CUDA handler ran under stream
// capture, that is, was recorded into one of XLA's CUDA graphs. XLA's compiled
// HLO text no longer shows its graphs, so this is how a test knows a graph holds
// the call. One set of counters per loaded module; no XLA types.
#pragma once

#include <atomic>
#include <cstdint>

namespace engram {

enum class CapturedCall : int { kNgramHash = 0, kLookupDone = 1, kCount = 2 };

inline std::atomic<int64_t>& CaptureCounter(CapturedCall call) {
  static std::atomic<int64_t> counters[static_cast<int>(CapturedCall::kCount)] = {};
  return counters[static_cast<int>(call)];
}

}  // namespace engram
