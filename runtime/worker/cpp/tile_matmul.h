// The products on GGUF blocks repacked into tiles (tile_matmul.cc), for block_matmul.cc's FFI
// handler, and the f16 scales both read.

#pragma once

#include <cstdint>
#include <cstring>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "xla/ffi/api/ffi.h"

namespace jaxserve {

// The f16 at p (two bytes, little-endian) as f32: the GGUF blocks' and the tiles' scales.
inline float Half(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
#if defined(__F16C__)
  return _cvtsh_ss(h);
#elif defined(__aarch64__)
  __fp16 f;
  std::memcpy(&f, &h, 2);
  return static_cast<float>(f);
#else
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16;
  uint32_t exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
  if (exp == 0x1f) {
    bits = sign | 0x7f800000 | (man << 13);
  } else if (exp != 0) {
    bits = sign | ((exp + 112) << 23) | (man << 13);
  } else if (man == 0) {
    bits = sign;
  } else {  // subnormal: normalize
    exp = 113;
    while (!(man & 0x400)) { man <<= 1; --exp; }
    bits = sign | (exp << 23) | ((man & 0x3ff) << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
#endif
}

// Bytes of one tile's record for one block of 32 inputs in `format` (a GGML type id); 0 for a
// format the tiles do not hold.
int64_t TileRecordBytes(int format);

// y [M, N] = x [M, K] @ w, w the tiles [N / 16, K / 32 * record]; x rounded per block of 32 to
// 8 bits, or with `f32_activations` as it is.
void TileProduct(xla::ffi::ThreadPool& pool, const float* x, const uint8_t* w, float* y, int64_t M, int64_t K,
                 int64_t N, int format, bool f32_activations);

}  // namespace jaxserve
