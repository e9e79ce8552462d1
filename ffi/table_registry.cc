// The table registry behind table_registry.h: a mutex-guarded map. Handlers
// take the lock once per call, which costs far less than one row's PCIe read.
#include "table_registry.h"

#include <cstdint>
#include <map>
#include <mutex>
#include <utility>
#include <vector>

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

}  // namespace

void RegisterTable(int64_t key, int32_t device_ordinal, const TableEntry& entry) {
  std::lock_guard<std::mutex> lock(RegistryMutex());
  Registry()[{key, device_ordinal}] = Slot{entry};
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
  return "engram_jax: table " + std::to_string(key) + " is closed or was never placed for device " +
         std::to_string(device_ordinal);
}

}  // namespace engram
