// ParallelFor for the kernels in this folder: the calling thread and helper threads of our own
// share a call's items through an atomic counter.
//
// Why threads of our own, and not XLA's intra-op pool: a batch-1 decode step makes about 150
// kernel calls of 10-60 us each. Each call that scheduled a task on XLA's pool woke a parked
// thread (a futex call; in a VM, an interrupt to the other core), and the caller was often not one
// of the pool's threads, so three threads shared two cores. Our helpers instead poll for work for
// 300 us (SpinAfterWork) after each call, as llama.cpp's threads do between a graph's ops: within
// a step, every call finds them awake. Idle longer, they sleep, and the next call wakes them. With the
// tiles' integer products, batch-1 steps ran 1.10x (x86-64-v4) and 1.21x (x86-64-v3) faster than
// with tasks on XLA's pool, alternated in one window (docs/benchmarks/, "Hot helpers"); a poll of
// 50 us instead of 300 let the helpers fall asleep within a step, and lost that.
//
// A call hands its job to each helper through the helper's mailbox (one word: empty, a job, or a
// job taken). When the caller has run out of items it takes back every job no helper has taken
// yet, and waits only for the helpers that took one, which are then working on their last items:
// a helper that is asleep, or descheduled, never holds a call up. One call at a time has the
// helpers; a call that finds them busy (XLA running two kernels at once) runs its items alone.

#pragma once

#include <pthread.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "xla/ffi/api/ffi.h"

namespace jaxserve {

// How long a helper polls for the next call after its last one, before it sleeps: 300 us unless
// the loader set JAXSERVE_CPU_POLL_US (runtime/worker/cpp_kernels.py checks it and calls
// JaxserveSetHelperPollUs before any kernel runs; helpers read it when they start).
inline std::atomic<int64_t>& SpinAfterWorkUs() {
  static std::atomic<int64_t> us{300};
  return us;
}

inline std::chrono::microseconds SpinAfterWork() { return std::chrono::microseconds(SpinAfterWorkUs().load()); }

inline void Pause() {
#if defined(__x86_64__)
  _mm_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

// One call's items, on the caller's stack while the call runs.
struct Job {
  std::atomic<int64_t> next{0};
  int64_t items = 0;
  void (*run)(const void* item, int64_t t) = nullptr;
  const void* item = nullptr;

  void Drain() {
    for (int64_t t; (t = next.fetch_add(1)) < items;) run(item, t);
  }
};

class Helpers {
 public:
  // The process's helpers: `count` threads, started on first use (and again in a forked child,
  // which has none of its parent's threads).
  static Helpers& Get(int64_t count) {
    static std::mutex mu;
    static const bool registered = [] {
      pthread_atfork(nullptr, nullptr, [] { current().store(nullptr); });
      return true;
    }();
    (void)registered;
    Helpers* h = current().load(std::memory_order_acquire);
    if (h != nullptr) return *h;
    std::lock_guard<std::mutex> lock(mu);
    h = current().load();
    if (h == nullptr) {
      h = new Helpers(std::max<int64_t>(0, count));  // never freed: its threads poll it until exit
      current().store(h, std::memory_order_release);
    }
    return *h;
  }

  int64_t size() const { return static_cast<int64_t>(boxes_.size()); }

  // item(t) for t in [0, items), on this thread and up to items - 1 helpers.
  template <typename F>
  void Run(int64_t items, const F& item) {
    const int64_t helpers = std::min<int64_t>(size(), items - 1);
    bool expected = false;
    if (helpers <= 0 || !busy_.compare_exchange_strong(expected, true)) {
      for (int64_t t = 0; t < items; ++t) item(t);
      return;
    }
    Job job;
    job.items = items;
    job.run = [](const void* f, int64_t t) { (*static_cast<const F*>(f))(t); };
    job.item = &item;
    const auto posted = reinterpret_cast<uintptr_t>(&job);
    for (int64_t i = 0; i < helpers; ++i) boxes_[i]->Post(posted);
    job.Drain();
    for (int64_t i = 0; i < helpers; ++i) boxes_[i]->TakeBack(posted);
    busy_.store(false, std::memory_order_release);
  }

 private:
  // A helper's mailbox: 0, a posted Job's address, or that address | 1 once the helper took it.
  struct alignas(64) Box {
    std::atomic<uintptr_t> job{0};
    std::atomic<bool> sleeping{false}, woken{false};
    std::mutex mu;
    std::condition_variable cv;

    void Post(uintptr_t posted) {
      job.store(posted);  // sequentially consistent, as the helper's store to `sleeping`
      if (sleeping.load()) {
        std::lock_guard<std::mutex> lock(mu);
        woken.store(true);
        cv.notify_one();
      }
    }

    // The job back if the helper has not taken it, else wait until it is done with it.
    void TakeBack(uintptr_t posted) {
      uintptr_t expected = posted;
      if (job.compare_exchange_strong(expected, 0)) return;
      for (int spins = 0; job.load(std::memory_order_acquire) != 0; ++spins) {
        if (spins < 4096) {
          Pause();
        } else {
          std::this_thread::yield();  // the helper may share this core
        }
      }
    }
  };

  static std::atomic<Helpers*>& current() {
    static std::atomic<Helpers*> h{nullptr};
    return h;
  }

  explicit Helpers(int64_t count) {
    const auto spin = SpinAfterWork();
    for (int64_t i = 0; i < count; ++i) boxes_.push_back(std::make_unique<Box>());
    for (int64_t i = 0; i < count; ++i) {
      std::thread([box = boxes_[i].get(), spin] { Serve(*box, spin); }).detach();
    }
  }

  static void Serve(Box& box, std::chrono::microseconds spin) {
    auto until = std::chrono::steady_clock::now() + spin;
    for (int spins = 1;; ++spins) {
      uintptr_t posted = box.job.load(std::memory_order_acquire);
      if (posted != 0 && !(posted & 1) && box.job.compare_exchange_strong(posted, posted | 1)) {
        reinterpret_cast<Job*>(posted)->Drain();
        box.job.store(0, std::memory_order_release);
        until = std::chrono::steady_clock::now() + spin;
        continue;
      }
      Pause();
      if (spins % 64 != 0) continue;
      if (std::chrono::steady_clock::now() < until) {
        if (spins % 1024 == 0) std::this_thread::yield();  // a thread that needs this core gets it
        continue;
      }
      // Asleep until a call posts a job. Woken, poll again for `spin` even if the caller
      // took its job back meanwhile: more calls follow within a step.
      std::unique_lock<std::mutex> lock(box.mu);
      box.sleeping.store(true);
      box.cv.wait(lock, [&] { return box.job.load() != 0 || box.woken.load(); });
      box.sleeping.store(false);
      box.woken.store(false);
      until = std::chrono::steady_clock::now() + spin;
    }
  }

  std::vector<std::unique_ptr<Box>> boxes_;
  std::atomic<bool> busy_{false};
};

// The threads that work on a call: this one and the helpers, as many in all as XLA's intra-op
// pool has threads (one per core by default).
inline int64_t Workers(xla::ffi::ThreadPool& pool) {
  return Helpers::Get(pool.num_threads() - 1).size() + 1;
}

// item(t) for t in [0, items), on this thread and up to items - 1 helpers; returns when all are
// done.
template <typename F>
void ParallelFor(xla::ffi::ThreadPool& pool, int64_t items, const F& item) {
  Helpers::Get(pool.num_threads() - 1).Run(items, item);
}

}  // namespace jaxserve
