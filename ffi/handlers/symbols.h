// Every XLA FFI handler symbol, for bindings/module.cc's registrations(): one
// group per operation, the CPU handler first. The CUDA handlers are defined
// only in builds with ENGRAM_HAS_CUDA; the binding names them only there.
#pragma once

#include "xla/ffi/api/api.h"

// engram_lookup: the plain synchronous lookup (lookup_cpu.cc, lookup_cuda.cu).
XLA_FFI_DECLARE_HANDLER_SYMBOL(EngramLookupCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(EngramLookupCuda);

// engram_cached_lookup: the synchronous lookup with visiting order,
// deduplication and the hot-row cache (lookup_cpu.cc, lookup_cuda.cu).
XLA_FFI_DECLARE_HANDLER_SYMBOL(EngramCachedLookupCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(EngramCachedLookupCuda);

// engram_lookup_records: the cached lookup returning packed records, and
// engram_decode_records: their decode, the two ends of a packed exchange
// (lookup_cpu.cc, lookup_cuda.cu; decode_cpu.cc, decode_cuda.cu).
XLA_FFI_DECLARE_HANDLER_SYMBOL(EngramLookupRecordsCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(EngramLookupRecordsCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(EngramDecodeRecordsCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(EngramDecodeRecordsCuda);

// engram_lookup_start / engram_lookup_done: the asynchronous lookup, every
// order, the hot-row cache, rows or packed records (prefetch_cpu.cc, prefetch_cuda.cu). The CUDA
// start has an instantiation handler, which creates its call-site state
// (runtime/prefetch_site.h).
XLA_FFI_DECLARE_HANDLER_SYMBOL(EngramLookupStartCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(EngramLookupDoneCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(EngramSiteInstantiateCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(EngramLookupStartCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(EngramLookupDoneCuda);

// engram_ngram_hash: the n-gram hash (hash_cpu.cc, hash_cuda.cu).
XLA_FFI_DECLARE_HANDLER_SYMBOL(EngramNgramHashCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(EngramNgramHashCuda);

// engram_train_lookup: the rows of a trainable table in its own dtype
// (train_lookup_cpu.cc, train_lookup_cuda.cu); engram_apply_gradients: the
// sparse row update of a trainable table, in place (update_cpu.cc, update_cuda.cu).
XLA_FFI_DECLARE_HANDLER_SYMBOL(EngramTrainLookupCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(EngramTrainLookupCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(EngramApplyGradientsCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(EngramApplyGradientsCuda);
// engram_apply_gradients_start / _done: the update on the prefetches' side
// stream, waited for at done (update_cpu.cc: at once; update_cuda.cu). The
// CUDA start's call-site state is made by EngramSiteInstantiateCuda.
XLA_FFI_DECLARE_HANDLER_SYMBOL(EngramApplyGradientsStartCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(EngramApplyGradientsDoneCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(EngramApplyGradientsStartCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(EngramApplyGradientsDoneCuda);
