// The decode attention walk (runtime/worker/cpp/paged_decode.cc) alone, on the shape of a
// 64-sequence SmolLM2-135M decode step: 64 rows x 30 layers over an f32 pool of 60,000 blocks of 32
// tokens (2.9 GB for K and V), each row's blocks drawn at random within its layer's 2,000, so the
// K/V come from memory as in the engine. Prints the median of 5 passes and the bytes of K/V read per
// second. Build against jaxlib's FFI headers and run (rows split in halves over two threads):
//
//   g++ -O3 -march=native -ffast-math -fopenmp-simd -std=c++17 \
//       -I$(.venv/bin/python -c 'import jax.ffi; print(jax.ffi.include_dir())') \
//       runtime/worker/cpp/bench_walk.cc -o /tmp/bench_walk -lpthread
//   /tmp/bench_walk [positions per row, 96] [threads, 2] [hot blocks, 0]
//
// `hot blocks` > 0 draws every row's blocks from that many blocks instead (all in cache): the walk's
// time without waiting on memory. To compare two checkouts, build this file in each.

#include "paged_decode.cc"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <thread>
#include <vector>

int main(int argc, char** argv) {
  const int64_t ctx = argc > 1 ? std::atol(argv[1]) : 96, threads = argc > 2 ? std::atol(argv[2]) : 2,
                hot = argc > 3 ? std::atol(argv[3]) : 0;
  const int64_t H = 3, R = 3, D = 64, BS = 32, L = 30, per_layer = 2000, N = L * per_layer, S = 64;
  const int64_t blocks_per_row = (ctx + BS - 1) / BS, block_floats = BS * H * D;
  std::mt19937 rng(1);
  std::vector<float> k_pool(N * block_floats), v_pool(N * block_floats), q(S * H * R * D);
  auto value = [](uint64_t i) { return static_cast<float>((i * 2654435761u >> 12) & 1023) / 512.f - 1.f; };
  for (size_t i = 0; i < k_pool.size(); ++i) k_pool[i] = value(i), v_pool[i] = value(i + 7);
  for (size_t i = 0; i < q.size(); ++i) q[i] = 0.1f * value(i + 13);
  std::vector<int32_t> tables(L * S * blocks_per_row), seq(S), limit(S, static_cast<int32_t>(ctx));
  for (int64_t l = 0; l < L; ++l)
    for (int64_t i = 0; i < S * blocks_per_row; ++i)
      tables[l * S * blocks_per_row + i] = static_cast<int32_t>(hot > 0 ? rng() % hot : l * per_layer + rng() % per_layer);
  for (int64_t s = 0; s < S; ++s) seq[s] = static_cast<int32_t>(s);
  std::vector<float> mx(S * H * R), den(S * H * R), acc(S * H * R * D);
  const Shape shape{H, R, D, N, BS, blocks_per_row};
  // Rows [s0, s1) of every layer, each walked as one part that knows the next (as Run hands them out).
  auto walk = [&](int64_t s0, int64_t s1) {
    for (int64_t l = 0; l < L; ++l) {
      const int32_t* layer_tables = tables.data() + l * S * blocks_per_row;
      for (int64_t s = s0; s < s1; ++s) {
        Part part{s, 0, ctx, mx.data() + s * H * R, den.data() + s * H * R, acc.data() + s * H * R * D};
        Part next{s + 1, 0, ctx, nullptr, nullptr, nullptr};
        WalkPart(part, s + 1 < s1 ? &next : nullptr, shape, q.data(), k_pool.data(), v_pool.data(), layer_tables,
                 seq.data(), limit.data());
      }
    }
  };
  std::vector<double> ms;
  for (int pass = 0; pass < 5; ++pass) {
    const auto t0 = std::chrono::steady_clock::now();
    std::vector<std::thread> helpers;
    for (int64_t t = 1; t < threads; ++t) helpers.emplace_back(walk, S * t / threads, S * (t + 1) / threads);
    walk(0, S / threads);
    for (auto& h : helpers) h.join();
    ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
  }
  std::sort(ms.begin(), ms.end());
  const double bytes = 2.0 * L * S * std::min<int64_t>(ctx, blocks_per_row * BS) * H * D * sizeof(float);
  std::printf("%ld positions per row, %ld threads%s: median %.2f ms of 5 (%.2f-%.2f), %.1f GB/s of K/V\n", ctx, threads,
              hot > 0 ? " (hot blocks)" : "", ms[2], ms[0], ms[4], bytes / ms[2] / 1e6);
  return 0;
}
