// The int8 products on GGUF blocks repacked into tiles (tile_matmul.cc), for block_matmul.cc's
// FFI handler.

#pragma once

#include <cstdint>

#include "xla/ffi/api/ffi.h"

namespace jaxserve {

// Bytes of one tile's record for one block of 32 inputs in `format` (a GGML type id); 0 for a
// format the tiles do not hold.
int64_t TileRecordBytes(int format);

// y [M, N] = x [M, K] @ w, w the tiles [N / 16, K / 32 * record]; x rounded per block of 32 to
// 8 bits, or with `f32_activations` as it is.
void TileProduct(xla::ffi::ThreadPool& pool, const float* x, const uint8_t* w, float* y, int64_t M, int64_t K,
                 int64_t N, int format, bool f32_activations);

}  // namespace jaxserve
