// The GGUF blocks product (runtime/worker/cpp/block_matmul.cc) alone, on one thread, with weights
// that fit in cache: the kernel's own speed, without memory or thread hand-offs. Checks the vector
// path against the scalar loop, and prints the best of 200 passes in ns per block and column.
// Build for a CPU class and run:
//
//   g++ -O3 -march=x86-64-v4 -ffast-math -std=c++17 \
//       -I$(.venv/bin/python -c 'import jax.ffi; print(jax.ffi.include_dir())') \
//       runtime/worker/cpp/bench_blocks.cc runtime/worker/cpp/tile_matmul.cc -o /tmp/bench_blocks
//   /tmp/bench_blocks [rows, 1] [columns, 1536] [format: 2 Q4_0, 3 Q4_1, 8 Q8_0; 3]
//
// To compare two checkouts, build this file in each.

#include "block_matmul.cc"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

int main(int argc, char** argv) {
  const int64_t M = argc > 1 ? std::atol(argv[1]) : 1, K = 576, N = argc > 2 ? std::atol(argv[2]) : 1536;
  const int format = argc > 3 ? std::atoi(argv[3]) : kQ4_1;
  const int64_t nb = K / kBlock, B = BlockBytes(format);
  if (B == 0) return std::fprintf(stderr, "format must be 2, 3 or 8\n"), 1;
  std::mt19937 rng(1);
  std::vector<uint8_t> w(N * nb * B);
  for (auto& b : w) b = rng() & 0xff;
  for (int64_t i = 0; i < N * nb; ++i) {  // scales about 2^-7, Q4_1 minima about -2^-7
    uint16_t h = 0x2000 + (rng() & 0x3ff);
    std::memcpy(&w[i * B], &h, 2);
    h = 0xa000 + (rng() & 0x3ff);
    if (format == kQ4_1) std::memcpy(&w[i * B + 2], &h, 2);
  }
  std::vector<float> x(M * K), y(M * N), want(M * N);
  for (auto& v : x) v = static_cast<float>(rng() % 2001) / 1000.0f - 1.0f;
  const Args a{x.data(), w.data(), y.data(), M, K, N, nb}, ref{x.data(), w.data(), want.data(), M, K, N, nb};
  auto run = [&](const Args& args, bool vector) {
    switch (format) {
#if defined(JAXSERVE_BLOCKS_VECTOR)
      case kQ4_0: return vector ? VectorRows<kQ4_0>(args, 0, N) : ScalarColumns<kQ4_0>(args, 0, N);
      case kQ4_1: return vector ? VectorRows<kQ4_1>(args, 0, N) : ScalarColumns<kQ4_1>(args, 0, N);
      default: return vector ? VectorRows<kQ8_0>(args, 0, N) : ScalarColumns<kQ8_0>(args, 0, N);
#else
      case kQ4_0: return ScalarColumns<kQ4_0>(args, 0, N);
      case kQ4_1: return ScalarColumns<kQ4_1>(args, 0, N);
      default: return ScalarColumns<kQ8_0>(args, 0, N);
#endif
    }
  };
  run(ref, false);
  double best = 1e9;
  for (int pass = 0; pass < 200; ++pass) {
    const auto t0 = std::chrono::steady_clock::now();
    run(a, true);
    best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  double err = 0, scale = 0;
  for (int64_t i = 0; i < M * N; ++i) {
    err = std::max(err, static_cast<double>(std::fabs(y[i] - want[i])));
    scale = std::max(scale, static_cast<double>(std::fabs(want[i])));
  }
  std::printf("format %d, %ld x %ld x %ld: %.1f us, %.2f ns per block and column, %.2f GB/s of blocks; "
              "largest difference from the scalar loop %.1e (outputs up to %.1e)\n",
              format, static_cast<long>(M), static_cast<long>(K), static_cast<long>(N), best * 1e6,
              best * 1e9 / static_cast<double>(N * nb), static_cast<double>(N * nb * B) / best / 1e9, err, scale);
  return err <= 1e-5 * std::max(1.0, scale) ? 0 : 1;
}
