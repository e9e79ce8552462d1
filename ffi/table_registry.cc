// The table registry behind table_registry.h: a mutex-guarded map. Handlers
// take the lock once per call, which costs far less than one row's PCIe read.
#include "table_registry.h"

#include <cstdint>
#include <map>
#include <mutex>
#include <utility>

namespace engram {
namespace {

std::mutex& RegistryMutex() {
  static std::mutex mutex;
  return mutex;
}

std::map<std::pair<int64_t, int32_t>, TableEntry>& Registry() {
  static auto* registry = new std::map<std::pair<int64_t, int32_t>, TableEntry>();
  return *registry;
}

}  // namespace

void RegisterTable(int64_t key, int32_t device_ordinal, const TableEntry& entry) {
  std::lock_guard<std::mutex> lock(RegistryMutex());
  Registry()[{key, device_ordinal}] = entry;
}

int UnregisterTable(int64_t key) {
  std::lock_guard<std::mutex> lock(RegistryMutex());
  auto& registry = Registry();
  int removed = 0;
  for (auto it = registry.lower_bound({key, INT32_MIN});
       it != registry.end() && it->first.first == key;) {
    it = registry.erase(it);
    ++removed;
  }
  return removed;
}

std::optional<TableEntry> FindTable(int64_t key, int32_t device_ordinal) {
  std::lock_guard<std::mutex> lock(RegistryMutex());
  const auto& registry = Registry();
  if (auto it = registry.find({key, device_ordinal}); it != registry.end()) return it->second;
  if (auto it = registry.find({key, kAnyDevice}); it != registry.end()) return it->second;
  return std::nullopt;
}

std::string MissingTableMessage(int64_t key, int32_t device_ordinal) {
  return "engram_jax: table " + std::to_string(key) + " is closed or was never placed for device " +
         std::to_string(device_ordinal);
}

}  // namespace engram
