// CUDA gather of Engram row records into bf16 rows. A persistent grid (CTA
// count chosen by the caller, so a background lookup can run on a few SMs)
// walks tiles of rows: all of a tile's 16-byte loads are issued before any is
// used, landing in shared memory, then the tile is decoded and stored 16 bytes
// at a time. No XLA types; launchers return cudaError_t.
#pragma once

#include <cuda_runtime.h>

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

__device__ __forceinline__ uint4 DecodeEight(uint2 packed, uint8_t scale) {
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

// tile_rows <= TileRows(stride); smaller tiles spread a small batch over more SMs.
static __global__ void __launch_bounds__(kGatherThreads) GatherKernel(GatherParams p, int tile_rows) {
  extern __shared__ uint4 tile[];
  const int64_t stride = RowStride(p.dim);
  const int lanes = static_cast<int>(stride / 16);     // 16-byte loads per record
  const int out_chunks = static_cast<int>(p.dim / 8);  // 16-byte stores per output row
  int64_t* tile_local = reinterpret_cast<int64_t*>(tile + static_cast<int64_t>(tile_rows) * lanes);
  const uint4* table = reinterpret_cast<const uint4*>(p.table);
  uint4* out = reinterpret_cast<uint4*>(p.out);
  const int64_t num_tiles = (p.num_ids + tile_rows - 1) / tile_rows;

  for (int64_t t = blockIdx.x; t < num_tiles; t += gridDim.x) {
    const int64_t first = t * tile_rows;
    const int rows = static_cast<int>(p.num_ids - first < tile_rows ? p.num_ids - first : tile_rows);
    for (int r = threadIdx.x; r < rows; r += blockDim.x) {
      const int64_t local = static_cast<int64_t>(p.ids[first + r]) - p.row_start;
      tile_local[r] = (local >= 0 && local < p.num_rows) ? local : kNoRow;
    }
    __syncthreads();

    const int loads = rows * lanes;
    for (int base = threadIdx.x; base < loads; base += blockDim.x * kLoadUnroll) {
      uint4 v[kLoadUnroll];
#pragma unroll
      for (int u = 0; u < kLoadUnroll; ++u) {
        const int j = base + u * blockDim.x;
        v[u] = make_uint4(0, 0, 0, 0);
        if (j < loads) {
          const int r = j / lanes;
          const int64_t local = tile_local[r];
          if (local != kNoRow) v[u] = __ldcs(table + local * lanes + (j - r * lanes));
        }
      }
#pragma unroll
      for (int u = 0; u < kLoadUnroll; ++u) {
        const int j = base + u * blockDim.x;
        if (j < loads) tile[j] = v[u];
      }
    }
    __syncthreads();

    // Absent rows were loaded as zero bytes: fp8 +0 times any scale is +0.
    const uint8_t* bytes = reinterpret_cast<const uint8_t*>(tile);
    const int stores = rows * out_chunks;
    for (int j = threadIdx.x; j < stores; j += blockDim.x) {
      const int r = j / out_chunks, c = j - r * out_chunks;
      const uint8_t* record = bytes + r * stride;
      const uint2 packed = *reinterpret_cast<const uint2*>(record + c * 8);
      const uint8_t scale = record[p.dim + c / 4];
      __stcs(out + (first + r) * out_chunks + c, DecodeEight(packed, scale));
    }
    __syncthreads();
  }
}

inline size_t GatherSharedBytes(int64_t dim, int tile_rows) {
  return static_cast<size_t>(tile_rows) * (RowStride(dim) + sizeof(int64_t));
}

// CTAs of the widest tile that fit on every SM at once; the default grid.
// Cached per device: the occupancy query costs more than a small launch.
inline cudaError_t FullGridCtas(int64_t dim, int* ctas) {
  constexpr int kMaxDevices = 64;
  static int cached_dim[kMaxDevices] = {};
  static int cached_ctas[kMaxDevices] = {};
  int device = 0, sms = 0, per_sm = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err != cudaSuccess) return err;
  if (device < kMaxDevices && cached_dim[device] == dim && cached_ctas[device] > 0) {
    *ctas = cached_ctas[device];
    return cudaSuccess;
  }
  err = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  if (err != cudaSuccess) return err;
  err = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, GatherKernel, kGatherThreads,
                                                      GatherSharedBytes(dim, TileRows(RowStride(dim))));
  if (err != cudaSuccess) return err;
  *ctas = sms * (per_sm > 0 ? per_sm : 1);
  if (device < kMaxDevices) {
    // Benign race: two threads store the same values.
    cached_ctas[device] = *ctas;
    cached_dim[device] = static_cast<int>(dim);
  }
  return cudaSuccess;
}

// max_ctas <= 0 means the full grid. Launches nothing for an empty batch.
inline cudaError_t LaunchGather(const GatherParams& p, int max_ctas, cudaStream_t stream) {
  if (p.num_ids == 0) return cudaSuccess;
  int full = 0;
  if (cudaError_t err = FullGridCtas(p.dim, &full); err != cudaSuccess) return err;
  const int ctas_wanted = max_ctas > 0 ? max_ctas : full;
  // Shrink tiles until the batch gives every CTA a tile, but keep 8 rows or
  // more so each thread still has several loads in flight.
  const int widest = TileRows(RowStride(p.dim));
  int64_t rows = (p.num_ids + ctas_wanted - 1) / ctas_wanted;
  rows = rows < 8 ? 8 : rows;
  const int tile_rows = static_cast<int>(rows > widest ? widest : rows);
  const int64_t tiles = (p.num_ids + tile_rows - 1) / tile_rows;
  const int ctas = static_cast<int>(tiles < ctas_wanted ? tiles : ctas_wanted);
  GatherKernel<<<ctas, kGatherThreads, GatherSharedBytes(p.dim, tile_rows), stream>>>(p, tile_rows);
  return cudaGetLastError();
}

}  // namespace engram
