// The one Python binding of engram_jax's native code: FFI handler capsules
// for jax.ffi.register_ffi_target, and the table registry the handlers read.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>

#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "bindings/cache_module.h"
#include "handlers/symbols.h"
#include "kernels/dedup_params.h"
#include "kernels/train_rows.h"
#include "runtime/capture_count.h"
#include "runtime/prefetch_sites.h"
#include "runtime/table_registry.h"

namespace nb = nanobind;

namespace {

#if ENGRAM_HAS_CUDA
constexpr bool kHasCuda = true;
#else
constexpr bool kHasCuda = false;
#endif

template <typename T>
nb::capsule EncapsulateFfiHandler(T* fn) {
  static_assert(std::is_invocable_r_v<XLA_FFI_Error*, T, XLA_FFI_CallFrame*>,
                "Encapsulated function must be an XLA FFI handler");
  return nb::capsule(reinterpret_cast<void*>(fn));
}

}  // namespace

NB_MODULE(_engram_native, m) {
  m.def("registrations", []() {
    nb::dict targets;
    nb::dict cpu;
    cpu["engram_lookup"] = EncapsulateFfiHandler(EngramLookupCpu);
    cpu["engram_ngram_hash"] = EncapsulateFfiHandler(EngramNgramHashCpu);
    cpu["engram_lookup_start"] = EncapsulateFfiHandler(EngramLookupStartCpu);
    cpu["engram_lookup_done"] = EncapsulateFfiHandler(EngramLookupDoneCpu);
    cpu["engram_cached_lookup"] = EncapsulateFfiHandler(EngramCachedLookupCpu);
    cpu["engram_lookup_records"] = EncapsulateFfiHandler(EngramLookupRecordsCpu);
    cpu["engram_decode_records"] = EncapsulateFfiHandler(EngramDecodeRecordsCpu);
    cpu["engram_train_lookup"] = EncapsulateFfiHandler(EngramTrainLookupCpu);
    cpu["engram_apply_gradients"] = EncapsulateFfiHandler(EngramApplyGradientsCpu);
    cpu["engram_apply_gradients_start"] = EncapsulateFfiHandler(EngramApplyGradientsStartCpu);
    cpu["engram_apply_gradients_done"] = EncapsulateFfiHandler(EngramApplyGradientsDoneCpu);
    targets["cpu"] = cpu;
#if ENGRAM_HAS_CUDA
    nb::dict cuda;
    cuda["engram_lookup"] = EncapsulateFfiHandler(EngramLookupCuda);
    cuda["engram_ngram_hash"] = EncapsulateFfiHandler(EngramNgramHashCuda);
    // Start keeps per-instruction state (its call site), made at instantiation.
    nb::dict start;
    start["instantiate"] = EncapsulateFfiHandler(EngramSiteInstantiateCuda);
    start["execute"] = EncapsulateFfiHandler(EngramLookupStartCuda);
    cuda["engram_lookup_start"] = start;
    cuda["engram_lookup_done"] = EncapsulateFfiHandler(EngramLookupDoneCuda);
    cuda["engram_cached_lookup"] = EncapsulateFfiHandler(EngramCachedLookupCuda);
    cuda["engram_lookup_records"] = EncapsulateFfiHandler(EngramLookupRecordsCuda);
    cuda["engram_decode_records"] = EncapsulateFfiHandler(EngramDecodeRecordsCuda);
    cuda["engram_train_lookup"] = EncapsulateFfiHandler(EngramTrainLookupCuda);
    cuda["engram_apply_gradients"] = EncapsulateFfiHandler(EngramApplyGradientsCuda);
    nb::dict update_start;
    update_start["instantiate"] = EncapsulateFfiHandler(EngramSiteInstantiateCuda);
    update_start["execute"] = EncapsulateFfiHandler(EngramApplyGradientsStartCuda);
    cuda["engram_apply_gradients_start"] = update_start;
    cuda["engram_apply_gradients_done"] = EncapsulateFfiHandler(EngramApplyGradientsDoneCuda);
    targets["CUDA"] = cuda;
#endif
    return targets;
  });

  // FFI state types, per platform, registered with XLA before the targets that use them.
  m.def("type_registrations", []() {
    nb::dict types;
#if ENGRAM_HAS_CUDA
    nb::dict cuda;
    nb::dict site;
    site["type_id"] = nb::capsule(engram::PrefetchSiteTypeId());
    site["type_info"] = nb::capsule(engram::PrefetchSiteTypeInfo());
    cuda["engram_jax.prefetch_site"] = site;
    types["CUDA"] = cuda;
#endif
    return types;
  });

  engram::BindCache(m);

#if ENGRAM_HAS_CUDA
  // How many compiled lookup_start call sites hold staging, how many are
  // destroyed but still releasing it, and any whose release failed (tests:
  // sites must come and go; a leak says which CUDA call refused).
  m.def("prefetch_sites", []() {
    const engram::PrefetchSiteCounts c = engram::CountPrefetchSites();
    nb::dict counts;
    counts["live"] = c.live;
    counts["retired"] = c.retired;
    counts["destroyed"] = c.destroyed;
    counts["leaked"] = c.leaked;
    counts["leak_reason"] = c.leak_reason;
    return counts;
  });
  // Tests: hold a device's side stream busy, as a slow device would.
  m.def(
      "stall_side_stream",
      [](int device, int64_t microseconds) {
        if (const int err = engram::StallSideStream(device, microseconds); err != 0) {
          throw std::runtime_error("engram_jax: cannot stall the side stream of device " + std::to_string(device) +
                                   ": CUDA error " + std::to_string(err));
        }
      },
      nb::arg("device"), nb::arg("microseconds"));
#endif

  m.attr("has_cuda") = kHasCuda;

  // The native enums by name, so Python reads their numbers instead of copying them.
  nb::dict memory_kinds;
  memory_kinds["host"] = static_cast<int32_t>(engram::MemoryKind::kHost);
  memory_kinds["host_mapped"] = static_cast<int32_t>(engram::MemoryKind::kHostMapped);
  memory_kinds["device"] = static_cast<int32_t>(engram::MemoryKind::kDevice);
  m.attr("memory_kinds") = memory_kinds;
  nb::dict visit_orders;
  visit_orders["plain"] = static_cast<int32_t>(engram::VisitOrder::kPlain);
  visit_orders["sorted"] = static_cast<int32_t>(engram::VisitOrder::kSorted);
  visit_orders["dedup"] = static_cast<int32_t>(engram::VisitOrder::kDedup);
  m.attr("visit_orders") = visit_orders;
  nb::dict row_formats;
  row_formats["float32"] = static_cast<int32_t>(engram::RowFormat::kF32);
  row_formats["bfloat16"] = static_cast<int32_t>(engram::RowFormat::kBf16);
  m.attr("row_formats") = row_formats;
  nb::dict row_optimizers;
  row_optimizers["sgd"] = static_cast<int32_t>(engram::RowOptimizerKind::kSgd);
  row_optimizers["adagrad"] = static_cast<int32_t>(engram::RowOptimizerKind::kAdagrad);
  row_optimizers["row_adagrad"] = static_cast<int32_t>(engram::RowOptimizerKind::kRowAdagrad);
  row_optimizers["lazy_adam"] = static_cast<int32_t>(engram::RowOptimizerKind::kLazyAdam);
  m.attr("row_optimizers") = row_optimizers;
  // A trainable table's record layout (kernels/train_rows.h): (stride, state_offset, state_bytes).
  m.def(
      "trainable_layout",
      [](int32_t format, int64_t dim, int32_t optimizer, int32_t moment_format) {
        if (!engram::ValidRowFormat(format) || !engram::ValidRowFormat(moment_format)) {
          throw nb::value_error("engram_jax trainable_layout: formats are 1 (float32) or 2 (bfloat16)");
        }
        if (!engram::ValidOptimizer(optimizer)) throw nb::value_error("engram_jax trainable_layout: unknown optimizer");
        const auto f = static_cast<engram::RowFormat>(format);
        const auto mf = static_cast<engram::RowFormat>(moment_format);
        const auto kind = static_cast<engram::RowOptimizerKind>(optimizer);
        return nb::make_tuple(engram::TrainableStride(f, dim, kind, mf), engram::StateOffset(f, dim),
                              engram::StateBytes(kind, dim, mf));
      },
      nb::arg("format"), nb::arg("dim"), nb::arg("optimizer"), nb::arg("moment_format"));
  // Bytes of the result of an apply_gradients call of `num_ids` ids: its token, then
  // its scratch (kernels/train_rows.h).
  m.def(
      "update_result_bytes", [](int64_t num_ids, int64_t dim) { return engram::UpdateResultBytes(num_ids, dim); },
      nb::arg("num_ids"), nb::arg("dim"));
  // Entries per chunk of a run's gradient sum (the numpy reference has its own copy).
  m.attr("gradient_chunk") = engram::kGradChunk;
  // The registry ordinal of an entry every device falls back on.
  m.attr("any_device") = engram::kAnyDevice;

  // Times each graph-compatible CUDA handler was recorded into a CUDA graph.
  m.def("captured_calls", []() {
    nb::dict counts;
    counts["engram_ngram_hash"] = engram::CaptureCounter(engram::CapturedCall::kNgramHash).load();
    counts["engram_lookup_done"] = engram::CaptureCounter(engram::CapturedCall::kLookupDone).load();
    return counts;
  });

  m.def(
      "register_table",
      [](int64_t key, int32_t device_ordinal, uintptr_t base, int64_t row_start, int64_t num_rows, int64_t dim,
         int32_t kind) {
        if (kind < 0 || kind > 2) throw nb::value_error("memory kind must be 0 (host), 1 (mapped) or 2 (device)");
        const std::string error = engram::RegisterTable(
            key, device_ordinal, {base, row_start, num_rows, dim, static_cast<engram::MemoryKind>(kind)});
        if (!error.empty()) throw nb::value_error(("engram_jax register_table: " + error).c_str());
      },
      nb::arg("key"), nb::arg("device_ordinal"), nb::arg("base"), nb::arg("row_start"), nb::arg("num_rows"),
      nb::arg("dim"), nb::arg("kind"));
  m.def(
      "register_trainable_table",
      [](int64_t key, int32_t device_ordinal, uintptr_t base, int64_t row_start, int64_t num_rows, int64_t dim,
         int32_t kind, int32_t format, int32_t optimizer, int32_t moment_format, bool writer) {
        if (kind < 0 || kind > 2) throw nb::value_error("memory kind must be 0 (host), 1 (mapped) or 2 (device)");
        if (!engram::ValidRowFormat(format) || !engram::ValidRowFormat(moment_format) ||
            !engram::ValidOptimizer(optimizer)) {
          throw nb::value_error("engram_jax register_trainable_table: unknown row format or optimizer");
        }
        engram::TableEntry entry{base, row_start, num_rows, dim, static_cast<engram::MemoryKind>(kind)};
        entry.format = static_cast<engram::RowFormat>(format);
        entry.moment_format = static_cast<engram::RowFormat>(moment_format);
        entry.optimizer = optimizer;
        entry.stride = engram::TrainableStride(entry.format, dim, static_cast<engram::RowOptimizerKind>(optimizer),
                                               entry.moment_format);
        entry.state_offset = engram::StateOffset(entry.format, dim);
        entry.writer = writer;
        const std::string error = engram::RegisterTable(key, device_ordinal, entry);
        if (!error.empty()) throw nb::value_error(("engram_jax register_trainable_table: " + error).c_str());
      },
      nb::arg("key"), nb::arg("device_ordinal"), nb::arg("base"), nb::arg("row_start"), nb::arg("num_rows"),
      nb::arg("dim"), nb::arg("kind"), nb::arg("format"), nb::arg("optimizer"), nb::arg("moment_format"),
      nb::arg("writer"));
  // Waits for CPU gathers still reading the table, so the GIL is let go meanwhile.
  m.def("unregister_table", &engram::UnregisterTable, nb::arg("key"), nb::call_guard<nb::gil_scoped_release>());
  // What a key's table is, for the error of a compiled lookup that outlives it.
  m.def("name_table", &engram::NameTable, nb::arg("key"), nb::arg("name"));

  // A numpy view of raw host memory the caller keeps alive (pinned or mapped
  // buffers allocated through cuda.bindings): no copy, no ownership.
  m.def(
      "host_view",
      [](uintptr_t address, size_t nbytes) {
        if (address == 0 && nbytes > 0) throw nb::value_error("engram_jax host_view: null address");
        size_t shape[1] = {nbytes};
        return nb::ndarray<nb::numpy, uint8_t, nb::ndim<1>>(reinterpret_cast<uint8_t*>(address), 1, shape,
                                                            nb::handle());
      },
      nb::arg("address"), nb::arg("nbytes"), nb::rv_policy::reference);
}
