// Dequantisation of one Engram row record: fp8 e4m3 values times a UE8M0
// block scale, rounded once to bf16, in integer arithmetic. Shared by the CPU
// and CUDA gathers so both produce the same bits.
#pragma once

#include <cstdint>

#include "kernels/host_device.h"

namespace engram {

constexpr int kBlockSize = 32;  // values per UE8M0 scale byte
constexpr int kRecordAlign = 16;
constexpr uint16_t kBf16QuietNaN = 0x7FC0;

// Bytes of one row record: dim fp8 values, dim/32 scale bytes, zero padding
// up to 16 bytes so every row starts on a 16-byte load boundary.
ENGRAM_HD int64_t RowStride(int64_t dim) {
  const int64_t raw = dim + dim / kBlockSize;
  return (raw + kRecordAlign - 1) / kRecordAlign * kRecordAlign;
}

// Bytes of a packed record: a record without its padding (dim fp8 values, then
// dim/32 scale bytes), as a packed exchange moves rows between devices.
ENGRAM_HD int64_t PackedRecordBytes(int64_t dim) { return dim + dim / kBlockSize; }

ENGRAM_HD int HighestBit(uint32_t x) {  // x in [1, 15]
#if defined(__CUDA_ARCH__)
  return 31 - __clz(x);
#else
  return 31 - __builtin_clz(x);
#endif
}

// bf16 bits of fp8_e4m3fn(value) * 2^(scale - 127), rounded to nearest even.
// Integer arithmetic: XLA's CPU threads flush subnormals to zero and a float
// multiply would too, while the exact product of a 4-bit significand and a
// power of two needs no float unit.
// fp8 e4m3fn: bias 7, no infinities, S.1111.111 is NaN. UE8M0 255 is NaN.
ENGRAM_HD uint16_t DequantToBf16Bits(uint8_t value, uint8_t scale) {
  const uint16_t sign = static_cast<uint16_t>(value & 0x80) << 8;
  const uint32_t exp = (value >> 3) & 0xF;
  const uint32_t man = value & 0x7;
  if ((exp == 0xF && man == 0x7) || scale == 0xFF) return sign | kBf16QuietNaN;
  // value = sig * 2^pow2 with a 4-bit integer significand.
  const uint32_t sig = exp ? (8 | man) : man;
  if (sig == 0) return sign;
  const int pow2 = (exp ? static_cast<int>(exp) - 10 : -9) + static_cast<int>(scale) - 127;
  const int top = HighestBit(sig);
  const int unbiased = top + pow2;           // exponent of the product's leading bit
  if (unbiased > 127) return sign | 0x7F80;  // past bf16's range: inf, as float32 gives
  if (unbiased >= -126) {
    // Normal: 4 significant bits always fit bf16's 8, so no rounding.
    const uint32_t fraction = (sig << (7 - top)) & 0x7F;
    return sign | static_cast<uint16_t>(((unbiased + 127) << 7) | fraction);
  }
  // Subnormal: count units of 2^-133, rounding half to even when bits drop.
  const int shift = -133 - pow2;
  if (shift <= 0) return sign | static_cast<uint16_t>(sig << -shift);  // exact
  if (shift > 5) return sign;                                          // below half the smallest subnormal
  const uint32_t kept = sig >> shift;
  const uint32_t rest = sig & ((1u << shift) - 1);
  const uint32_t half = 1u << (shift - 1);
  const uint32_t rounded = kept + ((rest > half || (rest == half && (kept & 1))) ? 1 : 0);
  return sign | static_cast<uint16_t>(rounded);
}

}  // namespace engram
