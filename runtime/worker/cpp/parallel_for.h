// ParallelFor over XLA's intra-op thread pool, for the kernels in this folder.
//
// Items are shared out through an atomic counter: the calling thread and helpers on the pool each
// take the next item until none is left. A helper that starts late finds none and touches only
// the shared counter state, so the call never waits on a thread busy elsewhere.
//
// When the calling thread runs out of items while a helper still works on its last one, it spins
// for a while before it sleeps: the call returns as soon as the helper is done, instead of a
// futex wake-up later, and the helper skips the wake-up call when nobody sleeps.
//
// XLA runs most kernel calls on one of the pool's own threads, which then has num_threads() - 1
// others to help it, not num_threads(): Workers() tells the two apart (a thread of the pool is
// one that has run a helper task), so that a call neither shares its work out for a thread that
// is not there nor schedules a helper task that only finds the work done.

#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "xla/ffi/api/ffi.h"

namespace jaxserve {

// How long the calling thread spins for its helpers before it sleeps.
constexpr std::chrono::microseconds kSpinBeforeSleep{200};

struct WorkCounter {
  std::atomic<int64_t> next{0}, done{0};
  std::atomic<bool> sleeping{false};
  std::mutex mu;
  std::condition_variable all_done;
};

// Set on the pool's threads by the helper tasks they run.
inline thread_local bool tls_pool_thread = false;

// The threads that can work on a call from this thread: the pool's, plus this one if it is not
// one of them.
inline int64_t Workers(xla::ffi::ThreadPool& pool) {
  return std::max<int64_t>(1, pool.num_threads() + (tls_pool_thread ? 0 : 1));
}

template <typename F>
void DrainItems(WorkCounter& w, int64_t items, const F& item) {
  for (int64_t t; (t = w.next.fetch_add(1)) < items;) {
    item(t);
    // Sequentially consistent, as is the caller's store to `sleeping` before it reads `done`: one
    // of the two sees the other's write, so the last item never goes unannounced to a sleeper.
    if (w.done.fetch_add(1) + 1 == items && w.sleeping.load()) {
      std::lock_guard<std::mutex> lock(w.mu);
      w.all_done.notify_all();
    }
  }
}

inline void Pause() {
#if defined(__x86_64__)
  _mm_pause();
#endif
}

// item(t) for t in [0, items), on this thread and up to items - 1 of the pool's; returns when all
// are done. `item` is copied into each helper's task.
template <typename F>
void ParallelFor(xla::ffi::ThreadPool& pool, int64_t items, const F& item) {
  auto work = std::make_shared<WorkCounter>();
  const int64_t helpers = std::min<int64_t>(Workers(pool) - 1, items - 1);
  for (int64_t i = 0; i < helpers; ++i) {
    pool.Schedule([work, items, item] {
      tls_pool_thread = true;
      DrainItems(*work, items, item);
    });
  }
  DrainItems(*work, items, item);
  if (work->done.load() >= items) return;
  const auto until = std::chrono::steady_clock::now() + kSpinBeforeSleep;
  for (int spins = 0; work->done.load() < items; ++spins) {
    Pause();
    if (spins % 64 == 63 && std::chrono::steady_clock::now() > until) break;
  }
  if (work->done.load() >= items) return;
  work->sleeping.store(true);
  std::unique_lock<std::mutex> lock(work->mu);
  work->all_done.wait(lock, [&] { return work->done.load() >= items; });
}

}  // namespace jaxserve
