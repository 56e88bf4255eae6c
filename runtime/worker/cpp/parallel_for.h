// ParallelFor over XLA's intra-op thread pool, for the kernels in this folder.
//
// Items are shared out through an atomic counter: the calling thread and helpers on the pool each
// take the next item until none is left. A helper that starts late finds none and touches only
// the shared counter state, so the call never waits on a thread busy elsewhere.

#pragma once

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>

#include "xla/ffi/api/ffi.h"

namespace jaxserve {

struct WorkCounter {
  std::atomic<int64_t> next{0}, done{0};
  std::mutex mu;
  std::condition_variable all_done;
};

template <typename F>
void DrainItems(WorkCounter& w, int64_t items, const F& item) {
  for (int64_t t; (t = w.next.fetch_add(1)) < items;) {
    item(t);
    if (w.done.fetch_add(1) + 1 == items) {
      std::lock_guard<std::mutex> lock(w.mu);
      w.all_done.notify_all();
    }
  }
}

// item(t) for t in [0, items), on this thread and up to items - 1 of the pool's; returns when all
// are done. `item` is copied into each helper's task.
template <typename F>
void ParallelFor(xla::ffi::ThreadPool& pool, int64_t items, const F& item) {
  auto work = std::make_shared<WorkCounter>();
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), items - 1);
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([work, items, item] { DrainItems(*work, items, item); });
  DrainItems(*work, items, item);
  std::unique_lock<std::mutex> lock(work->mu);
  work->all_done.wait(lock, [&] { return work->done.load() >= items; });
}

}  // namespace jaxserve
