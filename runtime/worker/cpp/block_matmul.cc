// Products of a few f32 rows with weights kept in a GGUF file's own quantization blocks, for decode
// steps on XLA:CPU, called through XLA's FFI (runtime/worker/cpp_kernels.py):
//   x f32 [M, K] @ w -> y f32 [M, N]
// where w is u8 [N, K / 32 * B]: output column n's weights along K, as GGUF stores a tensor's rows,
// in blocks of 32 values of B bytes each, in one of three block formats (attribute `format`, GGML's
// type id; see ir/blocks.py):
//   Q4_0 (2):  f16 d, 16 bytes of nibbles           value = d * (q - 8)
//   Q4_1 (3):  f16 d, f16 m, 16 bytes of nibbles    value = d * q + m
//   Q8_0 (8):  f16 d, 32 int8                       value = d * q
// A nibble byte j holds value j in its low half and value j + 16 in its high half. w may also be a
// stack [L, N, K / 32 * B] with the layer to take given by a third operand, an int32 scalar, as
// in matmul.cc. The same handler serves the tiles of tile_matmul.cc (attribute `layout` 1: the
// int8 products of gguf_activations=q8; 2: f32 activations, gguf_tiles).
//
// Why: a decode step of a few rows streams every weight once, so its speed is the rate at which
// the weights come in from memory. The f32 weights a GGUF file's blocks dequantize to are 6.4x the
// bytes of Q4_1 blocks (538 MB against 84 MB for SmolLM2-135M, with its Q8_0 embedding as the LM
// head); reading the blocks and widening them in registers reads the same values from a fifth of
// the bytes. The activations stay f32, and each block's values are widened to f32 in registers, so
// the product is x @ dequantize(w) up to the order (and fusing) of the f32 sums. Each work item is a run of output
// columns, whose weight rows are contiguous bytes; every block is widened once for all M rows.
//
// The vector path needs AVX-512BW, AVX2 with FMA and F16C, or aarch64's NEON (the same code at 16,
// 8 or 4 lanes);
// elsewhere a scalar loop gives the same values, and cpp_kernels.blocks_vectorized() keeps the
// engine on XLA's products.

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#elif defined(__aarch64__) && defined(__ARM_NEON)
#include <arm_neon.h>
#endif

#include "parallel_for.h"
#include "tile_matmul.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kBlock = 32;  // values per block, in every format here
constexpr int kQ4_0 = 2, kQ4_1 = 3, kQ8_0 = 8;
constexpr int64_t kTileCols = 16;  // output columns per tile (tile_matmul.cc)
constexpr int64_t kItemCols = 16;  // output columns per work item, at least
// Output columns ahead whose block rows are requested while this pair is read: the hardware
// prefetcher alone kept a cold 18 MB product at 9.7 GB/s, 8 columns ahead at 14.6 (2.3 KB ahead
// for SmolLM2's K = 576; docs/benchmarks/, "Decode steps from the GGUF's own blocks").
constexpr int64_t kPrefetchCols = 8;

int64_t BlockBytes(int format) {
  switch (format) {
    case kQ4_0: return 18;
    case kQ4_1: return 20;
    case kQ8_0: return 34;
    default: return 0;
  }
}

using jaxserve::Half;

// The 32 values of a block.
template <int F>
inline void Values(const uint8_t* blk, float* out) {
  const float d = Half(blk);
  if (F == kQ8_0) {
    for (int j = 0; j < 32; ++j) out[j] = d * static_cast<float>(static_cast<int8_t>(blk[2 + j]));
  } else {
    const uint8_t* qs = blk + (F == kQ4_1 ? 4 : 2);
    const int bias = F == kQ4_0 ? 8 : 0;
    const float m = F == kQ4_1 ? Half(blk + 2) : 0.0f;
    for (int j = 0; j < 16; ++j) {
      out[j] = d * static_cast<float>((qs[j] & 0x0f) - bias) + m;
      out[j + 16] = d * static_cast<float>((qs[j] >> 4) - bias) + m;
    }
  }
}

struct Args {
  const float* x;     // [M, K]
  const uint8_t* w;   // [N, nb * B]
  float* y;           // [M, N]
  int64_t M, K, N, nb;
};

template <int F>
void ScalarColumns(const Args& a, int64_t n0, int64_t n1) {
  const int64_t B = BlockBytes(F);
  float v[kBlock];
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = a.w + n * a.nb * B;
    for (int64_t m = 0; m < a.M; ++m) a.y[m * a.N + n] = 0.0f;
    for (int64_t b = 0; b < a.nb; ++b) {
      const uint8_t* blk = row + b * B;
      Values<F>(blk, v);
      for (int64_t m = 0; m < a.M; ++m) {
        const float* xb = a.x + m * a.K + b * kBlock;
        float s = 0.0f;
        for (int j = 0; j < kBlock; ++j) s += xb[j] * v[j];
        a.y[m * a.N + n] += s;
      }
    }
  }
}

// The vector path: AVX-512BW (16 lanes), AVX2 with FMA and F16C (8 lanes) or aarch64's NEON (4
// lanes), one code for all three over Vec, each block's 32 values in kBlock / Vec::kLanes vectors.
#if defined(__AVX512BW__)
#define JAXSERVE_BLOCKS_VECTOR 1
struct Vec {
  using T = __m512;
  static constexpr int kLanes = 16;
  static constexpr int kRows = 8;  // rows per pass: 2 columns x 8 rows of accumulators, of 32 registers
  static T Zero() { return _mm512_setzero_ps(); }
  static T Set1(float f) { return _mm512_set1_ps(f); }
  static T Load(const float* p) { return _mm512_loadu_ps(p); }
  static T Mul(T a, T b) { return _mm512_mul_ps(a, b); }
  static T Add(T a, T b) { return _mm512_add_ps(a, b); }
  static T Fmadd(T a, T b, T c) { return _mm512_fmadd_ps(a, b, c); }
  static float Sum(T a) { return _mm512_reduce_add_ps(a); }
  static T Bytes(const uint8_t* p, bool is_signed) {  // 16 bytes, widened to 16 int32 as f32
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm512_cvtepi32_ps(is_signed ? _mm512_cvtepi8_epi32(b) : _mm512_cvtepu8_epi32(b));
  }
  // 16 nibble bytes -> values 0-15 (low halves) and 16-31 (high halves), less `bias`.
  static void Nibbles(const uint8_t* p, int bias, T* v) {
    const __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    const __m512i b = _mm512_set1_epi32(bias);
    v[0] = _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_and_si512(q, _mm512_set1_epi32(0x0f)), b));
    v[1] = _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_srli_epi32(q, 4), b));
  }
  // A 4-bit block's 32 values, scaled, by table: its 16 possible values d * k + m (k = 0-15; Q4_0's
  // m = -8 d, exact, so d * k - 8 d rounds as d * (k - 8) does) in one register, which vpermps
  // indexes by each nibble (it reads an index's low 4 bits, so the low halves need no mask). One
  // multiply-add and two permutes replace two conversions and two multiply-adds: 1.3x (Q4_0) and
  // 1.7x (Q4_1) faster for one row, in cache. The values are those of Widen and the multiply-add
  // of the other paths, bit for bit.
  static constexpr bool kTable = true;
  template <bool kQ41>
  static void ScaledNibbles(const uint8_t* blk, T* v) {
    const __m512 k = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    __m512 d, m;
    if (kQ41) {  // f16 d and m side by side
      int32_t dm;
      std::memcpy(&dm, blk, 4);
      const __m128 s = _mm_cvtph_ps(_mm_cvtsi32_si128(dm));
      d = _mm512_broadcastss_ps(s);
      m = _mm512_broadcastss_ps(_mm_movehdup_ps(s));
    } else {
      d = _mm512_set1_ps(Half(blk));
      m = _mm512_mul_ps(d, _mm512_set1_ps(-8.0f));
    }
    const __m512 table = _mm512_fmadd_ps(k, d, m);
    const __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + (kQ41 ? 4 : 2))));
    v[0] = _mm512_permutexvar_ps(q, table);
    v[1] = _mm512_permutexvar_ps(_mm512_srli_epi32(q, 4), table);
  }
};
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define JAXSERVE_BLOCKS_VECTOR 1
struct Vec {
  using T = __m256;
  static constexpr int kLanes = 8;
  static constexpr int kRows = 4;  // 16 registers: 4 rows' accumulators beside one column's 4 vectors
  static constexpr bool kTable = false;
  template <bool kQ41>
  static void ScaledNibbles(const uint8_t*, T*) {}
  static T Zero() { return _mm256_setzero_ps(); }
  static T Set1(float f) { return _mm256_set1_ps(f); }
  static T Load(const float* p) { return _mm256_loadu_ps(p); }
  static T Mul(T a, T b) { return _mm256_mul_ps(a, b); }
  static T Add(T a, T b) { return _mm256_add_ps(a, b); }
  static T Fmadd(T a, T b, T c) { return _mm256_fmadd_ps(a, b, c); }
  static float Sum(T a) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
  }
  static T Bytes(const uint8_t* p, bool is_signed) {  // 8 bytes, widened to 8 int32 as f32
    const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
    return _mm256_cvtepi32_ps(is_signed ? _mm256_cvtepi8_epi32(b) : _mm256_cvtepu8_epi32(b));
  }
  static void Nibbles(const uint8_t* p, int bias, T* v) {
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    const __m256i b = _mm256_set1_epi32(bias), low = _mm256_set1_epi32(0x0f);
    for (int h = 0; h < 2; ++h) {  // bytes 0-7, then 8-15
      const __m256i q = _mm256_cvtepu8_epi32(h ? _mm_srli_si128(bytes, 8) : bytes);
      v[h] = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_and_si256(q, low), b));
      v[h + 2] = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_srli_epi32(q, 4), b));
    }
  }
};
#elif defined(__aarch64__) && defined(__ARM_NEON)
#define JAXSERVE_BLOCKS_VECTOR 1
struct Vec {
  using T = float32x4_t;
  static constexpr int kLanes = 4;
  static constexpr int kRows = 4;  // 32 registers: 4 rows' accumulators beside one column's 8 vectors
  static constexpr bool kTable = false;
  template <bool kQ41>
  static void ScaledNibbles(const uint8_t*, T*) {}
  static T Zero() { return vdupq_n_f32(0.0f); }
  static T Set1(float f) { return vdupq_n_f32(f); }
  static T Load(const float* p) { return vld1q_f32(p); }
  static T Mul(T a, T b) { return vmulq_f32(a, b); }
  static T Add(T a, T b) { return vaddq_f32(a, b); }
  static T Fmadd(T a, T b, T c) { return vfmaq_f32(c, a, b); }
  static float Sum(T a) { return vaddvq_f32(a); }
  static T Bytes(const uint8_t* p, bool is_signed) {  // 4 bytes, widened to 4 int32 as f32
    uint32_t u;
    std::memcpy(&u, p, 4);
    const uint8x8_t b = vreinterpret_u8_u32(vdup_n_u32(u));
    if (is_signed) return vcvtq_f32_s32(vmovl_s16(vget_low_s16(vmovl_s8(vreinterpret_s8_u8(b)))));
    return vcvtq_f32_u32(vmovl_u16(vget_low_u16(vmovl_u8(b))));
  }
  static void Nibbles(const uint8_t* p, int bias, T* v) {
    const uint8x16_t q = vld1q_u8(p);
    const int32x4_t b = vdupq_n_s32(bias);
    const uint8x16_t halves[2] = {vandq_u8(q, vdupq_n_u8(0x0f)), vshrq_n_u8(q, 4)};
    for (int h = 0; h < 2; ++h) {  // low halves: values 0-15; high halves: 16-31
      const uint16x8_t lo = vmovl_u8(vget_low_u8(halves[h])), hi = vmovl_u8(vget_high_u8(halves[h]));
      const uint16x4_t parts[4] = {vget_low_u16(lo), vget_high_u16(lo), vget_low_u16(hi), vget_high_u16(hi)};
      for (int i = 0; i < 4; ++i) {
        v[h * 4 + i] = vcvtq_f32_s32(vsubq_s32(vreinterpretq_s32_u32(vmovl_u16(parts[i])), b));
      }
    }
  }
};
#endif

#if defined(JAXSERVE_BLOCKS_VECTOR)
constexpr int kVecs = kBlock / Vec::kLanes;  // vectors per block

// A block's 32 values before its scale, in order.
template <int F>
inline void Widen(const uint8_t* blk, Vec::T* v) {
  if (F == kQ8_0) {
    for (int i = 0; i < kVecs; ++i) v[i] = Vec::Bytes(blk + 2 + i * Vec::kLanes, true);
  } else {
    Vec::Nibbles(blk + (F == kQ4_1 ? 4 : 2), F == kQ4_0 ? 8 : 0, v);
  }
}

// Rows [m0, m0 + MR) times output columns [n0, n1), C columns at a time, so that each row has C
// independent accumulator chains in flight. Each block is widened and scaled once (d * q, plus m
// for Q4_1: one multiply-add per vector) for all MR rows, which then take a multiply-add per
// vector each; a single row of Q4_0 or Q8_0 saves one by scaling its block sum instead (d * sum of
// x * q).
template <int F, int MR, int C>
void VectorColumns(const Args& a, int64_t m0, int64_t n0, int64_t n1) {
  constexpr bool kTable = Vec::kTable && F != kQ8_0;
  constexpr bool kScaleSums = MR == 1 && F != kQ4_1 && !kTable;
  // Accumulators per row and column: two chains where the rows are few, so that a block's
  // multiply-adds do not wait on each other's latency.
  constexpr int kChains = MR <= 2 && kVecs >= 2 && !kScaleSums ? 2 : 1;
  const int64_t B = BlockBytes(F);
  const int64_t stride = a.nb * B;
  const float* x[MR];
  for (int m = 0; m < MR; ++m) x[m] = a.x + (m0 + m) * a.K;
  int64_t n = n0;
  for (; n + C <= n1; n += C) {
    const uint8_t* r = a.w + n * stride;
    Vec::T acc[C][MR][kChains];
    for (int c = 0; c < C; ++c)
      for (int m = 0; m < MR; ++m)
        for (int h = 0; h < kChains; ++h) acc[c][m][h] = Vec::Zero();
    for (int64_t b = 0; b < a.nb; ++b) {
      Vec::T v[C][kVecs], d[C];
      if ((b * B) % 64 < B) {  // once per cache line: every line has one block start in its first B bytes
        for (int c = 0; c < C; ++c) {
          __builtin_prefetch(r + (c + kPrefetchCols) * stride + b * B, 0, 3);
        }
      }
      for (int c = 0; c < C; ++c) {
        const uint8_t* blk = r + c * stride + b * B;
        if (kTable) {
          Vec::template ScaledNibbles<F == kQ4_1>(blk, v[c]);
          continue;
        }
        Widen<F>(blk, v[c]);
        d[c] = Vec::Set1(Half(blk));
        if (!kScaleSums) {
          const Vec::T mn = Vec::Set1(F == kQ4_1 ? Half(blk + 2) : 0.0f);
          for (int i = 0; i < kVecs; ++i) v[c][i] = F == kQ4_1 ? Vec::Fmadd(v[c][i], d[c], mn) : Vec::Mul(v[c][i], d[c]);
        }
      }
      for (int m = 0; m < MR; ++m) {
        Vec::T xv[kVecs];
        for (int i = 0; i < kVecs; ++i) xv[i] = Vec::Load(x[m] + b * kBlock + i * Vec::kLanes);
        for (int c = 0; c < C; ++c) {
          if (kScaleSums) {
            Vec::T p = Vec::Mul(v[c][0], xv[0]);
            for (int i = 1; i < kVecs; ++i) p = Vec::Fmadd(v[c][i], xv[i], p);
            acc[c][m][0] = Vec::Fmadd(p, d[c], acc[c][m][0]);
          } else {
            for (int i = 0; i < kVecs; ++i) {
              acc[c][m][i % kChains] = Vec::Fmadd(v[c][i], xv[i], acc[c][m][i % kChains]);
            }
          }
        }
      }
    }
    for (int c = 0; c < C; ++c) {
      for (int m = 0; m < MR; ++m) {
        Vec::T s = acc[c][m][0];
        for (int h = 1; h < kChains; ++h) s = Vec::Add(s, acc[c][m][h]);
        a.y[(m0 + m) * a.N + n + c] = Vec::Sum(s);
      }
    }
  }
  if (C > 1 && n < n1) VectorColumns<F, MR, 1>(a, m0, n, n1);
}

// Columns per pass at MR rows: two where the registers hold both columns' values and accumulators.
template <int MR>
constexpr int PassColumns() { return Vec::kLanes == 16 || MR <= 2 ? 2 : 1; }

// The last M - m rows (fewer than Vec::kRows), in one pass.
template <int F, int MR>
void RowsTail(const Args& a, int64_t m, int64_t n0, int64_t n1) {
  if constexpr (MR > 0) {
    if (a.M - m == MR) {
      VectorColumns<F, MR, PassColumns<MR>()>(a, m, n0, n1);
    } else {
      RowsTail<F, MR - 1>(a, m, n0, n1);
    }
  }
}

template <int F>
void VectorRows(const Args& a, int64_t n0, int64_t n1) {
  int64_t m = 0;
  for (; m + Vec::kRows <= a.M; m += Vec::kRows) VectorColumns<F, Vec::kRows, PassColumns<Vec::kRows>()>(a, m, n0, n1);
  RowsTail<F, Vec::kRows - 1>(a, m, n0, n1);
}
#endif

template <int F>
void Product(ffi::ThreadPool& pool, const Args& a) {
  const int64_t threads = pool.num_threads() + 1;
  // About eight items per thread, so that a thread held up elsewhere delays little.
  const int64_t cols = std::max<int64_t>(kItemCols, (a.N + 8 * threads - 1) / (8 * threads) / 2 * 2);
  const int64_t items = (a.N + cols - 1) / cols;
  jaxserve::ParallelFor(pool, items, [=](int64_t t) {
    const int64_t n0 = t * cols, n1 = std::min(a.N, n0 + cols);
#if defined(JAXSERVE_BLOCKS_VECTOR)
    VectorRows<F>(a, n0, n1);
#else
    ScalarColumns<F>(a, n0, n1);
#endif
  });
}

// layout 0: w [N, K / 32 * B] in the file's rows (above); 1: tiles [N / 16, K / 32 * record bytes]
// (tile_matmul.cc, int8 products of the rounded activations); 2: the same tiles, f32 activations.
ffi::Error BlockMatmulImpl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::AnyBuffer layer,
                           ffi::Result<ffi::AnyBuffer> y, int64_t format, int64_t layout) {
  const auto xd = x.dimensions(), wd = w.dimensions(), yd = y->dimensions();
  const size_t r = wd.size();
  const bool tiles = layout == 1 || layout == 2;
  const int64_t B = tiles ? jaxserve::TileRecordBytes(static_cast<int>(format)) : BlockBytes(static_cast<int>(format));
  if (B == 0 || layout < 0 || layout > 2) {
    return ffi::Error::InvalidArgument("block_matmul: format must be 2 (Q4_0), 3 (Q4_1), 8 (Q8_0) or, in tiles "
                                       "only, 12 (Q4_K), 13 (Q5_K) or 14 (Q6_K); layout 0 (rows), 1 (tiles, int8) or 2 (tiles, f32); got " + std::to_string(format) + ", " +
                                       std::to_string(layout));
  }
  const int64_t cols = tiles ? kTileCols : 1;  // output columns per row of w
  if (xd.size() != 2 || (r != 2 && r != 3) || yd.size() != 2 || yd[0] != xd[0] || yd[1] != wd[r - 2] * cols ||
      xd[1] % kBlock != 0 || wd[r - 1] != xd[1] / kBlock * B || layer.element_count() != 1) {
    return ffi::Error::InvalidArgument(
        "block_matmul: x [M, K] (K a multiple of 32) @ w [N, K / 32 * block bytes] (tiles: [N / 16, K / 32 * "
        "record bytes]) or [L, ...], layer [] -> y [M, N]");
  }
  if (x.element_type() != ffi::F32 || w.element_type() != ffi::U8 || y->element_type() != ffi::F32 ||
      layer.element_type() != ffi::S32) {
    return ffi::Error::InvalidArgument("block_matmul: x f32, w u8, layer s32, y f32");
  }
  const int64_t l = *static_cast<const int32_t*>(layer.untyped_data()), layers = r == 3 ? wd[0] : 1;
  if (l < 0 || l >= layers) {
    return ffi::Error::InvalidArgument("block_matmul: layer " + std::to_string(l) + " of " + std::to_string(layers));
  }
  const int64_t M = xd[0], K = xd[1], N = yd[1], nb = K / kBlock;
  if (M == 0 || N == 0) return ffi::Error::Success();
  const float* xp = static_cast<const float*>(x.untyped_data());
  const uint8_t* wp = static_cast<const uint8_t*>(w.untyped_data()) + l * wd[r - 2] * nb * B;
  float* yp = static_cast<float*>(y->untyped_data());
  if (tiles) {
    jaxserve::TileProduct(pool, xp, wp, yp, M, K, N, static_cast<int>(format), layout == 2);
    return ffi::Error::Success();
  }
  const Args a{xp, wp, yp, M, K, N, nb};
  switch (format) {
    case kQ4_0: Product<kQ4_0>(pool, a); break;
    case kQ4_1: Product<kQ4_1>(pool, a); break;
    default: Product<kQ8_0>(pool, a); break;
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveBlockMatmul, BlockMatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()  // x
                                  .Arg<ffi::AnyBuffer>()  // w
                                  .Arg<ffi::AnyBuffer>()  // layer
                                  .Ret<ffi::AnyBuffer>()  // y
                                  .Attr<int64_t>("format")
                                  .Attr<int64_t>("layout"));

// Whether this build has the vector path above (cpp_kernels.blocks_vectorized()).
extern "C" int JaxserveBlocksVectorized() {
#if defined(JAXSERVE_BLOCKS_VECTOR)
  return 1;
#else
  return 0;
#endif
}

// The most rows a step should give this build's vector path (cpp_kernels.blocks_max_rows()): 64
// with AVX-512BW; 16 with 8 or 4 lanes, whose passes of 4 rows widen each block 16 times at 64 rows
// (on a loaded 2-core Xeon, x86-64-v3: 1.5x XLA's f32 product at 16 rows, 0.46x at 64; indicative).
extern "C" int JaxserveBlocksMaxRows() {
#if defined(JAXSERVE_BLOCKS_VECTOR)
  return Vec::kLanes == 16 ? 64 : 16;
#else
  return 0;
#endif
}
