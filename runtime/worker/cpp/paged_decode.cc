// Paged decode attention for XLA:CPU, called through XLA's FFI (runtime/worker/cpp_kernels.py).
//
// XLA:CPU cannot read K/V where they lie in the paged pool: its lowering gathers every row's
// context into a fresh [rows, chunk, kv_heads, head_dim] copy, then transposes K element by
// element for the score dot, and that copy is most of a wide decode step. This kernel walks each
// row's block table and reads K/V from the pool in place, one block at a time, with an online
// softmax in f32. A prompt's rows in a prefill step (one sequence, each row one position further)
// walk its blocks together, as a flash-attention tile (GroupWalk): 512-token TTFT 1.10x, 2,048
// tokens 1.38x (docs/benchmarks/, "A prompt's rows walk together").
//
// Inputs (row-major):
//   q       f32 [T, H, R, D]   queries, already scaled; H kv heads, R query heads per kv head
//   k_pool  f32 or u16 [N, BS, H, D]; u16 holds bf16 bits (kernels.BF16_BITS)
//   v_pool  same as k_pool
//   tables  s32 [S, M]          block tables
//   seq     s32 [T]             each row's sequence (a row of `tables`)
//   limit   s32 [T]             each row sees pool positions [start, limit)
//   start   s32 [T]             0, or a sliding window's first position: blocks wholly before it
//                               are never read (a window-aware cache may have handed them to
//                               another sequence), and its first block's earlier positions are
//                               masked
// Outputs: the online-softmax state of each row over those positions, for the caller to merge:
//   mx [T, H, R] (the running max; -1e30 where limit is 0), den [T, H, R], acc [T, H, R, D].
// Attributes: part_tokens, the shortest piece a row's positions are split into when there are too
//   few rows to keep the threads busy (see Run); 0 never splits. group_rows, how many consecutive
//   rows of one sequence (a prompt's tokens) walk its blocks together (see GroupWalk); 1 never groups.
//   softcap, Gemma 2's logit softcapping: scores s become softcap * tanh(s / softcap); 0 leaves them.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "parallel_for.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kMaxHeads = 128;  // H * R
constexpr int64_t kMaxBlock = 64;   // BS
constexpr int64_t kMaxDim = 256;    // D

inline float Widen(float x) { return x; }
inline float Widen(uint16_t bits) {  // bf16 is the top half of an f32
  const uint32_t u = static_cast<uint32_t>(bits) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

template <typename KV>
inline void WidenRow(const KV* src, float* dst, int64_t D) {  // one K or V row into f32
#pragma omp simd
  for (int64_t d = 0; d < D; ++d) dst[d] = Widen(src[d]);
}

// One block of the online softmax for one query head: the block's scores `pi` [n] become
// exp(score - new_max) in place, the running max `m` and denominator `l` move on, and the factor
// that rescales what the accumulator holds so far is returned.
inline float Softmax(float* pi, int64_t n, float new_max, float& m, float& l) {
  const float corr = std::exp(m - new_max);
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t j = 0; j < n; ++j) {
    pi[j] = std::exp(pi[j] - new_max);
    sum += pi[j];
  }
  l = l * corr + sum;
  m = new_max;
  return corr;
}

struct Shape {
  int64_t H, R, D, N, BS, M;
  float softcap;  // 0: none
};

// The live scores [a, n) of one query head's block: capped (softcap), and their max folded into
// `max`.
inline void CapAndMax(float* pi, int64_t a, int64_t n, float softcap, float& max) {
  if (softcap > 0.f) {
    const float inv = 1.f / softcap;
    for (int64_t j = a; j < n; ++j) pi[j] = softcap * std::tanh(pi[j] * inv);
  }
  for (int64_t j = a; j < n; ++j) max = std::max(max, pi[j]);
}

// One piece of a call's work: row `row`'s pool positions [begin, end), `begin` on a block boundary
// (positions of its first block before the row's start are masked), and where its online-softmax
// state goes (the outputs, or scratch that Merge folds into them).
struct Part {
  int64_t row, begin, end;
  float *mx, *den, *acc;  // [HR], [HR], [HR, D]; a group's: [rows * HR], ...
  int64_t rows = 1;       // > 1: a group of consecutive rows of one sequence (GroupWalk), from 0 to end
};

// A part's walk over its blocks; the online-softmax state lives here, and a block body (below)
// turns one block into scores, then probabilities through Softmax, then adds the values.
struct RowState {
  int64_t HR, D;
  float* a;  // the part's accumulator [HR, D]
  float m[kMaxHeads], l[kMaxHeads], block_max[kMaxHeads];
  alignas(64) float p[kMaxHeads][kMaxBlock];  // scores, then probabilities, of one block
  // The next block's K (stream 0) and V (stream 1) rows, requested into L2 a few lines at a time
  // while this block is walked: the vector body asks for ahead_step[0] lines per query head and 16
  // tokens of scores, and ahead_step[1] per query head of values. Requested all at once, the lines
  // would queue behind each other; left to the hardware, each block's first lines wait on memory.
  const char* ahead[2] = {nullptr, nullptr};
  int64_t ahead_left[2] = {0, 0}, ahead_step[2] = {0, 0};
  void Ahead(int stream) {
    for (int64_t i = 0; i < ahead_step[stream] && ahead_left[stream] > 0; ++i) {
      __builtin_prefetch(ahead[stream], 0, 2);  // read, into L2 (prefetcht1)
      ahead[stream] += 64;
      ahead_left[stream] -= 64;
    }
  }
};

// `next`, where not null, is the part this thread walks next: its first block is requested during
// this part's last block.
template <typename KV, typename Body>
void Walk(const Part& part, const Part* next, const Shape& s, const KV* k_pool, const KV* v_pool,
          const int32_t* tables, const int32_t* seq, int64_t start, const Body& body) {
  RowState st;
  st.HR = s.H * s.R;
  st.D = s.D;
  st.a = part.acc;
  std::fill(st.m, st.m + st.HR, -1e30f);
  std::fill(st.l, st.l + st.HR, 0.f);
  std::fill(st.a, st.a + st.HR * s.D, 0.f);
  const int64_t block_stride = s.BS * s.H * s.D;
  const int32_t* table = tables + static_cast<int64_t>(seq[part.row]) * s.M;
  for (int64_t p0 = part.begin; p0 < part.end; p0 += s.BS) {
    const int64_t block = std::clamp<int64_t>(table[p0 / s.BS], 0, s.N - 1);
    std::copy(st.m, st.m + st.HR, st.block_max);
    const int64_t n = std::min<int64_t>(s.BS, part.end - p0);
    // The block after this one: this part's next, or the next part's first.
    int64_t after = -1, after_tokens = 0;
    if (p0 + s.BS < part.end) {
      after = table[p0 / s.BS + 1], after_tokens = std::min<int64_t>(s.BS, part.end - p0 - s.BS);
    } else if (next != nullptr && next->end > next->begin) {
      after = tables[static_cast<int64_t>(seq[next->row]) * s.M + next->begin / s.BS];
      after_tokens = std::min<int64_t>(s.BS, next->end - next->begin);
    }
    st.ahead_left[0] = st.ahead_left[1] = 0;
    if (after >= 0) {
      after = std::clamp<int64_t>(after, 0, s.N - 1);
      const int64_t bytes = after_tokens * s.H * s.D * static_cast<int64_t>(sizeof(KV));
      const int64_t lines = (bytes + 63) / 64, score_steps = st.HR * ((n + 15) / 16);
      st.ahead[0] = reinterpret_cast<const char*>(k_pool + after * block_stride);
      st.ahead[1] = reinterpret_cast<const char*>(v_pool + after * block_stride);
      st.ahead_left[0] = st.ahead_left[1] = bytes;
      st.ahead_step[0] = (lines + score_steps - 1) / score_steps;
      st.ahead_step[1] = (lines + st.HR - 1) / st.HR;
    }
    body(st, k_pool + block * block_stride, v_pool + block * block_stride, std::clamp<int64_t>(start - p0, 0, n), n);
  }
  std::copy(st.m, st.m + st.HR, part.mx);
  std::copy(st.l, st.l + st.HR, part.den);
}

// The scalar block body, for any head_dim and block size.
// Positions [0, a) of the block are before the row's start (a sliding window): never scored.
template <typename KV>
void ScalarBlock(RowState& st, const Shape& s, const float* qt, const KV* kb, const KV* vb, int64_t a, int64_t n) {
  const int64_t D = s.D;
  alignas(64) float x[kMaxDim];  // one K or V row in f32
  for (int64_t j = a; j < n; ++j) {  // scores: each K row is read once for its R query heads
    for (int64_t h = 0; h < s.H; ++h) {
      WidenRow(kb + (j * s.H + h) * D, x, D);
      for (int64_t r = 0; r < s.R; ++r) {
        const int64_t i = h * s.R + r;
        const float* qr = qt + i * D;
        float dot = 0.f;
#pragma omp simd reduction(+ : dot)
        for (int64_t d = 0; d < D; ++d) dot += qr[d] * x[d];
        st.p[i][j] = dot;
      }
    }
  }
  for (int64_t i = 0; i < st.HR; ++i) {  // online softmax: rescale what came before
    CapAndMax(st.p[i], a, n, s.softcap, st.block_max[i]);
    const float corr = Softmax(st.p[i] + a, n - a, st.block_max[i], st.m[i], st.l[i]);
    float* ai = st.a + i * D;
#pragma omp simd
    for (int64_t d = 0; d < D; ++d) ai[d] *= corr;
  }
  for (int64_t j = a; j < n; ++j) {  // values
    for (int64_t h = 0; h < s.H; ++h) {
      WidenRow(vb + (j * s.H + h) * D, x, D);
      for (int64_t r = 0; r < s.R; ++r) {
        const int64_t i = h * s.R + r;
        const float w = st.p[i][j];
        float* ai = st.a + i * D;
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) ai[d] += w * x[d];
      }
    }
  }
}

// The vector path, for head_dim a multiple of 16 (ND 16-float chunks) and blocks a multiple of 16
// tokens. Scores take 16 tokens at a time: each token's dot is left as 16 partial sums, and one
// tree of shuffles and adds turns the 16 partial vectors into the 16 scores, so no dot pays a
// horizontal reduction of its own. Values keep each query head's accumulator in registers across
// the block. Lanes past a block's last live token are computed from whatever the block holds
// there, and never read.
typedef float F16 __attribute__((vector_size(64)));
typedef int32_t I16 __attribute__((vector_size(64)));
typedef uint32_t U32x16 __attribute__((vector_size(64)));
typedef uint16_t U16x16 __attribute__((vector_size(32)));

inline F16 Load16(const float* p) {
  F16 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline F16 Load16(const uint16_t* p) {  // 16 bf16 values, widened
  U16x16 u;
  std::memcpy(&u, p, sizeof u);
  const U32x16 w = __builtin_convertvector(u, U32x16) << 16;
  F16 v;
  std::memcpy(&v, &w, sizeof v);
  return v;
}

// Two-input shuffles with constant lane indices into the inputs' concatenation: GCC's
// __builtin_shuffle (any GCC with vector extensions), clang's __builtin_shufflevector.
#if defined(__clang__)
#define SHUFFLE16(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
#define SHUFFLE16(a, b, ...) __builtin_shuffle(a, b, (I16){__VA_ARGS__})
#endif

// v[16]: lane j of the result is the sum of v[j]'s lanes. Each step adds the first and the second
// half of each group of lanes, for two inputs at once (groups of 8, 4, 2, then 1), so after four
// steps lane j holds input j's whole sum.
inline F16 Sum16(F16* v) {
  for (int k = 0; k < 8; ++k) {
    const F16 a = v[2 * k], b = v[2 * k + 1];
    v[k] = SHUFFLE16(a, b, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
           SHUFFLE16(a, b, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  }
  for (int k = 0; k < 4; ++k) {
    const F16 a = v[2 * k], b = v[2 * k + 1];
    v[k] = SHUFFLE16(a, b, 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
           SHUFFLE16(a, b, 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
  }
  for (int k = 0; k < 2; ++k) {
    const F16 a = v[2 * k], b = v[2 * k + 1];
    v[k] = SHUFFLE16(a, b, 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
           SHUFFLE16(a, b, 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
  }
  return SHUFFLE16(v[0], v[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
         SHUFFLE16(v[0], v[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
}

template <int ND, typename KV>
void VectorBlock(RowState& st, const Shape& s, const float* qt, const KV* kb, const KV* vb, int64_t a, int64_t n) {
  constexpr int64_t D = ND * 16;
  const int64_t H = s.H, R = s.R;
  F16 part[16];
  for (int64_t i = 0; i < st.HR; ++i) {  // scores, 16 tokens at a time
    const int64_t h = i / R;
    F16 qv[ND];
    for (int c = 0; c < ND; ++c) qv[c] = Load16(qt + i * D + 16 * c);
    for (int64_t j0 = 0; j0 < n; j0 += 16) {
      st.Ahead(0);
      for (int jj = 0; jj < 16; ++jj) {
        const KV* kr = kb + ((j0 + jj) * H + h) * D;
        F16 sum = qv[0] * Load16(kr);
        for (int c = 1; c < ND; ++c) sum += qv[c] * Load16(kr + 16 * c);
        part[jj] = sum;
      }
      const F16 scores = Sum16(part);
      std::memcpy(&st.p[i][j0], &scores, sizeof scores);
    }
    CapAndMax(st.p[i], a, n, s.softcap, st.block_max[i]);
  }
  for (int64_t i = 0; i < st.HR; ++i) {  // online softmax, then values into registers
    const float* pi = st.p[i];
    const float corr = Softmax(st.p[i] + a, n - a, st.block_max[i], st.m[i], st.l[i]);
    F16 av[ND];
    for (int c = 0; c < ND; ++c) av[c] = Load16(st.a + i * D + 16 * c) * corr;
    const int64_t h = i / R;
    st.Ahead(1);
    for (int64_t j = a; j < n; ++j) {
      const KV* vr = vb + (j * H + h) * D;
      for (int c = 0; c < ND; ++c) av[c] += pi[j] * Load16(vr + 16 * c);
    }
    std::memcpy(st.a + i * D, av, sizeof av);
  }
}

// r[i] lane j <- r[j] lane i: four rounds of two-input shuffles, each swapping the off-diagonal
// blocks of every 2B x 2B block (B = 8, 4, 2, 1).
inline void Transpose16(F16* r) {
  auto round = [&](int b, auto lo, auto hi) {
    for (int i = 0; i < 16; ++i) {
      if (i & b) continue;
      const F16 a = r[i], c = r[i + b];
      r[i] = lo(a, c), r[i + b] = hi(a, c);
    }
  };
  round(8, [](F16 a, F16 c) { return SHUFFLE16(a, c, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23); },
        [](F16 a, F16 c) { return SHUFFLE16(a, c, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31); });
  round(4, [](F16 a, F16 c) { return SHUFFLE16(a, c, 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27); },
        [](F16 a, F16 c) { return SHUFFLE16(a, c, 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31); });
  round(2, [](F16 a, F16 c) { return SHUFFLE16(a, c, 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29); },
        [](F16 a, F16 c) { return SHUFFLE16(a, c, 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31); });
  round(1, [](F16 a, F16 c) { return SHUFFLE16(a, c, 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30); },
        [](F16 a, F16 c) { return SHUFFLE16(a, c, 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31); });
}

// A prompt's rows (consecutive rows of one sequence, row g seeing positions [0, limit0 + g)) walk
// the sequence's blocks together, as a flash-attention tile: each block's K rows are transposed
// once per kv head (kt [D][16 tokens]), so a query's 16 scores are D multiply-adds with its
// values broadcast, 8 queries at a time against each loaded row of kt; and each V row loaded
// feeds MB queries' accumulators held in registers. Per row alone (VectorBlock), every query
// reloaded the block's K and V and reduced each dot across lanes. Lanes past a row's last position
// hold whatever the block holds there: their scores are never read and their probabilities are
// zero.
constexpr int64_t kMaxGroupRows = 16;
constexpr int kScoreQueries = 8;  // queries per pass over kt

template <int ND, typename KV>
void GroupWalk(const Part& part, const Shape& s, const float* q, const KV* k_pool, const KV* v_pool,
               const int32_t* tables, const int32_t* seq, const int32_t* limit, const int32_t* start) {
  constexpr int64_t D = ND * 16;
  constexpr int MB = 24 / ND;  // queries per pass over V: MB x ND accumulators in registers
  const int64_t H = s.H, R = s.R, HR = H * R, G = part.rows, M = G * HR;
  const float* qt = q + part.row * HR * D;  // [G, H, R, D]: query m = g * HR + h * R + r
  alignas(64) static const float zeros[kMaxDim] = {};
  alignas(64) float dummy_p[kMaxBlock], dummy_acc[kMaxDim] = {};
  alignas(64) float kt[kMaxDim * 16];
  RowState st;
  st.HR = M, st.D = D, st.a = part.acc;
  std::fill(st.m, st.m + M, -1e30f);
  std::fill(st.l, st.l + M, 0.f);
  std::fill(st.a, st.a + M * D, 0.f);
  int64_t lim[kMaxGroupRows], lo_pos[kMaxGroupRows];
  for (int64_t g = 0; g < G; ++g) lim[g] = limit[part.row + g], lo_pos[g] = start[part.row + g];
  const int64_t block_stride = s.BS * H * D;
  const int32_t* table = tables + static_cast<int64_t>(seq[part.row]) * s.M;
  for (int64_t p0 = part.begin; p0 < part.end; p0 += s.BS) {
    const int64_t block = std::clamp<int64_t>(table[p0 / s.BS], 0, s.N - 1);
    const KV* kb = k_pool + block * block_stride;
    const KV* vb = v_pool + block * block_stride;
    // Each row's live positions in this block are [a, n); rows from g0 have some ahead of them.
    int64_t n[kMaxGroupRows], a[kMaxGroupRows], g0 = G;
    for (int64_t g = G - 1; g >= 0; --g) {
      n[g] = std::clamp<int64_t>(lim[g] - p0, 0, s.BS);
      a[g] = std::clamp<int64_t>(lo_pos[g] - p0, 0, n[g]);
      if (n[g] > 0) g0 = g;
    }
    const int64_t live = std::min<int64_t>(s.BS, part.end - p0);
    for (int64_t h = 0; h < H; ++h) {
      for (int64_t j0 = 0; j0 < live; j0 += 16) {  // scores of 16 positions
        for (int c = 0; c < ND; ++c) {
          F16 r[16];
          for (int jj = 0; jj < 16; ++jj) r[jj] = Load16(kb + ((j0 + jj) * H + h) * D + 16 * c);
          Transpose16(r);
          for (int i = 0; i < 16; ++i) std::memcpy(kt + (16 * c + i) * 16, &r[i], sizeof(F16));
        }
        // The queries of kv head h in rows with positions past j0, kScoreQueries at a time.
        int64_t first = g0;
        while (first < G && n[first] <= j0) ++first;
        const int64_t count = (G - first) * R;
        for (int64_t b = 0; b < count; b += kScoreQueries) {
          const float* qm[kScoreQueries];
          float* pm[kScoreQueries];
          for (int i = 0; i < kScoreQueries; ++i) {
            const int64_t k = b + i, m = (first + k / R) * HR + h * R + k % R;
            qm[i] = k < count ? qt + m * D : zeros;
            pm[i] = k < count ? st.p[m] + j0 : dummy_p;
          }
          F16 acc[kScoreQueries] = {};
          for (int64_t d = 0; d < D; ++d) {
            const F16 kd = Load16(kt + 16 * d);
            for (int i = 0; i < kScoreQueries; ++i) acc[i] += qm[i][d] * kd;
          }
          for (int i = 0; i < kScoreQueries; ++i) std::memcpy(pm[i], &acc[i], sizeof(F16));
        }
      }
    }
    // Online softmax per query over its row's live positions; the rest of the block's lanes are 0.
    // A row whose window starts past this block has none here (corr 1 keeps its state).
    float corr[kMaxHeads];
    for (int64_t g = g0; g < G; ++g) {
      for (int64_t i = 0; i < HR; ++i) {
        const int64_t m = g * HR + i;
        corr[m] = 1.f;
        if (a[g] < n[g]) {
          float mx = st.m[m];
          CapAndMax(st.p[m], a[g], n[g], s.softcap, mx);
          corr[m] = Softmax(st.p[m] + a[g], n[g] - a[g], mx, st.m[m], st.l[m]);
        }
        std::fill(st.p[m], st.p[m] + a[g], 0.f);
        std::fill(st.p[m] + n[g], st.p[m] + live, 0.f);
      }
    }
    for (int64_t h = 0; h < H; ++h) {  // values: MB queries' accumulators per pass over V
      const int64_t count = (G - g0) * R;
      for (int64_t b = 0; b < count; b += MB) {
        float* am[MB];
        const float* pm[MB];
        float cm[MB];
        int64_t upto = 0;  // positions any of the pass's queries sees
        for (int i = 0; i < MB; ++i) {
          const int64_t k = b + i, g = g0 + k / R, m = g * HR + h * R + k % R;
          am[i] = k < count ? st.a + m * D : dummy_acc;
          pm[i] = k < count ? st.p[m] : zeros;
          cm[i] = k < count ? corr[m] : 0.f;
          if (k < count) upto = std::max(upto, n[g]);
        }
        F16 acc[MB][ND];
        for (int i = 0; i < MB; ++i)
          for (int c = 0; c < ND; ++c) acc[i][c] = Load16(am[i] + 16 * c) * cm[i];
        for (int64_t j = 0; j < upto; ++j) {
          F16 v[ND];
          for (int c = 0; c < ND; ++c) v[c] = Load16(vb + (j * H + h) * D + 16 * c);
          for (int i = 0; i < MB; ++i)
            for (int c = 0; c < ND; ++c) acc[i][c] += pm[i][j] * v[c];
        }
        for (int i = 0; i < MB; ++i) std::memcpy(am[i], acc[i], sizeof(acc[i]));
      }
    }
  }
  std::copy(st.m, st.m + M, part.mx);
  std::copy(st.l, st.l + M, part.den);
}

// Whether rows of one sequence can walk together here: the vector path's shapes.
bool Groupable(const Shape& s) { return s.BS % 16 == 0 && (s.D == 32 || s.D == 64 || s.D == 128); }

template <typename KV>
void WalkPart(const Part& part, const Part* next, const Shape& s, const float* q, const KV* k_pool,
              const KV* v_pool, const int32_t* tables, const int32_t* seq, const int32_t* limit,
              const int32_t* start) {
  if (part.rows > 1) {
    if (s.D == 32) return GroupWalk<2>(part, s, q, k_pool, v_pool, tables, seq, limit, start);
    if (s.D == 64) return GroupWalk<4>(part, s, q, k_pool, v_pool, tables, seq, limit, start);
    return GroupWalk<8>(part, s, q, k_pool, v_pool, tables, seq, limit, start);
  }
  const float* qt = q + part.row * s.H * s.R * s.D;
  auto walk = [&](auto block) { Walk(part, next, s, k_pool, v_pool, tables, seq, start[part.row], block); };
  auto vector = [&](auto nd) {
    walk([&](RowState& st, const KV* kb, const KV* vb, int64_t a, int64_t n) {
      VectorBlock<decltype(nd)::value>(st, s, qt, kb, vb, a, n);
    });
  };
  if (s.BS % 16 == 0 && s.D == 32) return vector(std::integral_constant<int, 2>());
  if (s.BS % 16 == 0 && s.D == 64) return vector(std::integral_constant<int, 4>());
  if (s.BS % 16 == 0 && s.D == 128) return vector(std::integral_constant<int, 8>());
  walk([&](RowState& st, const KV* kb, const KV* vb, int64_t a, int64_t n) { ScalarBlock(st, s, qt, kb, vb, a, n); });
}

// Folds a row's parts (scratch states, in position order) into the row's output state: the
// largest max, and each part's denominator and accumulator rescaled to it.
void Merge(const Part* parts, int64_t count, int64_t HR, int64_t D, float* mx, float* den, float* acc) {
  for (int64_t i = 0; i < HR; ++i) {
    float m = -1e30f;
    for (int64_t c = 0; c < count; ++c) m = std::max(m, parts[c].mx[i]);
    float l = 0.f;
    float* ai = acc + i * D;
    std::fill(ai, ai + D, 0.f);
    for (int64_t c = 0; c < count; ++c) {
      const float w = std::exp(parts[c].mx[i] - m);
      l += w * parts[c].den[i];
      const float* pa = parts[c].acc + i * D;
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) ai[d] += w * pa[d];
    }
    mx[i] = m;
    den[i] = l;
  }
}

// Rows are shared out over the calling thread and the kernels' helper threads (parallel_for.h), one part
// per row, unless a row is longer than an even share of the step's positions over about
// kItemsPerThread items per thread: such a row's positions are split into parts of about that
// share (whole blocks, at least `part_tokens`), like vLLM's partitioned decode attention, and the
// parts' states are then merged. So batch 1 at long context keeps every thread busy, and so does a
// long row among many short ones, where it would otherwise be one thread's walk while the others
// finish early. part_tokens 0 never splits. A work item is a run of consecutive parts (about
// kItemsPerThread items per thread), so that a part's walk knows the next one to request ahead.
constexpr int64_t kItemsPerThread = 4;

template <typename KV>
void Run(ffi::ThreadPool& pool, int64_t rows, const Shape& s, int64_t part_tokens, int64_t group_rows, const float* q,
         const KV* k_pool, const KV* v_pool, const int32_t* tables, const int32_t* seq, const int32_t* limit,
         const int32_t* start, float* mx, float* den, float* acc) {
  const int64_t HR = s.H * s.R, items_wanted = kItemsPerThread * (pool.num_threads() + 1);
  const int64_t min_blocks = std::max<int64_t>(1, (part_tokens + s.BS - 1) / s.BS);  // of a part
  int64_t positions = 0;
  // A row walks from the block of its start (0, or its sliding window's first position).
  auto first_block = [&](int64_t t) { return std::clamp<int64_t>(start[t], 0, std::max(limit[t], 0)) / s.BS; };
  for (int64_t t = 0; t < rows; ++t) positions += std::max<int64_t>(limit[t] - first_block(t) * s.BS, 0);
  // Blocks per part, about: an even share of the step's blocks over items_wanted items.
  const int64_t share_blocks =
      std::max(min_blocks, ((positions + items_wanted - 1) / items_wanted + s.BS - 1) / s.BS);
  std::vector<Part> parts;
  std::vector<int64_t> first(rows + 1);  // row t's parts are parts[first[t], first[t + 1])
  int64_t scratch_parts = 0;
  // Up to group_max consecutive rows of one sequence whose positions end one apart (a prompt's
  // tokens) are one part, walked together (GroupWalk) and never split.
  const int64_t group_max =
      Groupable(s) ? std::clamp<int64_t>(group_rows, 1, std::min<int64_t>(kMaxGroupRows, kMaxHeads / HR)) : 1;
  for (int64_t t = 0; t < rows; ++t) {
    int64_t g = 1;
    while (limit[t] > 0 && g < group_max && t + g < rows && seq[t + g] == seq[t] && limit[t + g] == limit[t] + g) ++g;
    if (g > 1) {  // rows t + 1 .. t + g - 1 have no parts of their own
      first[t] = static_cast<int64_t>(parts.size());
      for (int64_t u = t + 1; u < t + g; ++u) first[u] = first[t] + 1;
      Part group{t, first_block(t) * s.BS, limit[t + g - 1], nullptr, nullptr, nullptr};
      group.rows = g;
      parts.push_back(group);
      t += g - 1;
      continue;
    }
    const int64_t lim = limit[t], b0 = first_block(t), blocks = std::max<int64_t>((lim + s.BS - 1) / s.BS - b0, 0);
    const int64_t wanted = part_tokens > 0 ? std::clamp<int64_t>((blocks + share_blocks - 1) / share_blocks, 1,
                                                                 std::max<int64_t>(1, blocks / min_blocks))
                                           : 1;
    const int64_t span_blocks = std::max<int64_t>(1, (blocks + wanted - 1) / wanted);
    const int64_t count = std::max<int64_t>(1, (blocks + span_blocks - 1) / span_blocks);
    const int64_t span = span_blocks * s.BS;  // positions per part
    first[t] = static_cast<int64_t>(parts.size());
    for (int64_t b = 0; b < count; ++b) {
      parts.push_back({t, std::min(lim, b0 * s.BS + b * span), std::min(lim, b0 * s.BS + (b + 1) * span), nullptr,
                       nullptr, nullptr});
    }
    if (count > 1) scratch_parts += count;
  }
  first[rows] = static_cast<int64_t>(parts.size());
  std::vector<float> scratch(scratch_parts * HR * (2 + s.D));
  float* next = scratch.data();
  for (int64_t t = 0; t < rows; ++t) {
    for (int64_t c = first[t]; c < first[t + 1]; ++c) {
      Part& part = parts[c];
      if (first[t + 1] - first[t] == 1) {  // the row's (or group's) one part writes the outputs
        part.mx = mx + t * HR, part.den = den + t * HR, part.acc = acc + t * HR * s.D;
      } else {
        part.mx = next, part.den = next + HR, part.acc = next + 2 * HR;
        next += HR * (2 + s.D);
      }
    }
  }
  // Work items of `chunk` consecutive parts, about items_wanted of them, so that a thread knows
  // which part it walks next (Walk requests that part's first block ahead).
  const Part* all = parts.data();
  const int64_t count = static_cast<int64_t>(parts.size());
  const int64_t chunk = std::max<int64_t>(1, count / items_wanted);
  jaxserve::ParallelFor(pool, (count + chunk - 1) / chunk, [=](int64_t item) {
    const int64_t c1 = std::min(count, (item + 1) * chunk);
    for (int64_t c = item * chunk; c < c1; ++c) {
      const Part* next = c + 1 < c1 && all[c + 1].rows == 1 ? &all[c + 1] : nullptr;
      WalkPart(all[c], next, s, q, k_pool, v_pool, tables, seq, limit, start);
    }
  });
  for (int64_t t = 0; t < rows; ++t) {
    const int64_t count = first[t + 1] - first[t];
    if (count > 1) Merge(all + first[t], count, HR, s.D, mx + t * HR, den + t * HR, acc + t * HR * s.D);
  }
}

ffi::Error PagedDecodeImpl(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer k_pool,
                           ffi::AnyBuffer v_pool, ffi::AnyBuffer tables, ffi::AnyBuffer seq,
                           ffi::AnyBuffer limit, ffi::AnyBuffer start, ffi::Result<ffi::AnyBuffer> mx,
                           ffi::Result<ffi::AnyBuffer> den, ffi::Result<ffi::AnyBuffer> acc,
                           int64_t part_tokens, int64_t group_rows, float softcap) {
  const auto qd = q.dimensions(), kd = k_pool.dimensions(), td = tables.dimensions();
  if (qd.size() != 4 || kd.size() != 4 || td.size() != 2) {
    return ffi::Error::InvalidArgument("paged_decode: q, pools and tables must be rank 4, 4 and 2");
  }
  const int64_t rows = qd[0];
  const Shape s{qd[1], qd[2], qd[3], kd[0], kd[1], td[1], softcap};
  if (kd[2] != s.H || kd[3] != s.D || s.H * s.R > kMaxHeads || s.BS > kMaxBlock || s.D > kMaxDim) {
    return ffi::Error::InvalidArgument("paged_decode: unsupported shapes");
  }
  if (q.element_type() != ffi::F32 || tables.element_type() != ffi::S32 ||
      seq.element_type() != ffi::S32 || limit.element_type() != ffi::S32 || start.element_type() != ffi::S32 ||
      v_pool.element_type() != k_pool.element_type()) {
    return ffi::Error::InvalidArgument("paged_decode: unsupported dtypes");
  }
  if (rows == 0) return ffi::Error::Success();
  const float* qp = q.typed_data<float>();
  const int32_t *tp = tables.typed_data<int32_t>(), *sp = seq.typed_data<int32_t>(),
                *lp = limit.typed_data<int32_t>(), *st = start.typed_data<int32_t>();
  float *mp = mx->typed_data<float>(), *dp = den->typed_data<float>(), *ap = acc->typed_data<float>();
  if (k_pool.element_type() == ffi::F32) {
    Run(pool, rows, s, part_tokens, group_rows, qp, k_pool.typed_data<float>(), v_pool.typed_data<float>(), tp, sp, lp, st, mp, dp, ap);
  } else if (k_pool.element_type() == ffi::U16) {
    Run(pool, rows, s, part_tokens, group_rows, qp, k_pool.typed_data<uint16_t>(), v_pool.typed_data<uint16_t>(), tp, sp, lp, st, mp, dp, ap);
  } else {
    return ffi::Error::InvalidArgument("paged_decode: pools must be f32 or u16 (bf16 bits)");
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxservePagedDecode, PagedDecodeImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()  // q
                                  .Arg<ffi::AnyBuffer>()  // k_pool
                                  .Arg<ffi::AnyBuffer>()  // v_pool
                                  .Arg<ffi::AnyBuffer>()  // tables
                                  .Arg<ffi::AnyBuffer>()  // seq
                                  .Arg<ffi::AnyBuffer>()  // limit
                                  .Arg<ffi::AnyBuffer>()  // start
                                  .Ret<ffi::AnyBuffer>()  // mx
                                  .Ret<ffi::AnyBuffer>()  // den
                                  .Ret<ffi::AnyBuffer>()  // acc
                                  .Attr<int64_t>("part_tokens")
                                  .Attr<int64_t>("group_rows")
                                  .Attr<float>("softcap"));
