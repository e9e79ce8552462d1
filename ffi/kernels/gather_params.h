// What a gather needs to know, as plain values: where the row records are,
// which slice of the logical layer table they hold, and where ids and output
// live. Used by the CPU and CUDA gathers alike; knows nothing of XLA.
#pragma once

#include <cstdint>

namespace engram {

struct GatherParams {
  const uint8_t* table = nullptr;  // row records, RowStride(dim) bytes each
  int64_t row_start = 0;           // global id of the table's first row
  int64_t num_rows = 0;            // rows the table holds
  int64_t dim = 0;                 // values per row, a multiple of 32
  const int32_t* ids = nullptr;    // global row ids; any id outside the table gives zeros
  int64_t num_ids = 0;
  uint16_t* out = nullptr;  // bf16 bits, [num_ids, dim]
  // Set instead of `out`: each row's packed record (its first PackedRecordBytes(dim)
  // bytes, undecoded), [num_ids, PackedRecordBytes(dim)], for an exchange that moves
  // records between devices and decodes them after (zeros for ids outside the table).
  uint8_t* records = nullptr;
};

// Widest row a gather accepts (table.py's MAX_DIM): a tile of the CUDA
// gathers then still fits the 48 KiB of shared memory a launch gets by default.
constexpr int64_t kMaxDim = 16384;

// Local row of a global id, or -1 when the table does not hold it. Written
// so that no id, however large or negative, can form an address.
inline constexpr int64_t kNoRow = -1;

}  // namespace engram
