// Products of f32 rows with weights from a GGUF file's quantization blocks, repacked into tiles
// of 16 output columns, on XLA:CPU, called through block_matmul.cc's FFI handler (see
// runtime/worker/cpp_kernels.py). Two kinds: layout 1, in int8 arithmetic on the activations
// rounded to 8 bits (gguf_activations=q8; this comment); layout 2, f32 activations as they are
// (the default where the CPU has AMX-BF16; see "f32 activations" below).
//   x f32 [M, K] @ w -> y f32 [M, N]
// where w is u8 [N / 16, K / 32 * R]: for each tile of 16 columns, one record of R bytes per block
// of 32 inputs (ir/blocks.py, pack_tiles):
//   scales                  the columns' scales d and offsets c, value = d * q + c (ScaleBytes):
//                           Q4_0, Q8_0: d[16] f16 (c = -8 d, -128 d); Q4_1: d[16] f16, c[16] f16
//                           (the file's own f16s: the tiles read no more bytes than the file);
//                           Q4_K, Q5_K: d[16] f32, c[16] f32 (exact in f32 only), in Q4_1's
//                           layout; Q6_K: d[16] f16 (its super-block's), then int8 scales [16]
//                           for inputs 0-15 and [16] for inputs 16-31: two sub-blocks, each
//                           value d * scale * (q - 32) (d * scale exact in f32; TwoScales)
//   q                       the 16 x 32 quantized values, in the order the multiply reads them:
//                           for 4-bit formats 4 x 64 bytes, byte 4 * col + t of vector j holding
//                           q[col][4j + t] in its low nibble and q[col][4j + 16 + t] in its high
//                           one; for 8-bit ones (Wide: Q8_0, Q5_K, Q6_K), 8 x 64 bytes, byte
//                           4 * col + t of vector j holding q[col][4j + t] (Q8_0: + 128).
// q is unsigned (0-15, 0-31, 0-63 or 0-255): a Q4_0 value d * (q - 8) has c = -8 d, a Q8_0 one
// c = -128 d, a Q6_K one c = -32 d (per sub-block).
// The format is a GGML type id: 2 (Q4_0), 3 (Q4_1), 8 (Q8_0), or read as tiles only 12 (Q4_K),
// 13 (Q5_K) or 14 (Q6_K). The AMX paths take Q4_0, Q4_1, Q8_0 and Q4_K (AmxReads); Q5_K and Q6_K
// take the vector paths on every CPU.
// w may also be a stack [L, N / 16, ...] with the layer to take given by a third operand, an int32
// scalar, as in matmul.cc.
//
// Each row's activations are quantized per block of 32, as llama.cpp does: xq = round(x / s) with
// s = max|x| / 127. A block's product is then s * (d * sum(q * xq) + c * sum(xq)), where the sum of
// q * xq is exact in int32 (VNNI's vpdpbusd: 64 products per instruction, against 16 for an f32
// multiply-add). So the result is x' @ w with x' the activations after that rounding (a relative
// error of at most 1/254 of each block's largest value), not x @ w.
//
// Why: at 64 rows and more a step's products are bound by arithmetic, not by the bytes of the
// weights (docs/benchmarks/, "Decode steps from the GGUF's own blocks"); f32 multiply-adds do a
// quarter of the work per instruction that int8 dot products do. The tiles put 16 columns in the
// lanes of one vector, so that the per-block scaling (a conversion and two multiply-adds) is paid
// once per 8 dot-product instructions, and a tile's records (6-16 KB for SmolLM2) stay in L1
// while every row passes over them.
//
// The vector path needs AVX-512 VNNI; from 32 rows, AMX-INT8 takes the int32 sums where the CPU
// has it and Linux grants the tile state (1.1-1.4x VNNI's rate at 64-512 rows on SmolLM2's
// products: the per-block f32 scaling, which both paths share, is then most of the work).
// Elsewhere a scalar loop gives the same values (the int32 sums are exact; only the order of the
// f32 sums of blocks differs), and cpp_kernels.tiles_vectorized() keeps the engine off this path.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif
#if defined(__AMX_TILE__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include "tile_matmul.h"

#include "parallel_for.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kBlock = 32;  // inputs per block
constexpr int64_t kTile = 16;   // output columns per tile
constexpr int kQ4_0 = 2, kQ4_1 = 3, kQ8_0 = 8, kQ4_K = 12, kQ5_K = 13, kQ6_K = 14;
constexpr int kMaxRows = 12;  // rows in flight over a tile's block
constexpr int64_t kAmxMinRows = 32;  // rows from which AMX takes the product, where the CPU has it
constexpr int64_t kPrefetchRecords = 4;  // f32 activations' vector path: records requested ahead

// Formats whose record keeps f32 d and c (Q4_1's layout at twice the width).
template <int F>
constexpr bool F32Scales() {
  return F == kQ4_K || F == kQ5_K;
}

// Formats whose values are bytes (8 x 64 per record) rather than nibbles.
template <int F>
constexpr bool Wide() {
  return F == kQ8_0 || F == kQ5_K || F == kQ6_K;
}

// Formats with a scale per sub-block of 16 inputs: the record's inputs 0-15 and 16-31 scale apart.
template <int F>
constexpr bool TwoScales() {
  return F == kQ6_K;
}

// Formats the AMX paths read (the others take the vector paths where the CPU has AMX).
template <int F>
constexpr bool AmxReads() {
  return F == kQ4_0 || F == kQ4_1 || F == kQ8_0 || F == kQ4_K;
}

// Bytes of a record's scales: d f16 (Q4_0, Q8_0), d and c f16 (Q4_1), d and c f32 (Q4_K, Q5_K),
// d f16 and two int8 scales (Q6_K).
constexpr int64_t ScaleBytes(int format) {
  return format == kQ4_K || format == kQ5_K ? 2 * kTile * 4
         : format == kQ4_1 || format == kQ6_K ? 2 * kTile * 2
                                                : kTile * 2;
}

// Bytes of one tile's record for one block: the scales, then the quantized values.
constexpr int64_t RecordBytes(int format) {
  switch (format) {
    case kQ4_0:
    case kQ4_1:
    case kQ4_K: return ScaleBytes(format) + kTile * kBlock / 2;
    case kQ8_0:
    case kQ5_K:
    case kQ6_K: return ScaleBytes(format) + kTile * kBlock;
    default: return 0;
  }
}

// Q4_0's value is d * (q - 8), Q8_0's d * (q - 128), Q6_K's d * (q - 32): c = -Bias * d. Q4_1, Q4_K
// and Q5_K keep c.
template <int F>
constexpr int Bias() {
  return F == kQ4_0 ? 8 : F == kQ8_0 ? 128 : F == kQ6_K ? 32 : 0;
}

template <int F>
constexpr bool HasOffset() {
  return F == kQ4_1 || F == kQ4_K || F == kQ5_K;
}

// A record's 16 scales and offsets as f32, for the inputs of sub-block `half` (0: inputs 0-15,
// 1: 16-31; the same for all but TwoScales formats).
template <int F>
void RecordScales(const uint8_t* rec, int half, float* d, float* c) {
  for (int col = 0; col < kTile; ++col) {
    if (F32Scales<F>()) {
      std::memcpy(d + col, rec + 4 * col, 4);
      std::memcpy(c + col, rec + 4 * (kTile + col), 4);
    } else if (TwoScales<F>()) {
      d[col] = jaxserve::Half(rec + 2 * col) * static_cast<float>(static_cast<int8_t>(rec[2 * kTile + kTile * half + col]));
      c[col] = -static_cast<float>(Bias<F>()) * d[col];
    } else {
      d[col] = jaxserve::Half(rec + 2 * col);
      c[col] = F == kQ4_1 ? jaxserve::Half(rec + 2 * (kTile + col)) : -static_cast<float>(Bias<F>()) * d[col];
    }
  }
}

#if defined(__AVX512F__)
// The same, 16 columns in one vector: d (of sub-block `half`), and c given d.
template <int F>
inline __m512 ScaleD(const uint8_t* rec, int half = 0) {
  if constexpr (F32Scales<F>()) return _mm512_loadu_ps(rec);
  const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec)));
  if constexpr (TwoScales<F>()) {
    const __m128i scale = _mm_loadu_si128(reinterpret_cast<const __m128i*>(rec + 2 * kTile + kTile * half));
    return _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(scale)));  // exact
  }
  return d;
}

template <int F>
inline __m512 ScaleC(const uint8_t* rec, __m512 d) {
  if constexpr (F32Scales<F>()) return _mm512_loadu_ps(rec + 4 * kTile);
  if constexpr (F == kQ4_1) return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec + 2 * kTile)));
  return _mm512_mul_ps(d, _mm512_set1_ps(-static_cast<float>(Bias<F>())));
}
#endif
#if defined(__AVX2__)
// The same, columns 8h to 8h + 7 in one vector (F16C: every AVX2 CPU has it, x86-64-v3 names it).
template <int F>
inline __m256 ScaleD(const uint8_t* rec, int h, int half) {
  if constexpr (F32Scales<F>()) return _mm256_loadu_ps(reinterpret_cast<const float*>(rec + 32 * h));
  const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(rec + 16 * h)));
  if constexpr (TwoScales<F>()) {
    const __m128i scale = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(rec + 2 * kTile + kTile * half + 8 * h));
    return _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(scale)));  // exact
  }
  return d;
}

template <int F>
inline __m256 ScaleC(const uint8_t* rec, int h, __m256 d) {
  if constexpr (F32Scales<F>()) return _mm256_loadu_ps(reinterpret_cast<const float*>(rec + 4 * kTile + 32 * h));
  if constexpr (F == kQ4_1) return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(rec + 2 * kTile + 16 * h)));
  return _mm256_mul_ps(d, _mm256_set1_ps(-static_cast<float>(Bias<F>())));
}
#endif

// Rows quantized per block: xq [M, K] int8, and per (row, block) the scale s and s * sum(xq), and
// the int32 sums of xq over inputs 0-15 and 16-31 (sums[2 * (row * nb + block) + half]: the
// TwoScales formats' bias per sub-block).
struct Quantized {
  std::vector<int8_t> q;
  std::vector<float> s, ss;
  std::vector<int32_t> sums;
};

void QuantizeRows(const float* x, int64_t K, int64_t m0, int64_t m1, Quantized& out) {
  const int64_t nb = K / kBlock;
  for (int64_t m = m0; m < m1; ++m) {
    for (int64_t b = 0; b < nb; ++b) {
      const float* xb = x + m * K + b * kBlock;
      float amax = 0.0f;
      for (int j = 0; j < kBlock; ++j) amax = std::max(amax, std::fabs(xb[j]));
      const float s = amax / 127.0f, inv = amax > 0.0f ? 127.0f / amax : 0.0f;
      int8_t* q = out.q.data() + m * K + b * kBlock;
      int sum[2];
      for (int p = 0; p < 2; ++p) {  // each half's sum in a loop of its own, which vectorizes
        int part = 0;
        for (int j = 16 * p; j < 16 * p + 16; ++j) {
          const int v = static_cast<int>(std::nearbyint(xb[j] * inv));
          q[j] = static_cast<int8_t>(v);
          part += v;
        }
        sum[p] = part;
      }
      out.s[m * nb + b] = s;
      out.ss[m * nb + b] = s * static_cast<float>(sum[0] + sum[1]);
      out.sums[2 * (m * nb + b)] = sum[0], out.sums[2 * (m * nb + b) + 1] = sum[1];
    }
  }
}

struct Args {
  const Quantized* xq;
  const uint8_t* w;  // [N / 16, nb * R]
  float* y;          // [M, N]
  int64_t M, K, N, nb;
};

// The last `left` rows (fewer than MR + 1) from row m, in one pass.
template <int MR, typename Pass>
void RowTail(int64_t left, int64_t m, const Pass& pass) {
  if constexpr (MR > 0) {
    if (left == MR) {
      pass(std::integral_constant<int, MR>{}, m);
    } else {
      RowTail<MR - 1>(left, m, pass);
    }
  }
}

// Rows [0, M) in passes of kMax (kMaxRows unless the registers hold fewer), then one pass of the
// rest: pass(std::integral_constant<int, MR>, m0) for each, so that every pass has its row count
// at compile time.
template <int kMax = kMaxRows, typename Pass>
void RowPasses(int64_t M, const Pass& pass) {
  int64_t m = 0;
  for (; m + kMax <= M; m += kMax) pass(std::integral_constant<int, kMax>{}, m);
  RowTail<kMax - 1>(M - m, m, pass);
}

// Rows [0, M) quantized or split in up to one share per thread, each of at least `min_values`
// values (rows x K), prepare(m0, m1) for each.
template <typename Prepare>
void ForRowShares(ffi::ThreadPool& pool, int64_t M, int64_t K, int64_t min_values, const Prepare& prepare) {
  const int64_t items = std::min<int64_t>(jaxserve::Workers(pool), (M * K) / min_values + 1);
  const int64_t per = (M + items - 1) / items;
  jaxserve::ParallelFor(pool, items, [&](int64_t t) { prepare(t * per, std::min(M, (t + 1) * per)); });
}

// Tiles per run, for about `runs` runs per thread of at most `max_per` tiles each.
int64_t TilesPerRun(ffi::ThreadPool& pool, int64_t tiles, int64_t runs, int64_t max_per) {
  const int64_t threads = jaxserve::Workers(pool);
  return std::min(max_per, std::max<int64_t>(1, (tiles + runs * threads - 1) / (runs * threads)));
}

// Tiles [0, tiles) shared out in about `runs` runs per thread of at most `max_per` tiles each,
// run(g0, g1) for each.
template <typename Run>
void ForTileRuns(ffi::ThreadPool& pool, int64_t tiles, int64_t runs, int64_t max_per, const Run& run) {
  const int64_t per = TilesPerRun(pool, tiles, runs, max_per);
  jaxserve::ParallelFor(pool, (tiles + per - 1) / per,
                        [&](int64_t t) { run(t * per, std::min(tiles, (t + 1) * per)); });
}

// The unsigned value of tile column `col`, input j of a block's record.
template <int F>
inline int TileValue(const uint8_t* q, int col, int j) {
  if (Wide<F>()) return q[(j / 4) * 64 + col * 4 + j % 4];
  const int v = j % 16, byte = q[(v / 4) * 64 + col * 4 + v % 4];
  return j < 16 ? (byte & 0x0f) : (byte >> 4);
}

template <int F>
void ScalarTiles(const Args& a, int64_t g0, int64_t g1) {
  const int64_t R = RecordBytes(F);
  for (int64_t g = g0; g < g1; ++g) {
    for (int64_t m = 0; m < a.M; ++m) {
      float acc[kTile] = {};
      for (int64_t b = 0; b < a.nb; ++b) {
        const uint8_t* rec = a.w + (g * a.nb + b) * R;
        const int8_t* xq = a.xq->q.data() + m * a.K + b * kBlock;
        const float s = a.xq->s[m * a.nb + b], ss = a.xq->ss[m * a.nb + b];
        // A sub-block of 16 at a time where the record scales them apart, else the block.
        constexpr int kParts = TwoScales<F>() ? 2 : 1, kLen = kBlock / kParts;
        for (int p = 0; p < kParts; ++p) {
          float d[kTile], c[kTile];
          RecordScales<F>(rec, p, d, c);
          const float sp = kParts == 1 ? ss : s * static_cast<float>(a.xq->sums[2 * (m * a.nb + b) + p]);
          for (int col = 0; col < kTile; ++col) {
            int32_t dot = 0;
            for (int j = p * kLen; j < (p + 1) * kLen; ++j) dot += TileValue<F>(rec + ScaleBytes(F), col, j) * xq[j];
            acc[col] += static_cast<float>(dot) * (d[col] * s) + c[col] * sp;
          }
        }
      }
      for (int col = 0; col < kTile; ++col) a.y[m * a.N + g * kTile + col] = acc[col];
    }
  }
}

// Rows [m0, m0 + MR)'s quantized activations, and per block their scale s and s * sum(xq).
template <int MR>
struct QuantizedRows {
  const int8_t* q[MR];
  const float* s[MR];
  const float* ss[MR];
  const int32_t* sums[MR];
  QuantizedRows(const Args& a, int64_t m0) {
    for (int m = 0; m < MR; ++m) {
      q[m] = a.xq->q.data() + (m0 + m) * a.K;
      s[m] = a.xq->s.data() + (m0 + m) * a.nb;
      ss[m] = a.xq->ss.data() + (m0 + m) * a.nb;
      sums[m] = a.xq->sums.data() + 2 * (m0 + m) * a.nb;
    }
  }
};

#if defined(__AVX512VNNI__)
// Rows [m0, m0 + MR) over tile g: each block's 8 vectors of unsigned q (4 inputs x 16 columns
// each) are loaded once for the MR rows, each of which takes 8 dot products against its inputs
// broadcast 4 at a time, then scales its int32 sums into its f32 accumulator.
template <int F, int MR>
void VectorTile(const Args& a, int64_t g, int64_t m0) {
  const int64_t R = RecordBytes(F);
  const uint8_t* rec = a.w + g * a.nb * R;
  const QuantizedRows<MR> rows(a, m0);
  __m512 acc[MR];
  for (int m = 0; m < MR; ++m) acc[m] = _mm512_setzero_ps();
  const __m512i low = _mm512_set1_epi8(0x0f);
  for (int64_t b = 0; b < a.nb; ++b, rec += R) {
    const __m512 d = ScaleD<F>(rec), c = ScaleC<F>(rec, d);
    const uint8_t* q = rec + ScaleBytes(F);
    __m512i w[8];
    if (Wide<F>()) {
      for (int j = 0; j < 8; ++j) w[j] = _mm512_loadu_si512(q + 64 * j);
    } else {
      for (int j = 0; j < 4; ++j) {
        const __m512i v = _mm512_loadu_si512(q + 64 * j);
        w[j] = _mm512_and_si512(v, low);
        w[j + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
      }
    }
    if constexpr (TwoScales<F>()) {
      // Vectors 0-3 hold inputs 0-15, 4-7 inputs 16-31: a sum per sub-block, less its bias exactly.
      const __m512 d1 = ScaleD<F>(rec, 1);
      for (int m = 0; m < MR; ++m) {
        const int32_t* x4 = reinterpret_cast<const int32_t*>(rows.q[m] + b * kBlock);
        const int32_t* sums = rows.sums[m] + 2 * b;
        __m512i dot0 = _mm512_set1_epi32(-Bias<F>() * sums[0]), dot1 = _mm512_set1_epi32(-Bias<F>() * sums[1]);
        for (int j = 0; j < 4; ++j) {
          dot0 = _mm512_dpbusd_epi32(dot0, w[j], _mm512_set1_epi32(x4[j]));
          dot1 = _mm512_dpbusd_epi32(dot1, w[j + 4], _mm512_set1_epi32(x4[j + 4]));
        }
        const __m512 s = _mm512_set1_ps(rows.s[m][b]);
        acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot0), _mm512_mul_ps(d, s), acc[m]);
        acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot1), _mm512_mul_ps(d1, s), acc[m]);
      }
      continue;
    }
    for (int m = 0; m < MR; ++m) {
      const int32_t* x4 = reinterpret_cast<const int32_t*>(rows.q[m] + b * kBlock);
      __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w[0], _mm512_set1_epi32(x4[0]));
      for (int j = 1; j < 8; ++j) dot = _mm512_dpbusd_epi32(dot, w[j], _mm512_set1_epi32(x4[j]));
      const __m512 scale = _mm512_mul_ps(d, _mm512_set1_ps(rows.s[m][b]));
      acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), scale, acc[m]);
      acc[m] = _mm512_fmadd_ps(c, _mm512_set1_ps(rows.ss[m][b]), acc[m]);
    }
  }
  for (int m = 0; m < MR; ++m) _mm512_storeu_ps(a.y + (m0 + m) * a.N + g * kTile, acc[m]);
}

template <int F>
void VectorTiles(const Args& a, int64_t g0, int64_t g1) {
  for (int64_t g = g0; g < g1; ++g) {
    RowPasses(a.M, [&](auto mr, int64_t m) { VectorTile<F, decltype(mr)::value>(a, g, m); });
  }
}
#elif defined(__AVX2__)
// Without VNNI (AVX2, or AVX-512 without VNNI), as llama.cpp does: vpmaddubsw multiplies unsigned
// weight bytes by signed activation bytes and adds pairs into int16, then vpmaddwd adds pairs of
// those into int32. Exact: a 4-bit value times |xq| <= 127 is at most 1905, a pair 3810, and a
// block's 8 products of 4 inputs sum to at most 30480 in int16 before one vpmaddwd takes them to
// int32. 8-bit values (Q8_0's q + 128, up to 255; Q5_K's, Q6_K's q) go as two 4-bit halves,
// lo + 16 hi, each summed so. A tile's 16 columns are two vectors of 8 (bytes 0-31 and 32-63 of each 64-byte
// vector of the record); up to kQ8Rows rows per pass share the block's weights.
constexpr int kQ8Rows = 4;

template <int F, int MR>
void VectorTile(const Args& a, int64_t g, int64_t m0) {
  const int64_t R = RecordBytes(F);
  const uint8_t* rec = a.w + g * a.nb * R;
  const QuantizedRows<MR> rows(a, m0);
  __m256 acc[MR][2];
  for (int m = 0; m < MR; ++m) acc[m][0] = acc[m][1] = _mm256_setzero_ps();
  const __m256i low = _mm256_set1_epi8(0x0f), ones = _mm256_set1_epi16(1), sixteens = _mm256_set1_epi16(16);
  for (int64_t b = 0; b < a.nb; ++b, rec += R) {
    const uint8_t* q = rec + ScaleBytes(F);
    for (int h = 0; h < 2; ++h) {
      const __m256 d = ScaleD<F>(rec, h, 0), c = ScaleC<F>(rec, h, d);
      auto bytes = [&](int j) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + 64 * j + 32 * h)); };
      // An 8-bit format's int32 sums over vectors j0 to j1 - 1 (inputs 4 j0 to 4 j1 - 1).
      auto wide = [&](const int32_t* x4, int j0, int j1) {
        __m256i lo = _mm256_setzero_si256(), hi = _mm256_setzero_si256();
        for (int j = j0; j < j1; ++j) {
          const __m256i v = bytes(j), x = _mm256_set1_epi32(x4[j]);
          lo = _mm256_add_epi16(lo, _mm256_maddubs_epi16(_mm256_and_si256(v, low), x));
          hi = _mm256_add_epi16(hi, _mm256_maddubs_epi16(_mm256_and_si256(_mm256_srli_epi16(v, 4), low), x));
        }
        return _mm256_add_epi32(_mm256_madd_epi16(lo, ones), _mm256_madd_epi16(hi, sixteens));
      };
      if constexpr (TwoScales<F>()) {  // a sum per sub-block of 16, less its bias exactly
        const __m256 d1 = ScaleD<F>(rec, h, 1);
        for (int m = 0; m < MR; ++m) {
          const int32_t* x4 = reinterpret_cast<const int32_t*>(rows.q[m] + b * kBlock);
          const int32_t* sums = rows.sums[m] + 2 * b;
          const __m256i dot0 = _mm256_sub_epi32(wide(x4, 0, 4), _mm256_set1_epi32(Bias<F>() * sums[0]));
          const __m256i dot1 = _mm256_sub_epi32(wide(x4, 4, 8), _mm256_set1_epi32(Bias<F>() * sums[1]));
          const __m256 s = _mm256_set1_ps(rows.s[m][b]);
          acc[m][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot0), _mm256_mul_ps(d, s), acc[m][h]);
          acc[m][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot1), _mm256_mul_ps(d1, s), acc[m][h]);
        }
        continue;
      }
      for (int m = 0; m < MR; ++m) {
        const int32_t* x4 = reinterpret_cast<const int32_t*>(rows.q[m] + b * kBlock);
        __m256i dot;
        if (Wide<F>()) {
          dot = wide(x4, 0, 8);
        } else {
          __m256i sum = _mm256_setzero_si256();
          for (int j = 0; j < 4; ++j) {
            const __m256i v = bytes(j);
            sum = _mm256_add_epi16(sum, _mm256_maddubs_epi16(_mm256_and_si256(v, low), _mm256_set1_epi32(x4[j])));
            sum = _mm256_add_epi16(
                sum, _mm256_maddubs_epi16(_mm256_and_si256(_mm256_srli_epi16(v, 4), low), _mm256_set1_epi32(x4[j + 4])));
          }
          dot = _mm256_madd_epi16(sum, ones);
        }
        const __m256 scale = _mm256_mul_ps(d, _mm256_set1_ps(rows.s[m][b]));
        acc[m][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), scale, acc[m][h]);
        acc[m][h] = _mm256_fmadd_ps(c, _mm256_set1_ps(rows.ss[m][b]), acc[m][h]);
      }
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int h = 0; h < 2; ++h) _mm256_storeu_ps(a.y + (m0 + m) * a.N + g * kTile + 8 * h, acc[m][h]);
}

template <int F>
void VectorTiles(const Args& a, int64_t g0, int64_t g1) {
  for (int64_t g = g0; g < g1; ++g) {
    RowPasses<kQ8Rows>(a.M, [&](auto mr, int64_t m) { VectorTile<F, decltype(mr)::value>(a, g, m); });
  }
}
#endif


#if defined(__AMX_TILE__)
// Linux hands out the AMX tile state on request (arch_prctl).
bool AmxGranted() {
  static const bool granted = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */,
                                      18 /* XFEATURE_XTILEDATA */) == 0;
  return granted;
}

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

#endif

#if defined(__AMX_INT8__) && defined(__AVX512VNNI__)
// AMX: the int32 sums of 16 rows x 16 columns for one block in one tile multiply (tdpbsud: signed
// activations, unsigned weights), where VNNI takes 8 dot products per row. The tiles' q vectors are
// already the multiply's B layout (row j: 4 inputs for each of 16 columns); 4-bit values are
// widened into a buffer first, once per tile for all rows. The sums go through memory to the same
// f32 scaling as VectorTile's. Linux hands out the tile state on request (arch_prctl).
template <int F>
void AmxTiles(const Args& a, int64_t g0, int64_t g1) {
  TileConfig cfg;
  for (int t : {0, 1}) {
    cfg.rows[t] = 16, cfg.colsb[t] = 64;          // C: 16 rows x 16 int32 sums
    cfg.rows[2 + t] = 16, cfg.colsb[2 + t] = 32;  // A: 16 rows x one block of int8 activations
    cfg.rows[4 + t] = 8, cfg.colsb[4 + t] = 64;   // B: 8 x (16 columns x 4 inputs)
  }
  _tile_loadconfig(&cfg);
  const int64_t R = RecordBytes(F);
  std::vector<uint8_t> wide(F == kQ8_0 ? 0 : a.nb * 512 + 64);
  uint8_t* buf = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(wide.data()) + 63) & ~uintptr_t{63});
  alignas(64) int32_t sums[2][16 * 16];
  const __m512i low = _mm512_set1_epi8(0x0f);
  for (int64_t g = g0; g < g1; ++g) {
    const uint8_t* rec = a.w + g * a.nb * R;
    if (F != kQ8_0) {
      for (int64_t b = 0; b < a.nb; ++b) {
        for (int j = 0; j < 4; ++j) {
          const __m512i v = _mm512_loadu_si512(rec + b * R + ScaleBytes(F) + 64 * j);
          _mm512_store_si512(buf + b * 512 + 64 * j, _mm512_and_si512(v, low));
          _mm512_store_si512(buf + b * 512 + 64 * (j + 4), _mm512_and_si512(_mm512_srli_epi16(v, 4), low));
        }
      }
    }
    for (int64_t m0 = 0; m0 < a.M; m0 += 16) {
      const int8_t* xq = a.xq->q.data() + m0 * a.K;
      // Block b's sums into sums[b % 2], through tile registers of the same parity, so that the
      // tile unit works on the next block while the vector units scale this one.
      auto multiply = [&](int64_t b) {
        const uint8_t* q = F == kQ8_0 ? rec + b * R + ScaleBytes(F) : buf + b * 512;
        if (b % 2 == 0) {
          _tile_zero(0);
          _tile_loadd(2, xq + b * kBlock, a.K);
          _tile_loadd(4, q, 64);
          _tile_dpbsud(0, 2, 4);
          _tile_stored(0, sums[0], 64);
        } else {
          _tile_zero(1);
          _tile_loadd(3, xq + b * kBlock, a.K);
          _tile_loadd(5, q, 64);
          _tile_dpbsud(1, 3, 5);
          _tile_stored(1, sums[1], 64);
        }
      };
      __m512 acc[16];
#pragma GCC unroll 16
      for (int r = 0; r < 16; ++r) acc[r] = _mm512_setzero_ps();
      const float* s = a.xq->s.data() + m0 * a.nb;
      const float* ss = a.xq->ss.data() + m0 * a.nb;
      multiply(0);
      for (int64_t b = 0; b < a.nb; ++b) {
        if (b + 1 < a.nb) multiply(b + 1);
        const int32_t* sb = sums[b % 2];
        const __m512 d = ScaleD<F>(rec + b * R), c = ScaleC<F>(rec + b * R, d);
#pragma GCC unroll 16
        for (int r = 0; r < 16; ++r) {
          const __m512 scale = _mm512_mul_ps(d, _mm512_set1_ps(s[r * a.nb + b]));
          acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(sb + 16 * r)), scale, acc[r]);
          acc[r] = _mm512_fmadd_ps(c, _mm512_set1_ps(ss[r * a.nb + b]), acc[r]);
        }
      }
      const int rows = static_cast<int>(std::min<int64_t>(16, a.M - m0));
#pragma GCC unroll 16
      for (int r = 0; r < 16; ++r)
        if (r < rows) _mm512_storeu_ps(a.y + (m0 + r) * a.N + g * kTile, acc[r]);
    }
  }
  _tile_release();
}
#endif

// ---- f32 activations (layout 2): x @ w with x as it is, up to the order of f32 sums ----
//
// A tile's value is d * v + c' with v = q - bias signed (Q4_0: q - 8, Q8_0: q - 128; Q4_1: q) and
// c' = c + bias * d, which is 0 for Q4_0 and Q8_0 (c = -bias * d) and Q4_1's m. Two ways:
//   - from 16 rows, on CPUs with AMX-BF16: each row is split into three bf16 parts with
//     hi + mid + lo == x exactly (each holds 8 of f32's 24 significant bits), and v (at most 8
//     bits) is exact in bf16, so each part's products are exact in the f32 sums that tdpbf16ps
//     takes per block; the block's sum is then scaled in f32 like the int8 path's. Three tile
//     multiplies per block give what f32 multiply-adds give: against the f32 blocks' rows on
//     SmolLM2's layers, 1.9x at 32 rows, 2.3x at 64 and 3.1x at 512 (2.2x XLA's f32 GEMM there;
//     docs/benchmarks/, "f32 products on AMX"). The tile unit's loads and stores (1 KB each), not
//     its multiplies, bound it: the parts stay in tile registers while a work item's tiles pass.
//   - otherwise, f32 multiply-adds: on AVX-512, each block's 16 columns widened to f32 per input,
//     once for up to 12 rows; on AVX2, once per slice of blocks for all the rows (WideTilesF32).

struct F32Args {
  const float* x;  // [M, K]
  const uint8_t* w;
  float* y;
  int64_t M, K, N, nb;
  const uint16_t* parts;  // AMX: bf16 bits [3, padded, K] (hi, mid, lo), rows from M zero
  const float* sx;        // AMX (Q4_1, Q4_K): per (row, block) the sum of x
  int64_t padded;
};

template <int F>
void ScalarTilesF32(const F32Args& a, int64_t g0, int64_t g1) {
  const int64_t R = RecordBytes(F);
  for (int64_t g = g0; g < g1; ++g) {
    for (int64_t m = 0; m < a.M; ++m) {
      float acc[kTile] = {};
      for (int64_t b = 0; b < a.nb; ++b) {
        const uint8_t* rec = a.w + (g * a.nb + b) * R;
        float d[2][kTile], c[2][kTile];
        RecordScales<F>(rec, 0, d[0], c[0]);
        RecordScales<F>(rec, 1, d[1], c[1]);
        const float* xb = a.x + m * a.K + b * kBlock;
        for (int col = 0; col < kTile; ++col) {
          for (int j = 0; j < kBlock; ++j) {
            const float v = static_cast<float>(TileValue<F>(rec + ScaleBytes(F), col, j) - Bias<F>());
            acc[col] += xb[j] * (v * d[j / 16][col] + (HasOffset<F>() ? c[j / 16][col] : 0.0f));
          }
        }
      }
      for (int col = 0; col < kTile; ++col) a.y[m * a.N + g * kTile + col] = acc[col];
    }
  }
}

#if defined(__AVX512BW__)
// Rows [m0, m0 + MR) over tile g: per input, the 16 columns' values widened to f32 and scaled
// (one multiply-add), then one multiply-add per row with its input broadcast.
template <int F, int MR>
void VectorTileF32(const F32Args& a, int64_t g, int64_t m0) {
  const int64_t R = RecordBytes(F);
  const uint8_t* rec = a.w + g * a.nb * R;
  const float* x[MR];
  for (int m = 0; m < MR; ++m) x[m] = a.x + (m0 + m) * a.K;
  // C chains of sums per row (inputs k % C), so that one or two rows are not held to the latency
  // of one multiply-add chain.
  constexpr int C = MR == 1 ? 4 : MR == 2 ? 2 : 1;
  __m512 acc[C][MR];
  for (int c = 0; c < C; ++c)
    for (int m = 0; m < MR; ++m) acc[c][m] = _mm512_setzero_ps();
  const __m512i mask = _mm512_set1_epi32(Wide<F>() ? 0xff : 0x0f), bias = _mm512_set1_epi32(Bias<F>());
  for (int64_t b = 0; b < a.nb; ++b, rec += R) {
    // A few rows are bound by the bytes streamed: the record kPrefetchRecords ahead is requested now.
    for (int64_t line = 0; line < R; line += 64) {
      _mm_prefetch(reinterpret_cast<const char*>(rec + kPrefetchRecords * R + line), _MM_HINT_T0);
    }
    const __m512 d = ScaleD<F>(rec), c = HasOffset<F>() ? ScaleC<F>(rec, d) : d;
    constexpr int kVectors = Wide<F>() ? 8 : 4;
    __m512i v[kVectors];
    for (int j = 0; j < kVectors; ++j) v[j] = _mm512_loadu_si512(rec + ScaleBytes(F) + 64 * j);
    if (HasOffset<F>()) {
      // value = d * q + c, widened and scaled per input (one multiply-add), then one per row.
#pragma GCC unroll 32
      for (int k = 0; k < kBlock; ++k) {
        // Byte k % 4 of vector (k % 16) / 4, its high nibble from input 16 (8-bit: of vector k / 4).
        const int j = Wide<F>() ? k / 4 : (k % 16) / 4, shift = 8 * (k % 4) + (!Wide<F>() && k >= 16 ? 4 : 0);
        const __m512 wk = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srli_epi32(v[j], shift), mask)), d, c);
        for (int m = 0; m < MR; ++m) {
          acc[k % C][m] = _mm512_fmadd_ps(_mm512_set1_ps(x[m][b * kBlock + k]), wk, acc[k % C][m]);
        }
      }
      continue;
    }
    // Q4_0, Q8_0, Q6_K: value = d * v (v signed), so each row sums x * v over the block (Q6_K: over
    // each sub-block of 16), then scales the sum by d once.
    __m512 blk[C][MR];
    for (int i = 0; i < C; ++i)
      for (int m = 0; m < MR; ++m) blk[i][m] = _mm512_setzero_ps();
    if (F == kQ8_0) {
      for (int j = 0; j < kVectors; ++j) v[j] = _mm512_xor_si512(v[j], _mm512_set1_epi8(char(0x80)));  // q as int8
    }
#pragma GCC unroll 32
    for (int k = 0; k < kBlock; ++k) {
      __m512i q;
      if (F == kQ8_0) {  // byte k % 4 of vector k / 4, sign-extended
        const int j = k / 4, t = k % 4;
        q = _mm512_srai_epi32(t == 3 ? v[j] : _mm512_slli_epi32(v[j], 24 - 8 * t), 24);
      } else if (Wide<F>()) {  // byte k % 4 of vector k / 4, less the bias
        q = _mm512_sub_epi32(_mm512_and_si512(_mm512_srli_epi32(v[k / 4], 8 * (k % 4)), mask), bias);
      } else {
        const int j = (k % 16) / 4, shift = 8 * (k % 4) + (k >= 16 ? 4 : 0);
        q = _mm512_sub_epi32(_mm512_and_si512(_mm512_srli_epi32(v[j], shift), mask), bias);
      }
      const __m512 wk = _mm512_cvtepi32_ps(q);
      for (int m = 0; m < MR; ++m) {
        blk[k % C][m] = _mm512_fmadd_ps(_mm512_set1_ps(x[m][b * kBlock + k]), wk, blk[k % C][m]);
      }
      if (TwoScales<F>() && k == 15) {  // the first sub-block's sums, scaled by its d
        for (int m = 0; m < MR; ++m) {
          __m512 sum = blk[0][m];
          for (int i = 1; i < C; ++i) sum = _mm512_add_ps(sum, blk[i][m]);
          acc[0][m] = _mm512_fmadd_ps(sum, d, acc[0][m]);
          for (int i = 0; i < C; ++i) blk[i][m] = _mm512_setzero_ps();
        }
      }
    }
    const __m512 d_last = TwoScales<F>() ? ScaleD<F>(rec, 1) : d;
    for (int m = 0; m < MR; ++m) {
      __m512 sum = blk[0][m];
      for (int i = 1; i < C; ++i) sum = _mm512_add_ps(sum, blk[i][m]);
      acc[0][m] = _mm512_fmadd_ps(sum, d_last, acc[0][m]);
    }
  }
  for (int m = 0; m < MR; ++m) {
    __m512 sum = acc[0][m];
    for (int c = 1; c < C; ++c) sum = _mm512_add_ps(sum, acc[c][m]);
    _mm512_storeu_ps(a.y + (m0 + m) * a.N + g * kTile, sum);
  }
}

template <int F>
void VectorTilesF32(const F32Args& a, int64_t g0, int64_t g1) {
  for (int64_t g = g0; g < g1; ++g) {
    RowPasses(a.M, [&](auto mr, int64_t m) { VectorTileF32<F, decltype(mr)::value>(a, g, m); });
  }
}
#elif defined(__AVX2__) && defined(__FMA__)
// AVX2, from kShortRows rows (fewer take the integer products below): a tile's values are widened
// to f32 (d * q + c, as the reference's dequantized weight has them) once per slice of
// kAvx2SliceBlocks blocks (16 KB: in L1 beside the rows' inputs), and the rows pass over that
// copy, 4-6 at a time (up to 12 sums in registers; no per-block finish), kAvx2ChunkRows rows at a
// time so that their inputs stay in L2 while a run's tiles pass. A pass does two loads and a
// broadcast per two multiply-adds of each row, where widening the values in every pass spent as
// many instructions again on them.
constexpr int kAvx2WideRowsPerPass = 6;
constexpr int64_t kAvx2SliceBlocks = 8;
constexpr int64_t kAvx2ChunkRows = 48;

// nb blocks of a tile's records from rec, widened: out [nb * 32, 16] f32.
template <int F>
void WidenTile(const uint8_t* rec, int64_t nb, float* out) {
  const int64_t R = RecordBytes(F);
  const __m256i mask = _mm256_set1_epi32(Wide<F>() ? 0xff : 0x0f), bias = _mm256_set1_epi32(Bias<F>());
  for (int64_t b = 0; b < nb; ++b, rec += R, out += kBlock * kTile) {
    const uint8_t* q8 = rec + ScaleBytes(F);
    for (int h = 0; h < 2; ++h) {
      const __m256 d = ScaleD<F>(rec, h, 0);
      const __m256 c = HasOffset<F>() ? ScaleC<F>(rec, h, d) : d;
      auto value = [&](__m256i q, __m256 dq) {  // q unsigned, per column
        return HasOffset<F>() ? _mm256_fmadd_ps(_mm256_cvtepi32_ps(q), dq, c)
                              : _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(q, bias)), dq);
      };
      if (Wide<F>()) {
        const __m256 d1 = TwoScales<F>() ? ScaleD<F>(rec, h, 1) : d;  // inputs 16-31's
        for (int j = 0; j < 8; ++j) {  // inputs 4j to 4j + 3: byte t of each column's 32 bits
          const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q8 + 64 * j + 32 * h));
          for (int t = 0; t < 4; ++t) {
            _mm256_storeu_ps(out + (4 * j + t) * kTile + 8 * h,
                             value(_mm256_and_si256(_mm256_srli_epi32(v, 8 * t), mask), j < 4 ? d : d1));
          }
        }
        continue;
      }
      for (int j = 0; j < 4; ++j) {  // inputs 4j + t (low nibbles) and 4j + 16 + t (high ones)
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q8 + 64 * j + 32 * h));
        for (int t = 0; t < 4; ++t) {
          _mm256_storeu_ps(out + (4 * j + t) * kTile + 8 * h, value(_mm256_and_si256(_mm256_srli_epi32(v, 8 * t), mask), d));
          _mm256_storeu_ps(out + (4 * j + 16 + t) * kTile + 8 * h,
                           value(_mm256_and_si256(_mm256_srli_epi32(v, 8 * t + 4), mask), d));
        }
      }
    }
  }
}

// Rows [m0, m0 + MR) times a widened slice wt [n, 16] of tile g (inputs k0 to k0 + n): y's 16
// columns of the tile, set (`first`) or added to.
template <int MR>
void WidePass(const F32Args& a, const float* wt, int64_t n, int64_t k0, bool first, int64_t g, int64_t m0) {
  // Every loop over the rows unrolled and the operands in locals, so that the sums stay in
  // registers (otherwise GCC kept a copy of them on the stack, stored in every iteration).
  const int64_t K = a.K, N = a.N;
  const float* x = a.x + m0 * K + k0;
  float* y = a.y + m0 * N + g * kTile;
  __m256 acc[MR][2];
#pragma GCC unroll 16
  for (int m = 0; m < MR; ++m) {
    acc[m][0] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(y + m * N);
    acc[m][1] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(y + m * N + 8);
  }
  for (int64_t k = 0; k < n; ++k) {
    const __m256 w0 = _mm256_loadu_ps(wt + k * kTile), w1 = _mm256_loadu_ps(wt + k * kTile + 8);
#pragma GCC unroll 16
    for (int m = 0; m < MR; ++m) {
      const __m256 xk = _mm256_broadcast_ss(x + m * K + k);
      acc[m][0] = _mm256_fmadd_ps(xk, w0, acc[m][0]);
      acc[m][1] = _mm256_fmadd_ps(xk, w1, acc[m][1]);
    }
  }
#pragma GCC unroll 16
  for (int m = 0; m < MR; ++m) {
    _mm256_storeu_ps(y + m * N, acc[m][0]);
    _mm256_storeu_ps(y + m * N + 8, acc[m][1]);
  }
}

// `rows` rows from m0 in passes of as even a size as kAvx2WideRowsPerPass allows (8 rows: 4 + 4,
// not 6 + 2, whose 4 sums would wait on the multiply-adds' latency).
template <typename Pass>
void EvenPasses(int64_t rows, int64_t m0, const Pass& pass) {
  const int64_t passes = (rows + kAvx2WideRowsPerPass - 1) / kAvx2WideRowsPerPass;
  for (int64_t p = 0, m = m0; p < passes; ++p) {
    const int64_t r = (rows * (p + 1)) / passes - (rows * p) / passes;
    RowTail<kAvx2WideRowsPerPass>(r, m, pass);
    m += r;
  }
}

template <int F>
void WideTilesF32(const F32Args& a, int64_t g0, int64_t g1) {
  alignas(32) float wt[kAvx2SliceBlocks * kBlock * kTile];
  const int64_t R = RecordBytes(F);
  const int64_t chunks = (a.M + kAvx2ChunkRows - 1) / kAvx2ChunkRows;
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t c0 = a.M * c / chunks, rows = a.M * (c + 1) / chunks - c0;
    for (int64_t g = g0; g < g1; ++g) {
      for (int64_t s0 = 0; s0 < a.nb; s0 += kAvx2SliceBlocks) {
        const int64_t blocks = std::min(kAvx2SliceBlocks, a.nb - s0);
        WidenTile<F>(a.w + (g * a.nb + s0) * R, blocks, wt);
        EvenPasses(rows, c0, [&](auto mr, int64_t m) {
          WidePass<decltype(mr)::value>(a, wt, blocks * kBlock, s0 * kBlock, s0 == 0, g, m);
        });
      }
    }
  }
}
#endif

#if defined(__AVX512BW__) || (defined(__AVX2__) && defined(__FMA__))
// Steps of fewer than kShortRows rows (batch-1 decode, and the few rows of small batches) take
// integer products: each row's activations are split per block of 32 into two 16-bit parts,
// x = s * (hi + lo / 2^15) with s = max|x| / 32767, hi = round(x / s) and lo the rest rounded (so
// within max|x| * 2^-31 of x: below f32's rounding of the sums), and a block's product is
// d * s * (sum(q * hi) + 2^-15 sum(q * lo)) + c * sum(x), each integer sum exact in int32
// (vpmaddwd: two products per 32-bit lane; vpdpwssd with VNNI). Widening each weight to f32 cost
// a conversion and a multiply-add per value and row: on AVX2 that bound a row to about 7 GB/s of
// weights per core, under what a core reads. One row of SmolLM2's layers took 4.95 ms instead of
// 8.18 on x86-64-v3, 4.55 instead of 8.82 on x86-64-v4 (docs/benchmarks/, "Few rows in integer
// products"). One 16-bit part alone was faster still (4.11 ms), but 2^-16 of an outlier feature
// moved SmolLM2's logits by more than 1e-3.
constexpr int64_t kShortRows = 8;

// Rows split per block for the integer products: per (row, block) 32 words, hi's 16 then lo's, word
// 2t + p of each holding the part of inputs 4t + p (low half) and 4t + p + 2 (high half), the pair
// that vpmaddwd multiplies with a column's inputs 4t + p and 4t + p + 2 (bytes p and p + 2 of its
// 32 bits); s, the f32 sum of x, and the sums of hi and lo (for Q4_0's, Q8_0's and Q6_K's bias),
// and of their first 16 inputs (Q6_K's first sub-block).
struct Short16 {
  std::vector<int32_t> pairs;
  std::vector<float> s, sx;
  std::vector<int32_t> sum_hi, sum_lo, first_hi, first_lo;
};

void SplitShort16(const float* x, int64_t M, int64_t K, Short16& out) {
  const int64_t nb = K / kBlock;
  if (out.pairs.size() < static_cast<size_t>(M * nb * 32)) out.pairs.resize(M * nb * 32);
  if (out.s.size() < static_cast<size_t>(M * nb)) {
    out.s.resize(M * nb), out.sx.resize(M * nb), out.sum_hi.resize(M * nb), out.sum_lo.resize(M * nb);
    out.first_hi.resize(M * nb), out.first_lo.resize(M * nb);
  }
  for (int64_t i = 0; i < M * nb; ++i) {
    const float* xb = x + i * kBlock;
    float amax = 0.0f, sx = 0.0f;
    for (int k = 0; k < kBlock; ++k) amax = std::max(amax, std::fabs(xb[k])), sx += xb[k];
    const float s = amax / 32767.0f, inv = amax > 0.0f ? 32767.0f / amax : 0.0f;
    const float inv_lo = amax > 0.0f ? 32768.0f / s : 0.0f;
    int32_t hi[kBlock], lo[kBlock], sum_hi = 0, sum_lo = 0;
    for (int k = 0; k < kBlock; ++k) {
      hi[k] = static_cast<int32_t>(std::nearbyint(xb[k] * inv));
      // x - s * hi in one rounding (a fused multiply-add), scaled to lo's units: |lo| <= 2^14 or so
      lo[k] = static_cast<int32_t>(std::nearbyint(std::fma(-s, static_cast<float>(hi[k]), xb[k]) * inv_lo));
      sum_hi += hi[k], sum_lo += lo[k];
      if (k == 15) out.first_hi[i] = sum_hi, out.first_lo[i] = sum_lo;
    }
    int32_t* words = out.pairs.data() + i * 32;
    for (int t = 0; t < 8; ++t) {
      for (int p = 0; p < 2; ++p) {
        auto pair = [&](const int32_t* v) {
          return static_cast<int32_t>((static_cast<uint32_t>(v[4 * t + p]) & 0xffffu) |
                                      (static_cast<uint32_t>(v[4 * t + p + 2]) << 16));
        };
        words[2 * t + p] = pair(hi);
        words[16 + 2 * t + p] = pair(lo);
      }
    }
    out.s[i] = s, out.sx[i] = sx, out.sum_hi[i] = sum_hi, out.sum_lo[i] = sum_lo;
  }
}

struct ShortArgs {
  const Short16* x;
  const uint8_t* w;
  float* y;
  int64_t M, K, N, nb;
};

#if defined(__AVX512BW__)
constexpr int kShortRowsPerPass = 4;
using VecI = __m512i;
using VecF = __m512;
constexpr int kHalves = 1;  // a tile's 16 columns in one vector
inline VecI LoadQ(const uint8_t* q, int j, int) { return _mm512_loadu_si512(q + 64 * j); }
inline VecI Bytes(int32_t v) { return _mm512_set1_epi32(v); }
inline VecI And(VecI a, VecI b) { return _mm512_and_si512(a, b); }
inline VecI Srli16(VecI a, int n) { return _mm512_srli_epi16(a, n); }
inline VecI Dot(VecI acc, VecI q, VecI x) {
#if defined(__AVX512VNNI__)
  return _mm512_dpwssd_epi32(acc, q, x);
#else
  return _mm512_add_epi32(acc, _mm512_madd_epi16(q, x));
#endif
}
inline VecI SubI(VecI a, VecI b) { return _mm512_sub_epi32(a, b); }
inline VecI ZeroI() { return _mm512_setzero_si512(); }
inline VecF ZeroF() { return _mm512_setzero_ps(); }
inline VecF CvtF(VecI a) { return _mm512_cvtepi32_ps(a); }
inline VecF MulF(VecF a, VecF b) { return _mm512_mul_ps(a, b); }
inline VecF Fma(VecF a, VecF b, VecF c) { return _mm512_fmadd_ps(a, b, c); }
inline VecF SetF(float v) { return _mm512_set1_ps(v); }
template <int F>
inline VecF ShortD(const uint8_t* rec, int, int half) { return ScaleD<F>(rec, half); }
template <int F>
inline VecF ShortC(const uint8_t* rec, int, VecF d) { return ScaleC<F>(rec, d); }
inline void StoreF(float* p, VecF v) { _mm512_storeu_ps(p, v); }
#else
constexpr int kShortRowsPerPass = 1;  // 16 registers: passes of two rows were no faster
using VecI = __m256i;
using VecF = __m256;
constexpr int kHalves = 2;  // columns 8h to 8h + 7: bytes 32h to 32h + 31 of each 64-byte vector
inline VecI LoadQ(const uint8_t* q, int j, int h) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + 64 * j + 32 * h)); }
inline VecI Bytes(int32_t v) { return _mm256_set1_epi32(v); }
inline VecI And(VecI a, VecI b) { return _mm256_and_si256(a, b); }
inline VecI Srli16(VecI a, int n) { return _mm256_srli_epi16(a, n); }
inline VecI Dot(VecI acc, VecI q, VecI x) { return _mm256_add_epi32(acc, _mm256_madd_epi16(q, x)); }
inline VecI SubI(VecI a, VecI b) { return _mm256_sub_epi32(a, b); }
inline VecI ZeroI() { return _mm256_setzero_si256(); }
inline VecF ZeroF() { return _mm256_setzero_ps(); }
inline VecF CvtF(VecI a) { return _mm256_cvtepi32_ps(a); }
inline VecF MulF(VecF a, VecF b) { return _mm256_mul_ps(a, b); }
inline VecF Fma(VecF a, VecF b, VecF c) { return _mm256_fmadd_ps(a, b, c); }
inline VecF SetF(float v) { return _mm256_set1_ps(v); }
template <int F>
inline VecF ShortD(const uint8_t* rec, int h, int half) { return ScaleD<F>(rec, h, half); }
template <int F>
inline VecF ShortC(const uint8_t* rec, int h, VecF d) { return ScaleC<F>(rec, h, d); }
inline void StoreF(float* p, VecF v) { _mm256_storeu_ps(p, v); }
#endif

// Rows [m0, m0 + MR) over tile g. A column's 32 bits of vector j hold its inputs 4j to 4j + 3 in
// bytes 0-3 (8-bit formats: q, Q8_0's + 128; 4-bit formats: the low nibbles, the high ones inputs
// 4j + 16 on);
// masked to words they are the even inputs (bytes 0 and 2), shifted down the odd ones (1 and 3).
template <int F, int MR>
void ShortTile(const ShortArgs& a, int64_t g, int64_t m0) {
  const int64_t R = RecordBytes(F);
  const uint8_t* rec = a.w + g * a.nb * R;
  const int32_t* xp[MR];
  const float *s[MR], *sx[MR];
  const int32_t *sum_hi[MR], *sum_lo[MR];
#pragma GCC unroll 8
  for (int m = 0; m < MR; ++m) {
    const int64_t row = (m0 + m) * a.nb;
    xp[m] = a.x->pairs.data() + row * 32;
    s[m] = a.x->s.data() + row, sx[m] = a.x->sx.data() + row;
    sum_hi[m] = a.x->sum_hi.data() + row, sum_lo[m] = a.x->sum_lo.data() + row;
  }
  const VecI nibbles = Bytes(0x0f0f0f0f), words = Bytes(0x00ff00ff);
  const VecF lo_unit = SetF(1.0f / 32768.0f);
  VecF acc[MR][kHalves];
#pragma GCC unroll 8
  for (int m = 0; m < MR; ++m)
    for (int h = 0; h < kHalves; ++h) acc[m][h] = ZeroF();
  for (int64_t b = 0; b < a.nb; ++b, rec += R) {
    for (int64_t line = 0; line < R; line += 64) {
      _mm_prefetch(reinterpret_cast<const char*>(rec + kPrefetchRecords * R + line), _MM_HINT_T0);
    }
    const uint8_t* q = rec + ScaleBytes(F);
#pragma GCC unroll 1
    for (int h = 0; h < kHalves; ++h) {
      VecI hi[MR], lo[MR];
      const int32_t* xb[MR];
#pragma GCC unroll 8
      for (int m = 0; m < MR; ++m) hi[m] = lo[m] = ZeroI(), xb[m] = xp[m] + b * 32;
      // 8-bit values: vectors j0 to j1 - 1 (inputs 4 j0 to 4 j1 - 1) into each row's hi and lo sums.
      auto wide = [&](int j0, int j1) {
#pragma GCC unroll 2
        for (int j = j0; j < j1; ++j) {
          const VecI v = LoadQ(q, j, h);
          const VecI even = And(v, words), odd = Srli16(v, 8);
#pragma GCC unroll 8
          for (int m = 0; m < MR; ++m) {
            hi[m] = Dot(Dot(hi[m], even, Bytes(xb[m][2 * j])), odd, Bytes(xb[m][2 * j + 1]));
            lo[m] = Dot(Dot(lo[m], even, Bytes(xb[m][16 + 2 * j])), odd, Bytes(xb[m][17 + 2 * j]));
          }
        }
      };
      if constexpr (TwoScales<F>()) {  // a sub-block of 16 inputs (4 vectors) at a time, each its d
#pragma GCC unroll 1
        for (int p = 0; p < 2; ++p) {
          wide(4 * p, 4 * p + 4);
          const VecF d = ShortD<F>(rec, h, p);
#pragma GCC unroll 8
          for (int m = 0; m < MR; ++m) {
            const int64_t i = (m0 + m) * a.nb + b;
            const int32_t shi = p == 0 ? a.x->first_hi[i] : a.x->sum_hi[i] - a.x->first_hi[i];
            const int32_t slo = p == 0 ? a.x->first_lo[i] : a.x->sum_lo[i] - a.x->first_lo[i];
            const VecI h_exact = SubI(hi[m], Bytes(Bias<F>() * shi)), l_exact = SubI(lo[m], Bytes(Bias<F>() * slo));
            acc[m][h] = Fma(Fma(CvtF(l_exact), lo_unit, CvtF(h_exact)), MulF(d, SetF(s[m][b])), acc[m][h]);
            hi[m] = lo[m] = ZeroI();
          }
        }
        continue;
      }
      if constexpr (Wide<F>()) {
        wide(0, 8);
      } else {
#pragma GCC unroll 1
        for (int j = 0; j < 4; ++j) {
          const VecI v = LoadQ(q, j, h);
          const VecI low = And(v, nibbles), high = And(Srli16(v, 4), nibbles);
          const VecI even = And(low, words), odd = Srli16(low, 8);
          const VecI even4 = And(high, words), odd4 = Srli16(high, 8);
#pragma GCC unroll 8
          for (int m = 0; m < MR; ++m) {
            hi[m] = Dot(Dot(hi[m], even, Bytes(xb[m][2 * j])), odd, Bytes(xb[m][2 * j + 1]));
            lo[m] = Dot(Dot(lo[m], even, Bytes(xb[m][16 + 2 * j])), odd, Bytes(xb[m][17 + 2 * j]));
            hi[m] = Dot(Dot(hi[m], even4, Bytes(xb[m][8 + 2 * j])), odd4, Bytes(xb[m][9 + 2 * j]));
            lo[m] = Dot(Dot(lo[m], even4, Bytes(xb[m][24 + 2 * j])), odd4, Bytes(xb[m][25 + 2 * j]));
          }
        }
      }
      const VecF d = ShortD<F>(rec, h, 0);
      const VecF c = HasOffset<F>() ? ShortC<F>(rec, h, d) : d;
#pragma GCC unroll 8
      for (int m = 0; m < MR; ++m) {
        // Q4_0, Q8_0: the products of q - bias, exact in int32.
        const VecI h_exact = Bias<F>() ? SubI(hi[m], Bytes(Bias<F>() * sum_hi[m][b])) : hi[m];
        const VecI l_exact = Bias<F>() ? SubI(lo[m], Bytes(Bias<F>() * sum_lo[m][b])) : lo[m];
        const VecF dot = Fma(CvtF(l_exact), lo_unit, CvtF(h_exact));
        acc[m][h] = Fma(dot, MulF(d, SetF(s[m][b])), acc[m][h]);
        if (HasOffset<F>()) acc[m][h] = Fma(c, SetF(sx[m][b]), acc[m][h]);
      }
    }
  }
#pragma GCC unroll 8
  for (int m = 0; m < MR; ++m)
    for (int h = 0; h < kHalves; ++h) StoreF(a.y + (m0 + m) * a.N + g * kTile + 8 * h, acc[m][h]);
}

template <int F>
void ShortTiles(const ShortArgs& a, int64_t g0, int64_t g1) {
  for (int64_t g = g0; g < g1; ++g) {
    RowPasses<kShortRowsPerPass>(a.M, [&](auto mr, int64_t m) { ShortTile<F, decltype(mr)::value>(a, g, m); });
  }
}
#endif

#if defined(__AMX_BF16__) && defined(__AVX512BF16__)
// Rows [m0, m1) split into bf16 parts: hi is x cut to bf16, mid the rest cut to bf16, lo what
// remains (8 significant bits at most), each subtraction exact; Q4_1's block sums too.
// parts [padded, nb, 3, 32]: a row's three parts of a block lie together (192 bytes), so that the
// three tile loads of a block read the same lines. A block at a time: each part's 32 values are one
// two-input conversion to bf16 (exact: hi and mid have no bits below bf16's, lo has 8 at most; as
// for any bf16 conversion, a subnormal part becomes 0), and the block sum comes from the same loads.
void SplitRows(const float* x, int64_t K, int64_t m0, int64_t m1, uint16_t* parts, float* sx) {
  const __m512i cut = _mm512_set1_epi32(static_cast<int>(0xffff0000u));
  const int64_t nb = K / kBlock;
  auto high = [&](__m512 v) { return _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(v), cut)); };
  for (int64_t m = m0; m < m1; ++m) {
    for (int64_t b = 0; b < nb; ++b) {
      const float* xb = x + m * K + b * kBlock;
      uint16_t* out = parts + (m * nb + b) * 3 * kBlock;
      const __m512 v0 = _mm512_loadu_ps(xb), v1 = _mm512_loadu_ps(xb + 16);
      const __m512 h0 = high(v0), h1 = high(v1);
      const __m512 r0 = _mm512_sub_ps(v0, h0), r1 = _mm512_sub_ps(v1, h1);
      const __m512 mid0 = high(r0), mid1 = high(r1);
      _mm512_storeu_si512(out, (__m512i)_mm512_cvtne2ps_pbh(h1, h0));
      _mm512_storeu_si512(out + kBlock, (__m512i)_mm512_cvtne2ps_pbh(mid1, mid0));
      _mm512_storeu_si512(out + 2 * kBlock,
                          (__m512i)_mm512_cvtne2ps_pbh(_mm512_sub_ps(r1, mid1), _mm512_sub_ps(r0, mid0)));
      if (sx != nullptr) sx[m * nb + b] = _mm512_reduce_add_ps(_mm512_add_ps(v0, v1));
    }
  }
}

// A tile's blocks as tdpbf16ps's B operand, 1 KB per block: row p holds inputs 2p and 2p + 1 of
// each of the 16 columns as bf16 pairs of v (exact: at most 8 bits).
template <int F>
void WidenBf16(const uint8_t* rec, int64_t R, int64_t nb, uint8_t* out) {
  const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
  // 32 words of v (words 4 * col + t: column col's inputs base + t, for 8 columns each) -> rows
  // base / 2 (t = 0, 1) and base / 2 + 1 (t = 2, 3).
  auto rows = [&](uint8_t* blk, int base, __m512i cols0_7, __m512i cols8_15) {
    _mm512_store_si512(blk + 64 * (base / 2), _mm512_permutex2var_epi32(cols0_7, even, cols8_15));
    _mm512_store_si512(blk + 64 * (base / 2 + 1), _mm512_permutex2var_epi32(cols0_7, odd, cols8_15));
  };
  alignas(64) uint16_t table[32] = {};
  if (F != kQ8_0) {
    for (int u = 0; u < 16; ++u) {
      const float f = static_cast<float>(u - Bias<F>());
      uint32_t bits;
      std::memcpy(&bits, &f, 4);
      table[u] = static_cast<uint16_t>(bits >> 16);  // small integers: exact
    }
  }
  const __m512i lut = _mm512_load_si512(table), low = _mm512_set1_epi8(0x0f), flip = _mm512_set1_epi8(char(0x80));
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* q = rec + b * R + ScaleBytes(F);
    uint8_t* blk = out + b * 1024;
    if (F == kQ8_0) {
      for (int j = 0; j < 8; ++j) {
        const __m512i s = _mm512_xor_si512(_mm512_loadu_si512(q + 64 * j), flip);  // q - 128 as int8
        // (The lane index must be an immediate at any optimization level, so no loop.)
        const __m512 f[4] = {_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm512_extracti32x4_epi32(s, 0))),
                             _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm512_extracti32x4_epi32(s, 1))),
                             _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm512_extracti32x4_epi32(s, 2))),
                             _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm512_extracti32x4_epi32(s, 3)))};
        rows(blk, 4 * j, (__m512i)_mm512_cvtne2ps_pbh(f[1], f[0]), (__m512i)_mm512_cvtne2ps_pbh(f[3], f[2]));
      }
    } else {
      for (int j = 0; j < 4; ++j) {
        const __m512i v = _mm512_loadu_si512(q + 64 * j);
        const __m512i nib[2] = {_mm512_and_si512(v, low), _mm512_and_si512(_mm512_srli_epi16(v, 4), low)};
        for (int h = 0; h < 2; ++h) {
          const __m512i w0 = _mm512_permutexvar_epi16(_mm512_cvtepu8_epi16(_mm512_castsi512_si256(nib[h])), lut);
          const __m512i w1 = _mm512_permutexvar_epi16(_mm512_cvtepu8_epi16(_mm512_extracti64x4_epi64(nib[h], 1)), lut);
          rows(blk, 16 * h + 4 * j, w0, w1);
        }
      }
    }
  }
}

// Tiles [g0, g1) (at most kAmxItemTiles) for every row. Their blocks are widened once (in L2);
// then for each group of 16 rows and each block, the three parts of the rows' activations are
// loaded into tile registers once, and every tile of the item takes its turn: its block's weights
// loaded, three multiplies into one f32 tile, stored, and scaled into the group's accumulators
// (d, and c * sum(x) for Q4_1; kept in memory, in L1). Consecutive tiles alternate between two
// sets of registers (sums, weights), so that the tile unit takes the next one while the vector
// units scale this one. Per multiply, that moves 1 KB in and 1 KB out of the tile registers, where
// a pass of each group's rows over one tile at a time moved 4 KB in (the tile unit's loads and
// stores, not its multiplies, bound this product).
template <int F>
void AmxTilesF32(const F32Args& a, int64_t g0, int64_t g1) {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) cfg.rows[t] = 16, cfg.colsb[t] = 64;  // 16 rows x 64 bytes, every tile
  _tile_loadconfig(&cfg);
  const int64_t R = RecordBytes(F), K = a.K, stride = 6 * K, wstride = a.nb * 1024, T = g1 - g0;
  static thread_local std::vector<uint8_t> wide;
  static thread_local std::vector<float> accs;
  if (wide.size() < static_cast<size_t>(T * wstride + 64)) wide.resize(T * wstride + 64);
  if (accs.size() < static_cast<size_t>(T * 256 + 16)) accs.resize(T * 256 + 16);
  uint8_t* buf = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(wide.data()) + 63) & ~uintptr_t{63});
  float* acc = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(accs.data()) + 63) & ~uintptr_t{63});
  for (int64_t t = 0; t < T; ++t) WidenBf16<F>(a.w + (g0 + t) * a.nb * R, R, a.nb, buf + t * wstride);
  alignas(64) float sums[2][16 * 16];
  for (int64_t m0 = 0; m0 < a.M; m0 += 16) {
    const uint16_t* x = a.parts + m0 * 3 * K;
    const float* sx = HasOffset<F>() ? a.sx + m0 * a.nb : nullptr;
    // Tile t's sums for block b (in sums[parity]) into its accumulators.
    auto scale = [&](int64_t t, int64_t b, const float* sb) {
      const uint8_t* rec = a.w + ((g0 + t) * a.nb + b) * R;
      const __m512 d = ScaleD<F>(rec), c = HasOffset<F>() ? ScaleC<F>(rec, d) : d;
      float* at = acc + t * 256;
#pragma GCC unroll 16
      for (int r = 0; r < 16; ++r) {
        const __m512 sum = _mm512_load_ps(sb + 16 * r);
        __m512 v = b > 0 ? _mm512_fmadd_ps(sum, d, _mm512_load_ps(at + 16 * r)) : _mm512_mul_ps(sum, d);
        if (HasOffset<F>()) v = _mm512_fmadd_ps(c, _mm512_set1_ps(sx[r * a.nb + b]), v);
        _mm512_store_ps(at + 16 * r, v);
      }
    };
    int64_t pending_t = -1, pending_b = 0;
    int parity = 0;
    for (int64_t b = 0; b < a.nb; ++b) {
      const uint16_t* p = x + b * 3 * kBlock;  // hi; mid and lo follow, kBlock apart
      _tile_loadd(5, p, stride);
      _tile_loadd(6, p + kBlock, stride);
      _tile_loadd(7, p + 2 * kBlock, stride);
      for (int64_t t = 0; t < T; ++t) {
        const uint8_t* w = buf + t * wstride + b * 1024;
        if (parity == 0) {
          _tile_zero(0);
          _tile_loadd(2, w, 64);
          _tile_dpbf16ps(0, 5, 2);
          _tile_dpbf16ps(0, 6, 2);
          _tile_dpbf16ps(0, 7, 2);
          _tile_stored(0, sums[0], 64);
        } else {
          _tile_zero(1);
          _tile_loadd(3, w, 64);
          _tile_dpbf16ps(1, 5, 3);
          _tile_dpbf16ps(1, 6, 3);
          _tile_dpbf16ps(1, 7, 3);
          _tile_stored(1, sums[1], 64);
        }
        if (pending_t >= 0) scale(pending_t, pending_b, sums[parity ^ 1]);
        pending_t = t, pending_b = b, parity ^= 1;
      }
    }
    scale(pending_t, pending_b, sums[parity ^ 1]);
    const int64_t rows = std::min<int64_t>(16, a.M - m0);
    for (int64_t t = 0; t < T; ++t)
      for (int64_t r = 0; r < rows; ++r)
        _mm512_storeu_ps(a.y + (m0 + r) * a.N + (g0 + t) * kTile, _mm512_load_ps(acc + t * 256 + 16 * r));
  }
  _tile_release();
}
#endif

// Rows from which AMX takes the f32 product, where the CPU has AMX-BF16 and Linux grants it.
constexpr int64_t kAmxF32MinRows = 16;
constexpr int64_t kAmxItemTiles = 32;  // tiles per work item at most: their widened blocks stay in L2
constexpr int64_t kSplitShareValues = 1 << 14;  // rows x K per share of the split, at least

bool AmxBf16Ready() {
#if defined(__AMX_BF16__) && defined(__AVX512BF16__)
  return AmxGranted();
#else
  return false;
#endif
}

template <int F>
void ProductF32(ffi::ThreadPool& pool, const float* x, float* y, const uint8_t* w, int64_t M, int64_t K, int64_t N) {
  const int64_t nb = K / kBlock;
  const bool amx = AmxReads<F>() && M >= kAmxF32MinRows && AmxBf16Ready();
  // The parts and sums live in buffers kept per calling thread: a fresh 5 MB allocation per call
  // cost page faults and zeroing. Rows from M to the next 16 are zero (the tile loads read them).
  static thread_local std::vector<uint16_t> parts;
  static thread_local std::vector<float> sx;
  F32Args a{x, w, y, M, K, N, nb, nullptr, nullptr, (M + 15) / 16 * 16};
#if defined(__AMX_BF16__) && defined(__AVX512BF16__)
  if (amx) {
    if (parts.size() < static_cast<size_t>(3 * a.padded * K)) parts.resize(3 * a.padded * K);
    std::fill(parts.begin() + 3 * M * K, parts.begin() + 3 * a.padded * K, uint16_t{0});
    if (HasOffset<F>() && sx.size() < static_cast<size_t>(a.padded * nb)) sx.resize(a.padded * nb);
    a.parts = parts.data(), a.sx = HasOffset<F>() ? sx.data() : nullptr;
    // One parallel call: the rows' split in up to one share per thread, then about two runs per
    // thread of at most kAmxItemTiles tiles (their widened blocks stay in L2). Items are handed out
    // in order, so by the time a thread takes a run every share is taken, and it waits (briefly)
    // for those to be done. Two calls, one for the split, cost a helper's wake-up more per product.
    const int64_t threads = jaxserve::Workers(pool), tiles = N / kTile;
    const int64_t shares = std::clamp<int64_t>(M * K / kSplitShareValues, 1, threads);
    const int64_t rows_per = (M + shares - 1) / shares;
    const int64_t per = TilesPerRun(pool, tiles, 2, kAmxItemTiles);
    std::atomic<int64_t> split{0};
    jaxserve::ParallelFor(pool, shares + (tiles + per - 1) / per, [&](int64_t t) {
      if (t < shares) {
        // Through a's pointers: in the pool's threads, `parts` and `sx` would name their own buffers.
        SplitRows(x, K, std::min(M, t * rows_per), std::min(M, (t + 1) * rows_per), const_cast<uint16_t*>(a.parts),
                  const_cast<float*>(a.sx));
        split.fetch_add(1);
        return;
      }
      for (int spins = 0; split.load() < shares; ++spins) {
        if (spins < 4096) {
          jaxserve::Pause();
        } else {
          std::this_thread::yield();
        }
      }
      const int64_t g0 = (t - shares) * per;
      AmxTilesF32<F>(a, g0, std::min(tiles, g0 + per));
    });
    return;
  }
#endif
#if defined(__AVX512BW__) || (defined(__AVX2__) && defined(__FMA__))
  if (M < kShortRows) {  // the rows split into 16-bit parts, then about four runs of tiles per thread
    static thread_local Short16 x16;  // kept per calling thread, as the parts above
    SplitShort16(x, M, K, x16);
    const ShortArgs s{&x16, w, y, M, K, N, nb};
    ForTileRuns(pool, N / kTile, 4, N / kTile, [&](int64_t g0, int64_t g1) { ShortTiles<F>(s, g0, g1); });
    return;
  }
#endif
  // The multiply-adds: about four runs per thread.
  ForTileRuns(pool, N / kTile, 4, N / kTile, [&](int64_t g0, int64_t g1) {
#if defined(__AVX512BW__)
    VectorTilesF32<F>(a, g0, g1);
#elif defined(__AVX2__) && defined(__FMA__)
    WideTilesF32<F>(a, g0, g1);
#else
    ScalarTilesF32<F>(a, g0, g1);
#endif
  });
}

template <int F>
void Product(ffi::ThreadPool& pool, const float* x, const Args& a) {
  // The rows are quantized in shares of at least 2^18 values, then the tiles are shared out, about
  // four runs of tiles per thread.
  ForRowShares(pool, a.M, a.K, 1 << 18,
               [&](int64_t m0, int64_t m1) { QuantizeRows(x, a.K, m0, m1, *const_cast<Quantized*>(a.xq)); });
#if defined(__AMX_INT8__) && defined(__AVX512VNNI__)
  const bool amx = AmxReads<F>() && a.M >= kAmxMinRows && AmxGranted();
#endif
  ForTileRuns(pool, a.N / kTile, 4, a.N / kTile, [&](int64_t g0, int64_t g1) {
#if defined(__AMX_INT8__) && defined(__AVX512VNNI__)
    if (amx) {
      AmxTiles<F>(a, g0, g1);
      return;
    }
#endif
#if defined(__AVX512VNNI__) || defined(__AVX2__)
    VectorTiles<F>(a, g0, g1);
#else
    ScalarTiles<F>(a, g0, g1);
#endif
  });
}

}  // namespace

namespace jaxserve {

int64_t TileRecordBytes(int format) { return RecordBytes(format); }

void TileProduct(ffi::ThreadPool& pool, const float* x, const uint8_t* w, float* y, int64_t M, int64_t K, int64_t N,
                 int format, bool f32_activations) {
  if (f32_activations) {
    switch (format) {
      case kQ4_0: ProductF32<kQ4_0>(pool, x, y, w, M, K, N); break;
      case kQ4_1: ProductF32<kQ4_1>(pool, x, y, w, M, K, N); break;
      case kQ4_K: ProductF32<kQ4_K>(pool, x, y, w, M, K, N); break;
      case kQ5_K: ProductF32<kQ5_K>(pool, x, y, w, M, K, N); break;
      case kQ6_K: ProductF32<kQ6_K>(pool, x, y, w, M, K, N); break;
      default: ProductF32<kQ8_0>(pool, x, y, w, M, K, N); break;
    }
    return;
  }
  const int64_t nb = K / kBlock;
  const int64_t padded = (M + 15) / 16 * 16;  // AMX reads the rows 16 at a time; the rest are zero
  static thread_local Quantized xq;  // kept per calling thread, as ProductF32's parts
  if (xq.q.size() < static_cast<size_t>(padded * K)) xq.q.resize(padded * K);
  if (xq.s.size() < static_cast<size_t>(padded * nb)) {
    xq.s.resize(padded * nb), xq.ss.resize(padded * nb), xq.sums.resize(2 * padded * nb);
  }
  std::fill(xq.q.begin() + M * K, xq.q.begin() + padded * K, int8_t{0});
  std::fill(xq.s.begin() + M * nb, xq.s.begin() + padded * nb, 0.0f);
  std::fill(xq.ss.begin() + M * nb, xq.ss.begin() + padded * nb, 0.0f);
  std::fill(xq.sums.begin() + 2 * M * nb, xq.sums.begin() + 2 * padded * nb, 0);
  const Args a{&xq, w, y, M, K, N, nb};
  switch (format) {
    case kQ4_0: Product<kQ4_0>(pool, x, a); break;
    case kQ4_1: Product<kQ4_1>(pool, x, a); break;
    case kQ4_K: Product<kQ4_K>(pool, x, a); break;
    case kQ5_K: Product<kQ5_K>(pool, x, a); break;
    case kQ6_K: Product<kQ6_K>(pool, x, a); break;
    default: Product<kQ8_0>(pool, x, a); break;
  }
}

}  // namespace jaxserve

// 1 where this build has the f32 tiles' AMX-BF16 path and Linux grants the tile state.
extern "C" int JaxserveTilesAmxBf16() { return AmxBf16Ready() ? 1 : 0; }

// 1 where this build has the tiles' vector path for q8 activations (AVX-512 VNNI, or AVX2's
// vpmaddubsw); the engine uses the q8 tiles only then.
extern "C" int JaxserveTilesVectorized() {
#if defined(__AVX512VNNI__) || defined(__AVX2__)
  return 1;
#else
  return 0;
#endif
}

// 1 where this build has the tiles' vector path for f32 activations (AVX-512BW or AVX2 with FMA:
// multiply-adds; AMX-BF16 from 16 rows where the CPU also has that); the engine uses the f32 tiles
// only then.
extern "C" int JaxserveTilesF32Vectorized() {
#if defined(__AVX512BW__) || (defined(__AVX2__) && defined(__FMA__))
  return 1;
#else
  return 0;
#endif
}
