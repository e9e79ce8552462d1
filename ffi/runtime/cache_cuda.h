// CUDA-side services of the hot-row cache that Python calls through
// bindings/cache_module.cc: fill and upload on a private stream, waited for.
// Only compiled into builds with ENGRAM_HAS_CUDA.
#pragma once

#include <cstdint>
#include <string>

namespace engram {

// Copies the records of `count` table-local rows (device array `rows`, in
// table order) of table `table_key` into device memory `dst`, on a private
// non-blocking stream of device `device_ordinal`, and waits for it. Holds a
// lease on the table meanwhile, so closing it waits for the copy; a row
// outside the table is not read (its record in `dst` is zeros).
std::string FillCacheRecordsCuda(int64_t table_key, int32_t device_ordinal, const int32_t* rows, int64_t count,
                                 uint8_t* dst);
// Host -> device copy on the same private stream, waited for. Unlike
// cudaMemcpy it never waits for (or makes wait) work on other streams.
std::string UploadCuda(int32_t device_ordinal, void* dst, const void* src, int64_t nbytes);

}  // namespace engram
