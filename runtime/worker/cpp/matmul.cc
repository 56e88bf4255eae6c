// Products of a few rows with a weight matrix, for decode steps on XLA:CPU, called through XLA's
// FFI (runtime/worker/cpp_kernels.py):
//   W8A8         x s8  [M, K] @ w s8  [K, N] -> y s32 [M, N]   (exact int32 sums)
//   weight-only  x f32 [M, K] @ w s8  [K, N] -> y f32 [M, N]   (w widened to f32 in registers)
//   f32          x f32 [M, K] @ w f32 [K, N] -> y f32 [M, N]
// The int8 products' per-column scales are applied by the caller (ir/int8.py). w may also be a
// stack [L, K, N] of every layer's weight, with the layer to take given by a third operand, an
// int32 scalar: a step scanned over layers calls the kernel on the stack where it lies, where a
// slice of it would be a copy of the layer's weights on every step (docs/benchmarks/, "Scan over
// layers"). That is what the f32 product is for: XLA's own one-row f32 product streams the weights
// about as fast, but only from a [K, N] buffer of their own.
//
// A decode step of a few rows reads every weight once and does little else, so its speed is the
// speed at which the weights stream in from memory. XLA:CPU's int8 dot reaches about a third of
// the machine's bandwidth there, and its weight-only product runs 1.5-10x slower than this one up
// to 64 rows (docs/benchmarks/, "W8A8 decode rows in our C++ kernel", "Weight-only int8 decode rows
// in our C++ kernel"). These kernels walk the weight matrix [K, N] row by row, over wide column
// chunks (or, where N is narrow, over shares of K), so that each thread reads long runs, and they
// ask for the next pass's weight rows while computing this one's; the accumulators of a chunk stay
// in L1/L2. The int8 sums are exact, so W8A8 equals XLA's dot bit for bit; the f32 sums run in k
// order per column.
//
// The vector paths need AVX-512BW (VNNI when the CPU has it); elsewhere a scalar loop gives the
// same numbers, and cpp_kernels.matmul_vectorized() tells the engine to keep XLA's products.

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#if defined(__AVX512BW__)
#include <immintrin.h>
#endif

#include "parallel_for.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// Columns per work item, at most: one item's accumulators (4 rows x 2048 x 4 bytes) fit in L2,
// and its weight rows are runs of up to 2 KiB. Narrower products are split evenly over the threads.
constexpr int64_t kChunk = 2048;
constexpr int kRowGroup = 4;         // rows sharing one pass over the weights
constexpr int64_t kMinShareRows = 256;  // K rows per share, at least, when K is split

// A share of the product: y[m, n] (+)= sum over its K rows of x[m, k] w[k, n], with the rows'
// strides; a split over K gives each share its own slice of x's columns and w's rows.
template <typename X, typename W, typename Y>
struct Part {
  const X* x;
  int64_t ldx;
  const W* w;  // row stride N
  int64_t K;
  Y* y;  // row stride N
};
using IntPart = Part<int8_t, int8_t, int32_t>;  // W8A8
template <typename W>
using FloatPart = Part<float, W, float>;  // weight-only (W = int8_t) and f32 (W = float)

#if defined(__AVX512BW__)
inline __m512i Dot(__m512i acc, __m512i w, __m512i x) {
#if defined(__AVX512VNNI__)
  return _mm512_dpwssd_epi32(acc, w, x);
#else
  return _mm512_add_epi32(acc, _mm512_madd_epi16(w, x));
#endif
}

// The cache line at p in each of the next `rows` weight rows (stride N): the rows the next pass
// reads, requested while this pass computes, since the hardware prefetcher may not follow these
// short strided runs. One run measured a decode step's products 1.3-1.5x faster with it, a later
// one within noise either way (docs/benchmarks/, "Weight-only int8 decode rows in our C++ kernel").
template <typename W>
inline void Prefetch(const W* p, int64_t N, int rows) {
  for (int i = 0; i < rows; ++i) _mm_prefetch(reinterpret_cast<const char*>(p + i * N), _MM_HINT_T0);
}

// x[m, k] and x[m, k + 1] as an int16 pair in every 32-bit lane.
inline __m512i PairOf(int8_t a, int8_t b) {
  const uint32_t lo = static_cast<uint16_t>(static_cast<int16_t>(a));
  const uint32_t hi = static_cast<uint16_t>(static_cast<int16_t>(b));
  return _mm512_set1_epi32(static_cast<int32_t>(lo | (hi << 16)));
}

inline __m512i Widen32(const int8_t* p) {  // 32 int8 -> 32 int16
  return _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// Rows [m0, m0 + MR) times columns [n0, n0 + 64 * tiles), two weight rows at a time: their int16
// values interleaved, (w[k, n], w[k+1, n]) per 32-bit lane, meet the row's pair in one
// multiply-add. The interleave works within 128-bit lanes, so the accumulators hold columns in a
// fixed permuted order that the store undoes.
template <int MR>
void VectorChunk(const IntPart& p, int64_t N, int64_t m0, int64_t n0, int64_t tiles) {
  alignas(64) int32_t acc[MR][kChunk];
  for (int m = 0; m < MR; ++m) std::memset(acc[m], 0, sizeof(int32_t) * 64 * tiles);
  for (int64_t k = 0; k < p.K; k += 2) {
    const bool pair = k + 1 < p.K;
    const int8_t* w0 = p.w + k * N + n0;
    const int8_t* w1 = w0 + N;
    __m512i xp[MR];
    for (int m = 0; m < MR; ++m) {
      const int8_t* xr = p.x + (m0 + m) * p.ldx;
      xp[m] = PairOf(xr[k], pair ? xr[k + 1] : 0);
    }
    for (int64_t j = 0; j < 64 * tiles; j += 32) {
      if (k + 4 <= p.K) Prefetch(w0 + 2 * N + j, N, 2);
      const __m512i a = Widen32(w0 + j);
      const __m512i b = pair ? Widen32(w1 + j) : _mm512_setzero_si512();
      const __m512i lo = _mm512_unpacklo_epi16(a, b), hi = _mm512_unpackhi_epi16(a, b);
      for (int m = 0; m < MR; ++m) {
        __m512i* am = reinterpret_cast<__m512i*>(acc[m] + j);
        am[0] = Dot(am[0], lo, xp[m]);
        am[1] = Dot(am[1], hi, xp[m]);
      }
    }
  }
  // unpacklo gave columns 8L+0..3 of each 128-bit lane L, unpackhi columns 8L+4..7.
  const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i second = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  for (int m = 0; m < MR; ++m) {
    int32_t* out = p.y + (m0 + m) * N + n0;
    for (int64_t j = 0; j < 64 * tiles; j += 32) {
      const __m512i lo = _mm512_load_si512(acc[m] + j), hi = _mm512_load_si512(acc[m] + j + 16);
      _mm512_storeu_si512(out + j, _mm512_permutex2var_epi32(lo, first, hi));
      _mm512_storeu_si512(out + j + 16, _mm512_permutex2var_epi32(lo, second, hi));
    }
  }
}

inline __m512 Load16(const int8_t* p) {  // 16 int8 -> 16 f32
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}

inline __m512 Load16(const float* p) { return _mm512_loadu_ps(p); }

// f32 rows (weight-only int8 or f32 weights): rows [m0, m0 + MR) times columns [n0, n0 + 64 * tiles),
// accumulated in y itself, four weight rows per pass over a row's accumulators (one load and store
// of each for four FMAs). The next pass's rows are requested a cache line at a time.
template <int MR, typename W>
void VectorChunk(const FloatPart<W>& p, int64_t N, int64_t m0, int64_t n0, int64_t tiles) {
  const int64_t width = 64 * tiles;
  float* out[MR];
  for (int m = 0; m < MR; ++m) {
    out[m] = p.y + (m0 + m) * N + n0;
    std::memset(out[m], 0, sizeof(float) * width);
  }
  const float* x[MR];
  for (int m = 0; m < MR; ++m) x[m] = p.x + (m0 + m) * p.ldx;
  int64_t k = 0;
  for (; k + 4 <= p.K; k += 4) {
    const W* w0 = p.w + k * N + n0;
    __m512 xb[MR][4];
    for (int m = 0; m < MR; ++m)
      for (int i = 0; i < 4; ++i) xb[m][i] = _mm512_set1_ps(x[m][k + i]);
    for (int64_t j = 0; j < width; j += 16) {
      if ((j * static_cast<int64_t>(sizeof(W))) % 64 == 0 && k + 8 <= p.K) Prefetch(w0 + 4 * N + j, N, 4);
      const __m512 a0 = Load16(w0 + j), a1 = Load16(w0 + N + j);
      const __m512 a2 = Load16(w0 + 2 * N + j), a3 = Load16(w0 + 3 * N + j);
      for (int m = 0; m < MR; ++m) {
        __m512 s = _mm512_loadu_ps(out[m] + j);
        s = _mm512_fmadd_ps(a0, xb[m][0], s);
        s = _mm512_fmadd_ps(a1, xb[m][1], s);
        s = _mm512_fmadd_ps(a2, xb[m][2], s);
        s = _mm512_fmadd_ps(a3, xb[m][3], s);
        _mm512_storeu_ps(out[m] + j, s);
      }
    }
  }
  for (; k < p.K; ++k) {
    const W* wk = p.w + k * N + n0;
    for (int m = 0; m < MR; ++m) {
      const __m512 xv = _mm512_set1_ps(x[m][k]);
      for (int64_t j = 0; j < width; j += 16)
        _mm512_storeu_ps(out[m] + j, _mm512_fmadd_ps(Load16(wk + j), xv, _mm512_loadu_ps(out[m] + j)));
    }
  }
}
#endif

template <typename X, typename W, typename Y>
void ScalarColumns(const Part<X, W, Y>& p, int64_t M, int64_t N, int64_t n0, int64_t n1) {
  for (int64_t m = 0; m < M; ++m) {
    Y* out = p.y + m * N;
    std::fill(out + n0, out + n1, Y(0));
    for (int64_t k = 0; k < p.K; ++k) {
      const Y xv = p.x[m * p.ldx + k];
      const W* wk = p.w + k * N;
      for (int64_t n = n0; n < n1; ++n) out[n] += xv * static_cast<Y>(wk[n]);
    }
  }
}

// Columns [n0, n1) of a share, for every row.
template <typename X, typename W, typename Y>
void Columns(const Part<X, W, Y>& p, int64_t M, int64_t N, int64_t n0, int64_t n1) {
  int64_t vector_end = n0;
#if defined(__AVX512BW__)
  const int64_t tiles = (n1 - n0) / 64;
  if (tiles > 0) {
    int64_t m = 0;
    for (; m + kRowGroup <= M; m += kRowGroup) VectorChunk<kRowGroup>(p, N, m, n0, tiles);
    switch (M - m) {
      case 3: VectorChunk<3>(p, N, m, n0, tiles); break;
      case 2: VectorChunk<2>(p, N, m, n0, tiles); break;
      case 1: VectorChunk<1>(p, N, m, n0, tiles); break;
      default: break;
    }
    vector_end = n0 + 64 * tiles;
  }
#endif
  if (vector_end < n1) ScalarColumns(p, M, N, vector_end, n1);
}

// y = x @ w over the calling thread and the kernels' helper threads (parallel_for.h). Wide int8
// products: chunks of columns, each walking all of K. Narrow ones (one chunk's worth, the down
// projection's N = hidden size) and every f32 one: shares of K, each thread streaming its own contiguous rows of w, their partial
// sums added at the end. An f32 weight row is 4x an int8 one, so whole rows are long runs already;
// column chunks of f32 rows streamed at 15.5 GB/s where XLA's one-row product did 20.3, shares of K
// at 18.8 (docs/benchmarks/, "f32 decode rows in our C++ kernel").
template <typename X, typename W, typename Y>
void Product(ffi::ThreadPool& pool, const X* xp, const W* wp, Y* yp, int64_t M, int64_t K, int64_t N) {
  const int64_t threads = pool.num_threads() + 1;
  const int64_t k_shares = N <= kChunk || sizeof(W) == 4 ? std::clamp<int64_t>(K / kMinShareRows, 1, threads) : 1;
  const int64_t chunk = std::min<int64_t>(kChunk, ((N + threads - 1) / threads + 63) / 64 * 64);
  const int64_t items = k_shares > 1 ? k_shares : (N + chunk - 1) / chunk;
  std::vector<Y> partial((k_shares - 1) * M * N);
  auto item = [=, &partial](int64_t t) {
    if (k_shares == 1) {
      return Columns(Part<X, W, Y>{xp, K, wp, K, yp}, M, N, t * chunk, std::min(N, (t + 1) * chunk));
    }
    // Even share bounds: the W8A8 path takes weight rows in pairs.
    const int64_t k0 = K * t / k_shares / 2 * 2, k1 = t + 1 == k_shares ? K : K * (t + 1) / k_shares / 2 * 2;
    Y* out = t == 0 ? yp : partial.data() + (t - 1) * M * N;
    Columns(Part<X, W, Y>{xp + k0, K, wp + k0 * N, k1 - k0, out}, M, N, 0, N);
  };
  jaxserve::ParallelFor(pool, items, item);
  for (int64_t t = 1; t < k_shares; ++t) {
    const Y* part = partial.data() + (t - 1) * M * N;
    for (int64_t i = 0; i < M * N; ++i) yp[i] += part[i];
  }
}

// x [M, K] @ w [K, N] (or layer `layer` of w [L, K, N]) -> y [M, N], with x, w and y of the given
// element types; on success, *offset is where the layer's weights start in w.
ffi::Error Check(const char* name, ffi::AnyBuffer& x, ffi::AnyBuffer& w, ffi::AnyBuffer& layer,
                 ffi::Result<ffi::AnyBuffer>& y, ffi::DataType xt, ffi::DataType wt, ffi::DataType yt,
                 int64_t* offset) {
  const auto xd = x.dimensions(), wd = w.dimensions(), yd = y->dimensions();
  const size_t r = wd.size();
  if (xd.size() != 2 || (r != 2 && r != 3) || yd.size() != 2 || xd[1] != wd[r - 2] || yd[0] != xd[0] ||
      yd[1] != wd[r - 1] || layer.element_count() != 1) {
    return ffi::Error::InvalidArgument(std::string(name) +
                                       ": x [M, K] @ w [K, N] or [L, K, N], layer [] -> y [M, N]");
  }
  if (x.element_type() != xt || w.element_type() != wt || y->element_type() != yt ||
      layer.element_type() != ffi::S32) {
    return ffi::Error::InvalidArgument(std::string(name) + ": wrong element types (see matmul.cc)");
  }
  const int64_t l = *static_cast<const int32_t*>(layer.untyped_data()), layers = r == 3 ? wd[0] : 1;
  if (l < 0 || l >= layers) {
    return ffi::Error::InvalidArgument(std::string(name) + ": layer " + std::to_string(l) + " of " +
                                       std::to_string(layers));
  }
  *offset = l * wd[r - 2] * wd[r - 1];
  return ffi::Error::Success();
}

template <typename X, typename W, typename Y>
ffi::Error Run(const char* name, ffi::DataType xt, ffi::DataType wt, ffi::DataType yt, ffi::ThreadPool& pool,
               ffi::AnyBuffer& x, ffi::AnyBuffer& w, ffi::AnyBuffer& layer, ffi::Result<ffi::AnyBuffer>& y) {
  int64_t offset = 0;
  ffi::Error error = Check(name, x, w, layer, y, xt, wt, yt, &offset);
  if (error.failure()) return error;
  const int64_t M = x.dimensions()[0], K = x.dimensions()[1], N = y->dimensions()[1];
  if (M > 0 && N > 0) {
    Product(pool, static_cast<const X*>(x.untyped_data()), static_cast<const W*>(w.untyped_data()) + offset,
            static_cast<Y*>(y->untyped_data()), M, K, N);
  }
  return ffi::Error::Success();
}

ffi::Error Int8MatmulImpl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::AnyBuffer layer,
                          ffi::Result<ffi::AnyBuffer> y) {
  return Run<int8_t, int8_t, int32_t>("int8_matmul", ffi::S8, ffi::S8, ffi::S32, pool, x, w, layer, y);
}

ffi::Error Int8WeightMatmulImpl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::AnyBuffer layer,
                                ffi::Result<ffi::AnyBuffer> y) {
  return Run<float, int8_t, float>("int8_weight_matmul", ffi::F32, ffi::S8, ffi::F32, pool, x, w, layer, y);
}

ffi::Error F32MatmulImpl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::AnyBuffer layer,
                         ffi::Result<ffi::AnyBuffer> y) {
  return Run<float, float, float>("f32_matmul", ffi::F32, ffi::F32, ffi::F32, pool, x, w, layer, y);
}

// Every product's FFI signature: x [M, K], w [K, N] or [L, K, N], layer s32 [] -> y [M, N], with
// the element types Run checks (s8/s8 -> s32, f32/s8 -> f32, f32/f32 -> f32).
auto MatmulBinding() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::ThreadPool>()
      .Arg<ffi::AnyBuffer>()   // x
      .Arg<ffi::AnyBuffer>()   // w
      .Arg<ffi::AnyBuffer>()   // layer
      .Ret<ffi::AnyBuffer>();  // y
}

}  // namespace

// 1 where this build has the vector paths (the engine routes decode rows here only then).
extern "C" int JaxserveMatmulVectorized() {
#if defined(__AVX512BW__)
  return 1;
#else
  return 0;
#endif
}

// How long the helpers of this library poll after each call (parallel_for.h): set by the loader
// before any kernel runs, and read back by `jaxserve env`.
extern "C" void JaxserveSetHelperPollUs(int64_t us) { jaxserve::SpinAfterWorkUs().store(us); }
extern "C" int64_t JaxserveHelperPollUs() { return jaxserve::SpinAfterWork().count(); }

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveInt8Matmul, Int8MatmulImpl, MatmulBinding());
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveInt8WeightMatmul, Int8WeightMatmulImpl, MatmulBinding());
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveF32Matmul, F32MatmulImpl, MatmulBinding());
