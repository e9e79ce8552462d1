// Trainable tables: the record of one row (float32 or bfloat16 values, then
// the optimizer's state, each part padded to 16 bytes) and the per-element
// optimizer math, shared by the CPU and CUDA kernels so both give the same
// bits. Every float operation is written as an explicitly rounded one (on the
// device __fmul_rn & co., which nvcc never contracts into an FMA), so the
// order of roundings is the one engram_jax.testing's references follow.
// Framework-free: no XLA types.
#pragma once

#include <cstdint>
#include <cstring>
#include <string>

#include "kernels/dedup_params.h"

#if defined(__CUDACC__)
#define ENGRAM_HD __host__ __device__ __forceinline__
#else
#define ENGRAM_HD inline
#endif

namespace engram {

// What a table's records hold (the registry's TableEntry::format).
enum class RowFormat : int32_t {
  kFp8Records = 0,  // the serving records of row_decode.h
  kF32 = 1,
  kBf16 = 2,
};

// The optimizers of engram_jax.row_optimizers, by the code Python passes.
enum class RowOptimizerKind : int32_t {
  kSgd = 0,         // no state
  kAdagrad = 1,     // one float32 accumulator per value (optax.adagrad)
  kRowAdagrad = 2,  // one float32 accumulator per row
  kLazyAdam = 3,    // first and second moments per value, float32 or bfloat16
};

inline bool ValidOptimizer(int64_t kind) { return kind >= 0 && kind <= 3; }
inline bool ValidRowFormat(int64_t format) { return format == 1 || format == 2; }

ENGRAM_HD int64_t ValueBytes(RowFormat format) { return format == RowFormat::kF32 ? 4 : 2; }

inline int64_t RoundUp16(int64_t bytes) { return (bytes + 15) / 16 * 16; }

// Bytes of optimizer state per row.
inline int64_t StateBytes(RowOptimizerKind kind, int64_t dim, RowFormat moment_format) {
  switch (kind) {
    case RowOptimizerKind::kSgd:
      return 0;
    case RowOptimizerKind::kAdagrad:
      return 4 * dim;
    case RowOptimizerKind::kRowAdagrad:
      return 4;
    case RowOptimizerKind::kLazyAdam:
      return 2 * dim * ValueBytes(moment_format);
  }
  return 0;
}

// Where the state starts in a record: after the row's values, on a 16-byte
// boundary (so the CUDA lookup copies a row in 16-byte loads when its bytes allow).
inline int64_t StateOffset(RowFormat format, int64_t dim) { return RoundUp16(dim * ValueBytes(format)); }

// One row's record: values, state, padding; one place per row, so an update
// reads and writes each row with its state in one contiguous run of bytes.
inline int64_t TrainableStride(RowFormat format, int64_t dim, RowOptimizerKind kind, RowFormat moment_format) {
  return RoundUp16(StateOffset(format, dim) + StateBytes(kind, dim, moment_format));
}

// Widest trainable row (table.py's MAX_DIM, as for the fp8 records).
constexpr int64_t kMaxTrainableDim = 16384;

// "" when the layout is one this code lays out itself, else why not.
inline std::string CheckTrainableLayout(RowFormat format, int64_t dim, int64_t stride, int64_t state_offset,
                                        int32_t optimizer, RowFormat moment_format) {
  if (!ValidRowFormat(static_cast<int64_t>(format))) return "a trainable table's rows are float32 or bfloat16";
  if (dim <= 0 || dim > kMaxTrainableDim) {
    return "dim must be in [1, " + std::to_string(kMaxTrainableDim) + "], got " + std::to_string(dim);
  }
  if (!ValidOptimizer(optimizer)) return "unknown optimizer code " + std::to_string(optimizer);
  if (!ValidRowFormat(static_cast<int64_t>(moment_format))) return "moments are float32 or bfloat16";
  const auto kind = static_cast<RowOptimizerKind>(optimizer);
  if (state_offset != StateOffset(format, dim) || stride != TrainableStride(format, dim, kind, moment_format)) {
    return "record layout (stride " + std::to_string(stride) + ", state at " + std::to_string(state_offset) +
           ") is not the one of kernels/train_rows.h";
  }
  return "";
}

// -- rounded float arithmetic, the same on host and device --------------------

ENGRAM_HD float FMul(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}
ENGRAM_HD float FAdd(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}
ENGRAM_HD float FSub(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fsub_rn(a, b);
#else
  return a - b;
#endif
}
ENGRAM_HD float FDiv(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}
ENGRAM_HD float FSqrt(float a) {
#if defined(__CUDA_ARCH__)
  return __fsqrt_rn(a);
#else
  return __builtin_sqrtf(a);
#endif
}

ENGRAM_HD float BitsToFloat(uint32_t bits) {
  float f;
  memcpy(&f, &bits, 4);
  return f;
}
ENGRAM_HD uint32_t FloatToBits(float f) {
  uint32_t bits;
  memcpy(&bits, &f, 4);
  return bits;
}

ENGRAM_HD float Bf16ToFloat(uint16_t bits) { return BitsToFloat(static_cast<uint32_t>(bits) << 16); }

// Round to nearest even, as ml_dtypes casts; NaN stays a quiet NaN of its sign.
// Both results computed and one selected, so a loop of these vectorises.
ENGRAM_HD uint16_t FloatToBf16(float f) {
  const uint32_t bits = FloatToBits(f);
  const uint32_t quiet_nan = (bits >> 16) | 0x0040u;
  const uint32_t rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
  return static_cast<uint16_t>((bits & 0x7FFFFFFFu) > 0x7F800000u ? quiet_nan : rounded);
}

// A value stored as `format` and read back.
ENGRAM_HD float RoundTo(RowFormat format, float x) {
  return format == RowFormat::kBf16 ? Bf16ToFloat(FloatToBf16(x)) : x;
}

ENGRAM_HD float LoadValue(const uint8_t* values, RowFormat format, int64_t j) {
  if (format == RowFormat::kF32) {
    float f;
    memcpy(&f, values + 4 * j, 4);
    return f;
  }
  uint16_t h;
  memcpy(&h, values + 2 * j, 2);
  return Bf16ToFloat(h);
}

ENGRAM_HD void StoreValue(uint8_t* values, RowFormat format, int64_t j, float x) {
  if (format == RowFormat::kF32) {
    memcpy(values + 4 * j, &x, 4);
  } else {
    const uint16_t h = FloatToBf16(x);
    memcpy(values + 2 * j, &h, 2);
  }
}

// -- the optimizers, one value at a time ---------------------------------------

// The scalars of one update. `lr` is the learning rate (lazy Adam: the
// bias-corrected step size lr * sqrt(1 - b2^t) / (1 - b1^t), computed by the
// caller), read from the call's operand when the kernel runs.
struct OptimizerScalars {
  float eps = 0.0f;
  float one_minus_b1 = 0.0f;  // lazy Adam: 1 - b1, rounded to float32 once
  float one_minus_b2 = 0.0f;
};

// p + (-lr) * g: optax.sgd's update and apply_updates, bit for bit.
ENGRAM_HD float SgdValue(float p, float g, float lr) { return FAdd(p, FMul(-lr, g)); }

// optax.adagrad's order of roundings: acc' = g*g + acc; scale = 1/sqrt(acc' + eps)
// where acc' > 0, else 0; p + (-lr) * (scale * g). (XLA's rsqrt is not always
// the correctly rounded 1/sqrt, so this matches optax to a stated tolerance.)
ENGRAM_HD float AdagradValue(float p, float g, float* acc, float lr, const OptimizerScalars& s) {
  const float a = FAdd(FMul(g, g), *acc);
  *acc = a;
  const float scale = a > 0.0f ? FDiv(1.0f, FSqrt(FAdd(a, s.eps))) : 0.0f;
  return FAdd(p, FMul(-lr, FMul(scale, g)));
}

// torch.optim.SparseAdam on one value of a row with a gradient:
// m += (g - m) * (1 - b1); v += (g*g - v) * (1 - b2) (each stored in the moments'
// dtype and used as stored); p + (-step) * (m / (sqrt(v) + eps)).
ENGRAM_HD float LazyAdamValue(float p, float g, float* m, float* v, float step, RowFormat moment_format,
                              const OptimizerScalars& s) {
  const float m1 = RoundTo(moment_format, FAdd(*m, FMul(FSub(g, *m), s.one_minus_b1)));
  const float v1 = RoundTo(moment_format, FAdd(*v, FMul(FSub(FMul(g, g), *v), s.one_minus_b2)));
  *m = m1;
  *v = v1;
  return FAdd(p, FMul(-step, FDiv(m1, FAdd(FSqrt(v1), s.eps))));
}

// Row-wise Adagrad: the row's squared gradient summed in 32 lanes (value j into
// lane j % 32, in order of j), the lanes folded in halves (16, 8, 4, 2, 1: the
// CUDA kernel's warp butterfly), divided by dim; acc' = acc + mean;
// multiplier = lr / (sqrt(acc') + eps); each value p - multiplier * g.
constexpr int kRowLanes = 32;

ENGRAM_HD float FoldLanes(float* lanes) {
  for (int half = kRowLanes / 2; half >= 1; half /= 2) {
    for (int l = 0; l < half; ++l) lanes[l] = FAdd(lanes[l], lanes[l + half]);
  }
  return lanes[0];
}

ENGRAM_HD float RowAdagradMultiplier(float* acc, float sum_of_squares, int64_t dim, float lr,
                                     const OptimizerScalars& s) {
  const float a = FAdd(*acc, FDiv(sum_of_squares, static_cast<float>(dim)));
  *acc = a;
  return FDiv(lr, FAdd(FSqrt(a), s.eps));
}

ENGRAM_HD float RowAdagradValue(float p, float g, float multiplier) { return FSub(p, FMul(multiplier, g)); }

// -- what an update call works on ------------------------------------------------

struct TrainableView {
  uint8_t* table = nullptr;  // row 0's record
  int64_t row_start = 0;
  int64_t num_rows = 0;
  int64_t dim = 0;
  int64_t stride = 0;        // bytes per record
  int64_t state_offset = 0;  // where the state starts in a record
  RowFormat format = RowFormat::kF32;
  RowOptimizerKind optimizer = RowOptimizerKind::kSgd;
  RowFormat moment_format = RowFormat::kF32;
};

// -- the order of a run's gradient sum ------------------------------------------

// The ids of an update sorted stably, a run of equal ids (in position order)
// is cut into chunks of kGradChunk consecutive entries from the run's start;
// each chunk is summed in position order in float32 from +0.0, then the chunk
// sums are added in order from +0.0. Chunks let the CUDA kernel sum a hot
// row's chunks on many warps at once and still give the CPU's bits; a run of
// at most kGradChunk entries is its plain position-order sum (0 + s is s: a
// sum from +0.0 is never -0.0). engram_jax.testing.row_optimizers.GRAD_CHUNK
// is the same number.
constexpr int64_t kGradChunk = 64;

// CUDA: the sums of the full chunks of runs longer than a chunk, dim float32
// a slot, a slot per kGradChunk sorted entries (train.cuh: SumWindowChunk).
inline int64_t ChunkSumsBytes(int64_t num_ids, int64_t dim) { return AlignWorkspace(4 * dim * (num_ids / kGradChunk)); }

// CUDA: a uint32 a slot, a run's arrival count at its first slot, zeroed
// before the update kernel (train.cuh: the warp whose chunk of a run is the
// last summed updates its row).
inline int64_t ChunkArrivalsBytes(int64_t num_ids) { return AlignWorkspace(4 * (num_ids / kGradChunk)); }

// Workspace an update of num_ids ids of `dim` values takes: the sort's
// (LookupWorkspaceBytes(num_ids, kSorted)), then on CUDA the chunk sums and
// their arrival counts. The CPU path uses the first 8 bytes per id.
inline int64_t UpdateWorkspaceBytes(int64_t num_ids, int64_t dim) {
  if (num_ids <= 0) return 0;
  return LookupWorkspaceBytes(num_ids, VisitOrder::kSorted) + ChunkSumsBytes(num_ids, dim) +
         ChunkArrivalsBytes(num_ids);
}

// The synchronous apply_gradients call's one result: the update token (an
// int32 zero) in the first kUpdateTokenBytes, then the workspace. One buffer,
// not a token and a workspace: XLA's dynamic-slice fusion moves a custom call
// whose operand is a slice at a constant or loop-index offset (the ids of a
// scan step, ids[k]) into a fusion, and for a call of several results it left
// the side-effecting original in place as well, so the update ran twice.
constexpr int64_t kUpdateTokenBytes = 16;
inline int64_t UpdateResultBytes(int64_t num_ids, int64_t dim) {
  return kUpdateTokenBytes + UpdateWorkspaceBytes(num_ids, dim);
}

struct UpdateParams {
  TrainableView t;
  const int32_t* ids = nullptr;  // global row ids; ids the table does not hold are skipped
  int64_t num_ids = 0;
  const void* grads = nullptr;  // [num_ids, dim], float32 or bfloat16
  bool grads_bf16 = false;
  const float* lr = nullptr;  // one float32: host memory on the CPU, device memory on CUDA
  OptimizerScalars scalars;
  uint8_t* workspace = nullptr;  // UpdateWorkspaceBytes(num_ids, t.dim) bytes, any contents
  int64_t workspace_bytes = 0;
};

ENGRAM_HD float LoadGrad(const void* grads, bool bf16, int64_t index) {
  if (bf16) {
    uint16_t h;
    memcpy(&h, static_cast<const uint8_t*>(grads) + 2 * index, 2);
    return Bf16ToFloat(h);
  }
  float f;
  memcpy(&f, static_cast<const uint8_t*>(grads) + 4 * index, 4);
  return f;
}

// One value of a row updated with its summed gradient g by an element-wise
// optimizer (not row-wise Adagrad), from the value p and its state as loaded
// (Adagrad: *s0 the accumulator; lazy Adam: *s0, *s1 the moments m, v, as
// float32 whatever their dtype), which it updates in place; returns the new
// value. Loads and stores are the caller's, so the CUDA kernel can load a
// row's whole record before it stores any of it.
ENGRAM_HD float OptimizeValue(RowOptimizerKind kind, RowFormat moment_format, float p, float g, float* s0, float* s1,
                              float lr, const OptimizerScalars& s) {
  switch (kind) {
    case RowOptimizerKind::kAdagrad:
      return AdagradValue(p, g, s0, lr, s);
    case RowOptimizerKind::kLazyAdam:
      return LazyAdamValue(p, g, s0, s1, lr, moment_format, s);
    default:
      return SgdValue(p, g, lr);
  }
}

}  // namespace engram
