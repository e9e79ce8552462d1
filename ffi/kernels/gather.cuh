// CUDA gather of Engram row records into bf16 rows. A persistent grid walks
// tiles of rows (GatherTiles, shared by every gather kernel): a tile's 16-byte
// loads all land in shared memory before any is used, then the tile is decoded
// and stored 16 bytes at a time (or, for a packed exchange, copied out as packed
// records, which DecodeRecordsKernel decodes later through the same tiles).
// No XLA types; launchers return cudaError_t.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>

#include "kernels/gather_params.h"
#include "kernels/row_decode.h"

namespace engram {

constexpr int kGatherThreads = 256;
// Loads each thread holds in registers before writing them to shared memory:
// more loads in flight hide the PCIe round trip (about 1-2 us).
constexpr int kLoadUnroll = 8;
constexpr int kTileBytes = 32 * 1024;

__host__ __device__ inline int TileRows(int64_t stride) {
  const int64_t rows = kTileBytes / stride;
  return static_cast<int>(rows < 1 ? 1 : (rows > 256 ? 256 : rows));
}

// Eight values by the integer reference decode: the path of NaN bytes and scales.
// Out of line (and static, so every unit has its own) to keep the fast path lean.
static __device__ __noinline__ uint4 DecodeEightExact(uint2 packed, uint8_t scale) {
  uint16_t h[8];
  const uint8_t* bytes = reinterpret_cast<const uint8_t*>(&packed);
#pragma unroll
  for (int k = 0; k < 8; ++k) h[k] = DequantToBf16Bits(bytes[k], scale);
  uint4 out;
  out.x = h[0] | (static_cast<uint32_t>(h[1]) << 16);
  out.y = h[2] | (static_cast<uint32_t>(h[3]) << 16);
  out.z = h[4] | (static_cast<uint32_t>(h[5]) << 16);
  out.w = h[6] | (static_cast<uint32_t>(h[7]) << 16);
  return out;
}

// Two fp8 values (low byte first) times `scale`, as two bf16 (low half first).
// e4m3 -> f16 -> f32 is exact, and so is the product: a 4-bit significand
// times a power of two no smaller than 2^-136 fits f32 (subnormals included;
// this code is built without flush-to-zero). The one rounding is f32 -> bf16,
// to nearest even, as the reference rounds; past bf16's range both give inf.
__device__ __forceinline__ uint32_t DecodePair(uint32_t two_fp8, float scale) {
  const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(two_fp8), __NV_E4M3);
  const float2 f = __half22float2(__half2(h));
  const __nv_bfloat162 b = __floats2bfloat162_rn(f.x * scale, f.y * scale);
  return *reinterpret_cast<const uint32_t*>(&b);
}

// Eight fp8 values of one 32-value block and its UE8M0 scale byte, as bf16 bits
// equal to DequantToBf16Bits'. The hardware conversions (one instruction per
// pair on sm_89+) cost a fraction of the integer decode, which bounded how many
// rows a CTA moved per second: a prefetch on few SMs was decode-bound, holding
// its SMs away from the model 2-3x longer. NaNs (x.1111.111 bytes, scale 255)
// take the integer path, which gives the reference's NaN bits.
__device__ __forceinline__ uint4 DecodeEight(uint2 packed, uint8_t scale) {
  const uint32_t nan_bytes =
      __vcmpeq4(packed.x & 0x7F7F7F7Fu, 0x7F7F7F7Fu) | __vcmpeq4(packed.y & 0x7F7F7F7Fu, 0x7F7F7F7Fu);
  if (nan_bytes != 0 || scale == 0xFF) return DecodeEightExact(packed, scale);
  // 2^(scale - 127); scale 0 is 2^-127, an f32 subnormal.
  const float factor = __uint_as_float(scale != 0 ? static_cast<uint32_t>(scale) << 23 : 0x00400000u);
  uint4 out;
  out.x = DecodePair(packed.x & 0xFFFFu, factor);
  out.y = DecodePair(packed.x >> 16, factor);
  out.z = DecodePair(packed.y & 0xFFFFu, factor);
  out.w = DecodePair(packed.y >> 16, factor);
  return out;
}

// Rows of the tile that starts at entry `first` of `total`.
__device__ __forceinline__ int RowsOfTile(int64_t total, int64_t first, int tile_rows) {
  return static_cast<int>(total - first < tile_rows ? total - first : tile_rows);
}

// The load phase of a tile, shared by every gather kernel: `loads` 16-byte
// words into shared memory `tile`; load(j, v) overwrites the zeros in v with
// word j (or leaves them, for a row that is not read). Each thread issues
// kLoadUnroll loads before it stores any, so that many reads are in flight.
// Compiles to the same machine code as the loop written out in each kernel.
template <typename Load>
__device__ __forceinline__ void LoadTile(uint4* tile, int loads, const Load& load) {
  for (int base = threadIdx.x; base < loads; base += blockDim.x * kLoadUnroll) {
    uint4 v[kLoadUnroll];
#pragma unroll
    for (int u = 0; u < kLoadUnroll; ++u) {
      const int j = base + u * blockDim.x;
      v[u] = make_uint4(0, 0, 0, 0);
      if (j < loads) load(j, v[u]);
    }
#pragma unroll
    for (int u = 0; u < kLoadUnroll; ++u) {
      const int j = base + u * blockDim.x;
      if (j < loads) tile[j] = v[u];
    }
  }
}

// The decode phase of a tile, shared by every gather kernel: tile row r
// decodes the record at bytes + map.Record(r) * stride (shared memory) into
// output row map.Out(r), out_chunks = dim / 8 stores of 16 bytes each.
// Absent rows were loaded as zero bytes: fp8 +0 times any scale is +0.
// `map` is a struct of __forceinline__ members, not lambdas, and out_chunks
// is computed by the kernels outside their tile loop: with nvcc 13 for sm_90
// this compiles to the same machine code as the loop written out in each
// kernel, while lambdas or an in-loop out_chunks cost registers.
template <typename TileRowMap>
__device__ __forceinline__ void StoreTile(int rows, int out_chunks, int64_t dim, const uint8_t* bytes, int64_t stride,
                                          const TileRowMap& map, uint4* out) {
  const int stores = rows * out_chunks;
  for (int j = threadIdx.x; j < stores; j += blockDim.x) {
    const int r = j / out_chunks, c = j - r * out_chunks;
    const uint8_t* record = bytes + map.Record(r) * stride;
    const uint2 packed = *reinterpret_cast<const uint2*>(record + c * 8);
    const uint8_t scale = record[dim + c / 4];
    __stcs(out + map.Out(r) * out_chunks + c, DecodeEight(packed, scale));
  }
}

// The geometry of a tile, fixed by the row width. The kernels compute it once,
// outside their tile loop: an out_chunks computed in the loop costs registers.
struct TileShape {
  int64_t stride;  // bytes per record
  int lanes;       // 16-byte loads per record
  int out_chunks;  // 16-byte stores per output row
};

__device__ __forceinline__ TileShape TileShapeOf(int64_t dim) {
  const int64_t stride = RowStride(dim);
  return {stride, static_cast<int>(stride / 16), static_cast<int>(dim / 8)};
}

// The widest of 16, 8, 4, 2 and 1 bytes that divides `bytes`. Packed records
// are PackedRecordBytes(dim) = 33 * dim / 32 bytes, back to back, so a packed
// record is aligned to no more than this (8 bytes for dim 256).
__host__ __device__ __forceinline__ int PackedUnit(int64_t bytes) {
  const int64_t low = bytes & -bytes;
  return static_cast<int>(low > 16 ? 16 : low);
}

// `unit` bytes (PackedUnit of the row width) from src to dst, both aligned to it.
__device__ __forceinline__ void CopyUnit(const uint8_t* src, uint8_t* dst, int unit) {
  switch (unit) {
    case 16:
      __stcs(reinterpret_cast<uint4*>(dst), *reinterpret_cast<const uint4*>(src));
      break;
    case 8:
      __stcs(reinterpret_cast<uint2*>(dst), *reinterpret_cast<const uint2*>(src));
      break;
    case 4:
      __stcs(reinterpret_cast<unsigned int*>(dst), *reinterpret_cast<const unsigned int*>(src));
      break;
    case 2:
      __stcs(reinterpret_cast<unsigned short*>(dst), *reinterpret_cast<const unsigned short*>(src));
      break;
    default:
      __stcs(reinterpret_cast<unsigned char*>(dst), *src);
  }
}

// The first `count` bytes (a multiple of `unit`, at most 16) of a 16-byte word
// at `src`, which is aligned to `unit`; the rest of the word is zero.
__device__ __forceinline__ uint4 LoadPackedWord(const uint8_t* src, int count, int unit) {
  if (unit == 16) return *reinterpret_cast<const uint4*>(src);
  uint32_t w[4] = {0, 0, 0, 0};
  if (unit == 8) {
#pragma unroll
    for (int k = 0; k < 2; ++k) {
      if (8 * k < count) {
        const uint2 d = reinterpret_cast<const uint2*>(src)[k];
        w[2 * k] = d.x;
        w[2 * k + 1] = d.y;
      }
    }
  } else if (unit == 4) {
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      if (4 * k < count) w[k] = reinterpret_cast<const uint32_t*>(src)[k];
    }
  } else {
#pragma unroll
    for (int b = 0; b < 16; ++b) {
      if (b < count) w[b / 4] |= static_cast<uint32_t>(src[b]) << (8 * (b % 4));
    }
  }
  return make_uint4(w[0], w[1], w[2], w[3]);
}

// How a tile leaves shared memory, the one step in which the gathers differ by
// what they return. DecodeRows: decoded into bf16 rows at p.out (StoreTile).
// CopyRecords: each row's packed record copied undecoded to p.records, for an
// exchange that moves records between devices and decodes them after.
struct DecodeRows {
  template <typename TileRowMap>
  static __device__ __forceinline__ void Store(int rows, const TileShape& shape, const GatherParams& p,
                                               const uint8_t* tile, const TileRowMap& map) {
    StoreTile(rows, shape.out_chunks, p.dim, tile, shape.stride, map, reinterpret_cast<uint4*>(p.out));
  }
};

struct CopyRecords {
  template <typename TileRowMap>
  static __device__ __forceinline__ void Store(int rows, const TileShape& shape, const GatherParams& p,
                                               const uint8_t* tile, const TileRowMap& map) {
    const int64_t bytes = PackedRecordBytes(p.dim);
    const int unit = PackedUnit(bytes);
    const int units = static_cast<int>(bytes / unit);
    const int stores = rows * units;
    for (int j = threadIdx.x; j < stores; j += blockDim.x) {
      const int r = j / units, c = j - r * units;
      CopyUnit(tile + map.Record(r) * shape.stride + c * unit, p.records + map.Out(r) * bytes + c * unit, unit);
    }
  }
};

// The persistent-grid tile walk every gather kernel shares. Dynamic shared
// memory holds a tile's records (tile_rows * lanes 16-byte words) and after
// them one TileRowMap::RowInfo per tile row; CTA b takes tiles b, b + gridDim.x,
// ... of the p.num_ids entries. Per tile, prepare(info, first, rows) fills the
// info of the tile's rows and ends with __syncthreads; load(info, j, v) is
// LoadTile's load of word j; TileRowMap(info, first) says which record each row
// decodes into which output row, and Output (DecodeRows, CopyRecords) stores
// the tile. The map is built by its __forceinline__ constructor, not returned
// by a function or lambda: with nvcc 13 for sm_90 the kernels then compile to
// the same machine code as with the loop written out in each, while a
// returned map took the cached dedup kernels from 45 to 58 registers.
template <typename TileRowMap, typename Output = DecodeRows, typename Prepare, typename Load>
__device__ __forceinline__ void GatherTiles(const GatherParams& p, const TileShape& shape, int tile_rows,
                                            const Prepare& prepare, const Load& load) {
  using RowInfo = typename TileRowMap::RowInfo;
  extern __shared__ uint4 tile[];
  RowInfo* info = reinterpret_cast<RowInfo*>(tile + static_cast<int64_t>(tile_rows) * shape.lanes);
  const int64_t num_tiles = (p.num_ids + tile_rows - 1) / tile_rows;

  for (int64_t t = blockIdx.x; t < num_tiles; t += gridDim.x) {
    const int64_t first = t * tile_rows;
    const int rows = RowsOfTile(p.num_ids, first, tile_rows);
    prepare(info, first, rows);

    LoadTile(tile, rows * shape.lanes, [&](int j, uint4& v) { load(info, j, v); });
    __syncthreads();

    Output::Store(rows, shape, p, reinterpret_cast<const uint8_t*>(tile), TileRowMap(info, first));
    __syncthreads();
  }
}

// Dynamic shared memory of a GatherTiles launch with tiles of `tile_rows` rows.
template <typename TileRowMap>
inline size_t TileSharedBytes(int64_t dim, int tile_rows) {
  return static_cast<size_t>(tile_rows) * (RowStride(dim) + sizeof(typename TileRowMap::RowInfo));
}

// The plain gather's tiles: a row's info is its table-local row (kNoRow for
// an id the table does not hold); row r of the tile that starts at entry
// `first` is its own record and output row first + r.
struct ContiguousTileRows {
  using RowInfo = int64_t;
  int64_t first;
  __device__ __forceinline__ ContiguousTileRows(const RowInfo*, int64_t tile_first) : first(tile_first) {}
  __device__ __forceinline__ int Record(int r) const { return r; }
  __device__ __forceinline__ int64_t Out(int r) const { return first + r; }
};

// Kernels in kernels/*.cuh are static, and so is every function that names
// one, directly or through a launcher: each translation unit that includes
// the header gets its own copy, so no symbol is defined twice and no inline
// function refers to another unit's kernel.
//
// tile_rows <= TileRows(stride); smaller tiles spread a small batch over more SMs.
template <typename Output>
static __global__ void __launch_bounds__(kGatherThreads) GatherKernel(GatherParams p, int tile_rows) {
  const TileShape shape = TileShapeOf(p.dim);
  const uint4* table = reinterpret_cast<const uint4*>(p.table);
  GatherTiles<ContiguousTileRows, Output>(
      p, shape, tile_rows,
      [&](int64_t* tile_local, int64_t first, int rows) {
        for (int r = threadIdx.x; r < rows; r += blockDim.x) {
          const int64_t local = static_cast<int64_t>(p.ids[first + r]) - p.row_start;
          tile_local[r] = (local >= 0 && local < p.num_rows) ? local : kNoRow;
        }
        __syncthreads();
      },
      [&](const int64_t* tile_local, int j, uint4& v) {
        const int r = j / shape.lanes;
        const int64_t local = tile_local[r];
        if (local != kNoRow) v = __ldcs(table + local * shape.lanes + (j - r * shape.lanes));
      });
}

// Packed records (PackedRecordBytes(dim) bytes each, back to back, as a packed
// exchange delivers them) decoded into bf16 rows: p.table holds p.num_ids
// records and p.out gets their rows. A tile's records land in shared memory at
// the table's stride, zero padded, so the decode is the gathers' own StoreTile.
static __global__ void __launch_bounds__(kGatherThreads) DecodeRecordsKernel(GatherParams p, int tile_rows) {
  const TileShape shape = TileShapeOf(p.dim);
  const int64_t bytes = PackedRecordBytes(p.dim);
  const int unit = PackedUnit(bytes);
  GatherTiles<ContiguousTileRows>(
      p, shape, tile_rows,
      [&](int64_t* tile_row, int64_t first, int rows) {
        for (int r = threadIdx.x; r < rows; r += blockDim.x) tile_row[r] = first + r;
        __syncthreads();
      },
      [&](const int64_t* tile_row, int j, uint4& v) {
        const int r = j / shape.lanes;
        const int64_t offset = static_cast<int64_t>(j - r * shape.lanes) * 16;
        const int count = static_cast<int>(bytes - offset < 16 ? bytes - offset : 16);
        v = LoadPackedWord(p.table + tile_row[r] * bytes + offset, count, unit);
      });
}

// The default grid of one kernel on each device: CTAs of its widest tile that
// fit on every SM at once, for the last dim asked. Cached because the
// occupancy query costs more than a small launch. The dim (at most kMaxDim)
// and the CTA count share one atomic word, so a reader gets a pair that one
// thread stored, never halves of two; threads that race store the same pair.
// Constant-initialised, so a function-local static of it costs no guard.
class FullGridCache {
 public:
  static constexpr int kMaxDevices = 64;

  // `shared_bytes`: the kernel's dynamic shared memory at its widest tile.
  template <typename Kernel>
  cudaError_t Get(Kernel kernel, int64_t dim, size_t shared_bytes, int* ctas) {
    int device = 0;
    cudaError_t err = cudaGetDevice(&device);
    if (err != cudaSuccess) return err;
    const bool cacheable = device >= 0 && device < kMaxDevices && dim > 0 && dim <= kMaxDim;
    if (cacheable) {
      const uint64_t word = words_[device].load(std::memory_order_relaxed);
      if (word != 0 && static_cast<int64_t>(word >> 32) == dim) {
        *ctas = static_cast<int>(word & 0xFFFFFFFFu);
        return cudaSuccess;
      }
    }
    int sms = 0, per_sm = 0;
    err = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
    if (err != cudaSuccess) return err;
    err = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kGatherThreads, shared_bytes);
    if (err != cudaSuccess) return err;
    *ctas = (sms > 0 ? sms : 1) * (per_sm > 0 ? per_sm : 1);
    if (cacheable) {
      words_[device].store(static_cast<uint64_t>(dim) << 32 | static_cast<uint32_t>(*ctas), std::memory_order_relaxed);
    }
    return cudaSuccess;
  }

 private:
  std::atomic<uint64_t> words_[kMaxDevices] = {};  // 0: nothing cached yet
};

// The grid and tile size of a persistent-grid gather of `num_ids` rows:
// `max_ctas` CTAs (<= 0: `full`), tiles shrunk until the batch gives every
// CTA a tile but kept at 8 rows or more so each thread still has several
// loads in flight, and no more CTAs than tiles.
struct GatherGrid {
  int ctas;
  int tile_rows;
};

inline GatherGrid PlanGatherGrid(int64_t num_ids, int64_t dim, int max_ctas, int full) {
  const int ctas_wanted = max_ctas > 0 ? max_ctas : full;
  const int widest = TileRows(RowStride(dim));
  int64_t rows = (num_ids + ctas_wanted - 1) / ctas_wanted;
  rows = rows < 8 ? 8 : rows;
  const int tile_rows = static_cast<int>(rows > widest ? widest : rows);
  const int64_t tiles = (num_ids + tile_rows - 1) / tile_rows;
  return {static_cast<int>(tiles < ctas_wanted ? tiles : ctas_wanted), tile_rows};
}

// A launch of `kernel`, a GatherTiles kernel over contiguous tile rows, for
// p.num_ids rows on `max_ctas` CTAs (<= 0: the full grid, found once per kernel).
template <typename Kernel>
static inline cudaError_t LaunchContiguous(Kernel kernel, FullGridCache& grid_cache, const GatherParams& p,
                                           int max_ctas, cudaStream_t stream) {
  if (p.num_ids == 0) return cudaSuccess;
  int full = 0;
  if (max_ctas <= 0) {
    cudaError_t err =
        grid_cache.Get(kernel, p.dim, TileSharedBytes<ContiguousTileRows>(p.dim, TileRows(RowStride(p.dim))), &full);
    if (err != cudaSuccess) return err;
  }
  const GatherGrid grid = PlanGatherGrid(p.num_ids, p.dim, max_ctas, full);
  kernel<<<grid.ctas, kGatherThreads, TileSharedBytes<ContiguousTileRows>(p.dim, grid.tile_rows), stream>>>(
      p, grid.tile_rows);
  return cudaGetLastError();
}

// The caller chooses the CTA count, so a background lookup can run on a few
// SMs; max_ctas <= 0 means the full grid. Rows into p.out, or packed records
// into p.records when it is set. Launches nothing for an empty batch.
static inline cudaError_t LaunchGather(const GatherParams& p, int max_ctas, cudaStream_t stream) {
  if (p.records != nullptr) {
    static FullGridCache records_grid;
    return LaunchContiguous(GatherKernel<CopyRecords>, records_grid, p, max_ctas, stream);
  }
  static FullGridCache rows_grid;
  return LaunchContiguous(GatherKernel<DecodeRows>, rows_grid, p, max_ctas, stream);
}

// Decodes `num_rows` packed records at `records` (device memory) into bf16
// rows at `out`, on the full grid. Launches nothing for no rows.
static inline cudaError_t LaunchDecodeRecords(const uint8_t* records, int64_t num_rows, int64_t dim, uint16_t* out,
                                              cudaStream_t stream) {
  GatherParams p;
  p.table = records;
  p.num_rows = num_rows;
  p.dim = dim;
  p.num_ids = num_rows;
  p.out = out;
  static FullGridCache grid_cache;
  return LaunchContiguous(DecodeRecordsKernel, grid_cache, p, 0, stream);
}

}  // namespace engram
