// Paged decode attention for XLA:CPU, called through XLA's FFI (runtime/worker/cpp_kernels.py).
//
// XLA:CPU cannot read K/V where they lie in the paged pool: its lowering gathers every row's
// context into a fresh [rows, chunk, kv_heads, head_dim] copy, then transposes K element by
// element for the score dot, and that copy is most of a wide decode step. This kernel walks each
// row's block table and reads K/V from the pool in place, one block at a time, with an online
// softmax in f32.
//
// Inputs (row-major):
//   q       f32 [T, H, R, D]   queries, already scaled; H kv heads, R query heads per kv head
//   k_pool  f32 or u16 [N, BS, H, D]; u16 holds bf16 bits (kernels.BF16_BITS)
//   v_pool  same as k_pool
//   tables  s32 [S, M]          block tables
//   seq     s32 [T]             each row's sequence (a row of `tables`)
//   limit   s32 [T]             each row sees pool positions [0, limit)
// Outputs: the online-softmax state of each row over those positions, for the caller to merge:
//   mx [T, H, R] (the running max; -1e30 where limit is 0), den [T, H, R], acc [T, H, R, D].

#include <algorithm>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>

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

struct Shape {
  int64_t H, R, D, N, BS, M;
};

template <typename KV>
void Row(int64_t t, const Shape& s, const float* q, const KV* k_pool, const KV* v_pool,
         const int32_t* tables, const int32_t* seq, const int32_t* limit, float* mx, float* den,
         float* acc) {
  const int64_t HR = s.H * s.R, D = s.D, block_stride = s.BS * s.H * D;
  const float* qt = q + t * HR * D;
  float* a = acc + t * HR * D;
  float m[kMaxHeads], l[kMaxHeads], block_max[kMaxHeads];
  alignas(64) float p[kMaxHeads][kMaxBlock];  // scores, then probabilities, of one block
  alignas(64) float x[kMaxDim];               // one K or V row in f32
  std::fill(m, m + HR, -1e30f);
  std::fill(l, l + HR, 0.f);
  std::fill(a, a + HR * D, 0.f);
  const int64_t lim = limit[t];
  const int32_t* table = tables + static_cast<int64_t>(seq[t]) * s.M;
  for (int64_t p0 = 0; p0 < lim; p0 += s.BS) {
    const int64_t block = std::clamp<int64_t>(table[p0 / s.BS], 0, s.N - 1);
    const int64_t n = std::min<int64_t>(s.BS, lim - p0);
    const KV* kb = k_pool + block * block_stride;
    const KV* vb = v_pool + block * block_stride;
    std::copy(m, m + HR, block_max);
    for (int64_t j = 0; j < n; ++j) {  // scores: each K row is read once for its R query heads
      for (int64_t h = 0; h < s.H; ++h) {
        WidenRow(kb + (j * s.H + h) * D, x, D);
        for (int64_t r = 0; r < s.R; ++r) {
          const int64_t i = h * s.R + r;
          const float* qr = qt + i * D;
          float dot = 0.f;
#pragma omp simd reduction(+ : dot)
          for (int64_t d = 0; d < D; ++d) dot += qr[d] * x[d];
          p[i][j] = dot;
          block_max[i] = std::max(block_max[i], dot);
        }
      }
    }
    for (int64_t i = 0; i < HR; ++i) {  // online softmax: rescale what came before
      const float new_max = block_max[i];
      const float corr = std::exp(m[i] - new_max);
      float* pi = p[i];
      float sum = 0.f;
#pragma omp simd reduction(+ : sum)
      for (int64_t j = 0; j < n; ++j) {
        pi[j] = std::exp(pi[j] - new_max);
        sum += pi[j];
      }
      l[i] = l[i] * corr + sum;
      m[i] = new_max;
      float* ai = a + i * D;
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) ai[d] *= corr;
    }
    for (int64_t j = 0; j < n; ++j) {  // values
      for (int64_t h = 0; h < s.H; ++h) {
        WidenRow(vb + (j * s.H + h) * D, x, D);
        for (int64_t r = 0; r < s.R; ++r) {
          const int64_t i = h * s.R + r;
          const float w = p[i][j];
          float* ai = a + i * D;
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) ai[d] += w * x[d];
        }
      }
    }
  }
  std::copy(m, m + HR, mx + t * HR);
  std::copy(l, l + HR, den + t * HR);
}

// Rows are shared out through an atomic counter: the calling thread and helpers on XLA's
// intra-op pool each take the next row until none is left. A helper that starts late finds none
// and touches only this shared state, so the call never waits on a thread busy elsewhere.
struct Work {
  std::atomic<int64_t> next{0}, done{0};
  std::mutex mu;
  std::condition_variable all_done;
};

template <typename F>
void Drain(Work& w, int64_t rows, const F& row) {
  for (int64_t t; (t = w.next.fetch_add(1)) < rows;) {
    row(t);
    if (w.done.fetch_add(1) + 1 == rows) {
      std::lock_guard<std::mutex> lock(w.mu);
      w.all_done.notify_all();
    }
  }
}

template <typename KV>
void Run(ffi::ThreadPool& pool, int64_t rows, const Shape& s, const float* q, const KV* k_pool,
         const KV* v_pool, const int32_t* tables, const int32_t* seq, const int32_t* limit,
         float* mx, float* den, float* acc) {
  auto row = [=](int64_t t) { Row(t, s, q, k_pool, v_pool, tables, seq, limit, mx, den, acc); };
  auto work = std::make_shared<Work>();
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), rows - 1);
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([work, rows, row] { Drain(*work, rows, row); });
  Drain(*work, rows, row);
  std::unique_lock<std::mutex> lock(work->mu);
  work->all_done.wait(lock, [&] { return work->done.load() >= rows; });
}

ffi::Error PagedDecodeImpl(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer k_pool,
                           ffi::AnyBuffer v_pool, ffi::AnyBuffer tables, ffi::AnyBuffer seq,
                           ffi::AnyBuffer limit, ffi::Result<ffi::AnyBuffer> mx,
                           ffi::Result<ffi::AnyBuffer> den, ffi::Result<ffi::AnyBuffer> acc) {
  const auto qd = q.dimensions(), kd = k_pool.dimensions(), td = tables.dimensions();
  if (qd.size() != 4 || kd.size() != 4 || td.size() != 2) {
    return ffi::Error::InvalidArgument("paged_decode: q, pools and tables must be rank 4, 4 and 2");
  }
  const int64_t rows = qd[0];
  const Shape s{qd[1], qd[2], qd[3], kd[0], kd[1], td[1]};
  if (kd[2] != s.H || kd[3] != s.D || s.H * s.R > kMaxHeads || s.BS > kMaxBlock || s.D > kMaxDim) {
    return ffi::Error::InvalidArgument("paged_decode: unsupported shapes");
  }
  if (q.element_type() != ffi::F32 || tables.element_type() != ffi::S32 ||
      seq.element_type() != ffi::S32 || limit.element_type() != ffi::S32 ||
      v_pool.element_type() != k_pool.element_type()) {
    return ffi::Error::InvalidArgument("paged_decode: unsupported dtypes");
  }
  if (rows == 0) return ffi::Error::Success();
  const float* qp = q.typed_data<float>();
  const int32_t *tp = tables.typed_data<int32_t>(), *sp = seq.typed_data<int32_t>(),
                *lp = limit.typed_data<int32_t>();
  float *mp = mx->typed_data<float>(), *dp = den->typed_data<float>(), *ap = acc->typed_data<float>();
  if (k_pool.element_type() == ffi::F32) {
    Run(pool, rows, s, qp, k_pool.typed_data<float>(), v_pool.typed_data<float>(), tp, sp, lp, mp, dp, ap);
  } else if (k_pool.element_type() == ffi::U16) {
    Run(pool, rows, s, qp, k_pool.typed_data<uint16_t>(), v_pool.typed_data<uint16_t>(), tp, sp, lp, mp, dp, ap);
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
                                  .Ret<ffi::AnyBuffer>()  // mx
                                  .Ret<ffi::AnyBuffer>()  // den
                                  .Ret<ffi::AnyBuffer>());  // acc
