// Dequantisation of one Engram row record: fp8 e4m3 values times a UE8M0
// block scale, rounded once to bf16. Shared by the CPU and CUDA gathers so
// both produce the same bits; nothing here knows about XLA or CUDA streams.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define ENGRAM_HD __host__ __device__ __forceinline__
#else
#define ENGRAM_HD inline
#endif

namespace engram {

constexpr int kBlockSize = 32;  // values per UE8M0 scale byte
constexpr int kRecordAlign = 16;

// Bytes of one row record: dim fp8 values, dim/32 scale bytes, zero padding
// up to 16 bytes so every row starts on a 16-byte load boundary.
ENGRAM_HD int64_t RowStride(int64_t dim) {
  const int64_t raw = dim + dim / kBlockSize;
  return (raw + kRecordAlign - 1) / kRecordAlign * kRecordAlign;
}

ENGRAM_HD float BitsToFloat(uint32_t bits) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(bits);
#else
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
#endif
}

ENGRAM_HD uint32_t FloatToBits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  return bits;
#endif
}

// OCP fp8 e4m3fn: bias 7, no infinities, S.1111.111 is NaN.
ENGRAM_HD float DecodeE4M3(uint8_t byte) {
  const uint32_t sign = static_cast<uint32_t>(byte & 0x80) << 24;
  const uint32_t exp = (byte >> 3) & 0xF;
  const uint32_t man = byte & 0x7;
  if (exp == 0xF && man == 0x7) return BitsToFloat(sign | 0x7FC00000u);
  if (exp == 0) {
    // Subnormal: man * 2^-9, exact in float32.
    const float mag = static_cast<float>(man) * BitsToFloat(0x3B000000u);  // 2^-9
    return BitsToFloat(FloatToBits(mag) | sign);
  }
  return BitsToFloat(sign | ((exp + 120) << 23) | (man << 20));
}

// UE8M0: 2^(b-127); b = 0 is the float32 subnormal 2^-127, b = 255 is NaN.
ENGRAM_HD float DecodeE8M0(uint8_t byte) {
  if (byte == 0xFF) return BitsToFloat(0x7FC00000u);
  if (byte == 0) return BitsToFloat(0x00400000u);
  return BitsToFloat(static_cast<uint32_t>(byte) << 23);
}

// float32 -> bf16 bits, round to nearest even; NaN becomes the quiet NaN of
// its sign, as ml_dtypes does. (Which sign a NaN product carries differs
// between CPUs and GPUs, so tests compare NaN positions, not NaN bits.)
ENGRAM_HD uint16_t FloatToBf16Bits(float f) {
  const uint32_t bits = FloatToBits(f);
  if ((bits & 0x7FFFFFFFu) > 0x7F800000u) return (bits & 0x80000000u) ? 0xFFC0u : 0x7FC0u;
  const uint32_t rounding = 0x7FFFu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>((bits + rounding) >> 16);
}

// The product is exact in float32 (fp8 has 4 significant bits and the scale
// is a power of two) except where it overflows to inf, so the only rounding
// is the final one to bf16.
ENGRAM_HD uint16_t DequantToBf16Bits(uint8_t value, float scale) {
  return FloatToBf16Bits(DecodeE4M3(value) * scale);
}

}  // namespace engram
