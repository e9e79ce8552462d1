// The CPU gather: row records in host memory to bf16 rows (or to packed
// records, and those to rows later), split across a few std::threads for large
// batches. Same decode as the CUDA kernel (row_decode.h), so both backends
// return the same bits.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <exception>
#include <thread>
#include <vector>

#include "kernels/gather_params.h"
#include "kernels/row_decode.h"

namespace engram {

// bf16 bits for every (scale byte, fp8 byte) pair, built once (128 KiB): one
// load per value instead of the integer decode. Call it once on the calling
// thread before starting workers, so its allocation can only fail there.
inline const uint16_t* DequantTable() {
  static const std::vector<uint16_t> table = [] {
    std::vector<uint16_t> t(256 * 256);
    for (int s = 0; s < 256; ++s)
      for (int v = 0; v < 256; ++v)
        t[s * 256 + v] = DequantToBf16Bits(static_cast<uint8_t>(v), static_cast<uint8_t>(s));
    return t;
  }();
  return table.data();
}

inline int64_t LocalRow(const GatherParams& p, int32_t id) {
  const int64_t local = static_cast<int64_t>(id) - p.row_start;
  return (local >= 0 && local < p.num_rows) ? local : kNoRow;
}

// bf16 bits of one record's `dim` values (fp8 bytes, then the scale bytes).
inline void DecodeRecordCpu(const uint16_t* dequant, const uint8_t* record, int64_t dim, uint16_t* dst) {
  const uint8_t* scales = record + dim;
  for (int64_t block = 0; block < dim / kBlockSize; ++block) {
    const uint16_t* by_value = dequant + scales[block] * 256;
    for (int j = 0; j < kBlockSize; ++j) {
      const int64_t v = block * kBlockSize + j;
      dst[v] = by_value[record[v]];
    }
  }
}

// Bytes of one output row: `dim` bf16 values, or a packed record when the
// gather returns records (p.records set).
inline int64_t OutRowBytes(const GatherParams& p) {
  return p.records != nullptr ? PackedRecordBytes(p.dim) : p.dim * static_cast<int64_t>(sizeof(uint16_t));
}

inline uint8_t* OutRow(const GatherParams& p, int64_t i) {
  uint8_t* out = p.records != nullptr ? p.records : reinterpret_cast<uint8_t*>(p.out);
  return out + i * OutRowBytes(p);
}

// Rows [begin, end): decoded, or copied as packed records; zeros for ids the
// table does not hold (a zero record decodes to a zero row).
inline void GatherRowsCpu(const GatherParams& p, int64_t begin, int64_t end) {
  const uint16_t* dequant = DequantTable();
  const int64_t stride = RowStride(p.dim);
  const int64_t out_bytes = OutRowBytes(p);
  for (int64_t i = begin; i < end; ++i) {
    uint8_t* dst = OutRow(p, i);
    const int64_t local = LocalRow(p, p.ids[i]);
    if (local == kNoRow) {
      std::memset(dst, 0, out_bytes);
    } else if (p.records != nullptr) {
      std::memcpy(dst, p.table + local * stride, out_bytes);
    } else {
      DecodeRecordCpu(dequant, p.table + local * stride, p.dim, reinterpret_cast<uint16_t*>(dst));
    }
  }
}

// Below this many rows a thread start costs more than it saves.
constexpr int64_t kRowsPerCpuThread = 8192;

// Threads a CPU lookup may use: the machine's cores, at most 16.
inline int CpuLookupThreads() {
  return static_cast<int>(std::max(1u, std::min(16u, std::thread::hardware_concurrency())));
}

// How many chunks ParallelChunks cuts [0, n) into on up to max_threads threads.
inline int ParallelChunkCount(int64_t n, int max_threads) {
  const int64_t wanted = (n + kRowsPerCpuThread - 1) / kRowsPerCpuThread;
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(wanted, max_threads)));
}

// Runs fn(c, lo, hi) for chunk c of [0, n), ParallelChunkCount(n, max_threads)
// equal chunks, each on a thread of its own, the calling thread taking the
// first (c tells a chunk which of the caller's scratch buffers is its own). A
// thread that cannot be started (the process at its thread or memory limit)
// leaves its chunk to the calling thread: the result is the same, only slower,
// and no std::system_error escapes with threads still running. fn must not throw.
template <typename Fn>
inline void ParallelIndexedChunks(int64_t n, int max_threads, const Fn& fn) {
  const int threads = ParallelChunkCount(n, max_threads);
  const int64_t chunk = (n + threads - 1) / threads;
  std::vector<std::thread> pool;
  int started = 1;  // chunks [1, started) run on threads of the pool
  try {
    pool.reserve(static_cast<size_t>(threads - 1));
    for (; started < threads; ++started) {
      const int64_t lo = std::min(n, started * chunk), hi = std::min(n, lo + chunk);
      pool.emplace_back([&fn, started, lo, hi] { fn(started, lo, hi); });
    }
  } catch (const std::exception&) {  // std::system_error, std::bad_alloc
    // No more threads: the chunks from `started` on run here below.
  }
  fn(0, int64_t{0}, std::min(n, chunk));
  for (int t = started; t < threads; ++t) {
    const int64_t lo = std::min(n, t * chunk), hi = std::min(n, lo + chunk);
    fn(t, lo, hi);
  }
  for (auto& t : pool) t.join();
}

// ParallelIndexedChunks for fn(lo, hi), which needs no scratch of its own.
template <typename Fn>
inline void ParallelChunks(int64_t n, int max_threads, const Fn& fn) {
  ParallelIndexedChunks(n, max_threads, [&fn](int, int64_t lo, int64_t hi) { fn(lo, hi); });
}

inline void GatherCpu(const GatherParams& p, int max_threads) {
  DequantTable();
  ParallelChunks(p.num_ids, max_threads, [&p](int64_t lo, int64_t hi) { GatherRowsCpu(p, lo, hi); });
}

// Decodes `num_rows` packed records at `records` (PackedRecordBytes(dim) bytes
// each, back to back) into bf16 rows at `out`, as GatherRowsCpu decodes a table's.
inline void DecodeRecordsCpu(const uint8_t* records, int64_t num_rows, int64_t dim, uint16_t* out, int max_threads) {
  const uint16_t* dequant = DequantTable();
  const int64_t bytes = PackedRecordBytes(dim);
  ParallelChunks(num_rows, max_threads, [=](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i) DecodeRecordCpu(dequant, records + i * bytes, dim, out + i * dim);
  });
}

}  // namespace engram
