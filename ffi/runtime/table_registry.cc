// The table registry behind table_registry.h: a mutex-guarded map. Handlers
// take the lock once per call, which costs far less than one row's PCIe read.
#include "runtime/table_registry.h"

#include <cstdint>
#include <deque>
#include <map>
#include <mutex>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "kernels/gather_params.h"
#include "kernels/row_decode.h"
#include "kernels/train_rows.h"

namespace engram {
namespace {

struct Slot {
  TableEntry entry;
  // Shared by leases; taken exclusively once the slot has left the map.
  std::shared_ptr<std::shared_mutex> in_use = std::make_shared<std::shared_mutex>();
};

std::mutex& RegistryMutex() {
  static std::mutex mutex;
  return mutex;
}

std::map<std::pair<int64_t, int32_t>, Slot>& Registry() {
  static auto* registry = new std::map<std::pair<int64_t, int32_t>, Slot>();
  return *registry;
}

// What each key's table is (its Python repr), kept a while after the key is
// unregistered so a compiled lookup of a closed table names it; the oldest
// closed names go first. Guarded by RegistryMutex.
constexpr size_t kClosedNamesKept = 1024;

struct Names {
  std::unordered_map<int64_t, std::string> by_key;
  std::deque<int64_t> closed;  // oldest first
};

Names& TableNames() {
  static auto* names = new Names();
  return *names;
}

}  // namespace

void NameTable(int64_t key, const std::string& name) {
  std::lock_guard<std::mutex> lock(RegistryMutex());
  TableNames().by_key[key] = name;
}

std::string RegisterTable(int64_t key, int32_t device_ordinal, const TableEntry& entry) {
  if (entry.format == RowFormat::kFp8Records) {
    if (entry.dim <= 0 || entry.dim % kBlockSize != 0 || entry.dim > kMaxDim) {
      return "dim must be a positive multiple of 32 up to " + std::to_string(kMaxDim) + ", got " +
             std::to_string(entry.dim);
    }
  } else {
    const std::string error = CheckTrainableLayout(entry.format, entry.dim, entry.stride, entry.state_offset,
                                                   entry.optimizer, entry.moment_format);
    if (!error.empty()) return error;
  }
  // Ids are int32 global rows, so no table row lies at or past 2**31; the
  // sorted lookups rely on it (32-bit sort keys, num_rows included).
  constexpr int64_t kRowLimit = int64_t{1} << 31;
  if (entry.row_start < 0 || entry.num_rows < 0 || entry.row_start > kRowLimit - entry.num_rows) {
    return "need row_start >= 0, num_rows >= 0 and row_start + num_rows <= 2**31, got " +
           std::to_string(entry.row_start) + " and " + std::to_string(entry.num_rows);
  }
  if (entry.base == 0 && entry.num_rows > 0) return "a table with rows needs a non-null base address";
  if (entry.kind == MemoryKind::kDevice && device_ordinal < 0) {
    return "device memory belongs to one GPU: register it for that device's ordinal";
  }
  if (device_ordinal < kAnyDevice) return "device ordinal must be >= 0, or -1 for any device";
  std::lock_guard<std::mutex> lock(RegistryMutex());
  if (!Registry().emplace(std::make_pair(key, device_ordinal), Slot{entry}).second) {
    return "table " + std::to_string(key) + " already has an entry for device " + std::to_string(device_ordinal);
  }
  return "";
}

int UnregisterTable(int64_t key) {
  std::vector<std::shared_ptr<std::shared_mutex>> removed;
  {
    std::lock_guard<std::mutex> lock(RegistryMutex());
    auto& registry = Registry();
    for (auto it = registry.lower_bound({key, INT32_MIN}); it != registry.end() && it->first.first == key;) {
      removed.push_back(it->second.in_use);
      it = registry.erase(it);
    }
    Names& names = TableNames();
    if (!removed.empty() && names.by_key.count(key) != 0) {
      names.closed.push_back(key);
      while (names.closed.size() > kClosedNamesKept) {
        names.by_key.erase(names.closed.front());
        names.closed.pop_front();
      }
    }
  }
  // No new lease can start now; wait for the running ones.
  for (auto& in_use : removed) std::unique_lock<std::shared_mutex> drain(*in_use);
  return static_cast<int>(removed.size());
}

std::optional<TableEntry> FindTable(int64_t key, int32_t device_ordinal, TableLease* lease) {
  std::lock_guard<std::mutex> lock(RegistryMutex());
  const auto& registry = Registry();
  auto it = registry.find({key, device_ordinal});
  if (it == registry.end()) it = registry.find({key, kAnyDevice});
  if (it == registry.end()) return std::nullopt;
  if (lease != nullptr) {
    // Never blocks: a slot is only locked exclusively after it left the map.
    lease->in_use_ = it->second.in_use;
    lease->lock_ = std::shared_lock<std::shared_mutex>(*lease->in_use_);
  }
  return it->second.entry;
}

std::string MissingTableMessage(int64_t key, int32_t device_ordinal) {
  std::string message = "engram_jax: table " + std::to_string(key) + " is closed or was never placed for device " +
                        std::to_string(device_ordinal);
  std::lock_guard<std::mutex> lock(RegistryMutex());
  const auto& names = TableNames().by_key;
  if (auto it = names.find(key); it != names.end()) message += " (it was " + it->second + ")";
  return message;
}

}  // namespace engram
