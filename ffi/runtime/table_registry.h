// Process-wide map from a table key to the memory that holds its rows, per
// device, kept while the table is open. Handlers resolve (key, device ordinal)
// on every call, so one SPMD program reads each device's own shard and a
// closed table is an error instead of a read of freed memory.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <shared_mutex>
#include <string>

#include "kernels/train_rows.h"

namespace engram {

enum class MemoryKind : int32_t {
  kHost = 0,        // plain host memory: CPU handlers only
  kHostMapped = 1,  // page-locked and mapped into the GPU's address space: both
  kDevice = 2,      // one GPU's memory: the CUDA handlers of that ordinal only
};

struct TableEntry {
  uintptr_t base = 0;  // address of row 0's record (host or device)
  int64_t row_start = 0;
  int64_t num_rows = 0;
  int64_t dim = 0;
  MemoryKind kind = MemoryKind::kHost;
  // What the records hold: fp8 serving records (row_decode.h), or the float32 /
  // bfloat16 rows of a trainable table followed by their optimizer state
  // (kernels/train_rows.h). Trainable tables only (format != kFp8Records): bytes per record, where the
  // optimizer state starts in it, which optimizer (RowOptimizerKind) and the
  // dtype of its moments (RowFormat kF32 or kBf16). `writer`: whether updates
  // through this device's entry write; of several devices sharing one memory
  // block exactly one does, so a gradient gathered to all of them lands once.
  RowFormat format = RowFormat::kFp8Records;
  int64_t stride = 0;
  int64_t state_offset = 0;
  int32_t optimizer = 0;
  RowFormat moment_format = RowFormat::kF32;
  bool writer = true;
};

// Which handlers may read which memory.
inline bool CpuCanRead(MemoryKind kind) { return kind != MemoryKind::kDevice; }
inline bool GpuCanRead(MemoryKind kind) { return kind != MemoryKind::kHost; }

// Any device: an entry registered for every ordinal, used where a device has
// no entry of its own (one host table read by all GPUs of a process).
constexpr int32_t kAnyDevice = -1;

// Held by a handler that reads table memory on the host thread (the CPU
// gathers): UnregisterTable waits until every lease of the key is gone, so
// memory is never freed under a running read. GPU reads happen after the
// handler returns; Python synchronises the devices before freeing instead.
class TableLease {
 public:
  TableLease() = default;

 private:
  friend std::optional<TableEntry> FindTable(int64_t, int32_t, TableLease*);
  std::shared_ptr<std::shared_mutex> in_use_;
  std::shared_lock<std::shared_mutex> lock_;
};

// Adds the entry; returns "" on success, else why it was refused: an entry no
// gather can read safely (dim, rows past int32 ids, no memory, device memory
// for any device) or a second entry for the same key and device, which would
// let UnregisterTable return while a lease on the first is still reading.
std::string RegisterTable(int64_t key, int32_t device_ordinal, const TableEntry& entry);
// Removes every entry of the key, waits for their leases to end; returns how
// many entries there were.
int UnregisterTable(int64_t key);
// The entry for this device, else the key's any-device entry. With a lease,
// the entry stays registered until the lease is destroyed.
std::optional<TableEntry> FindTable(int64_t key, int32_t device_ordinal, TableLease* lease = nullptr);
// A message naming the key and device, for a lookup that found nothing, and the
// table the key was given to (NameTable) if it is known.
std::string MissingTableMessage(int64_t key, int32_t device_ordinal);
// Records what the table under `key` is (for MissingTableMessage); kept for a
// while after the key is unregistered.
void NameTable(int64_t key, const std::string& name);

}  // namespace engram
