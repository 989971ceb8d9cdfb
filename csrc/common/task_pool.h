// TaskPool: the small thread pool of the CPU kernels (top-k, the panel linears, paged attention),
// one for the whole extension.
//
// Why not at::parallel_for: it is serial in this extension (setup.py builds without -fopenmp, so
// ATen's inline OpenMP backend is a plain call), and an OpenMP region is a static split then a
// join of every thread. Here the caller starts on the tasks at once and waits only for tasks a
// helper has actually claimed: a helper that wakes late (PASSIVE wait policy, or a core busy with
// another process on these shared machines) finds the work done and costs nothing. One caller at a
// time: a second concurrent caller, or a forked child (no helpers), runs its tasks alone.
//
// Waiting: a helper that has just run tasks polls for the next call for up to 200 us
// (set_poll_us, from freetoken.ops.configure(pool_poll_us=...); less while calls come far apart,
// see helper()) before it sleeps
// on the condition variable, and the caller polls for the helpers' last tasks as long before it
// sleeps. A forward is a chain of calls ~20-200 us apart; a futex wake-up costs ~10-40 us here,
// which made a 2-thread 1536 x 576 linear at 8 rows 123 us against 141 us on one thread. The
// poll is bounded (and yields the core with pause), unlike OpenMP's ACTIVE spin.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>

namespace freetoken {

class TaskPool {
 public:
  static TaskPool& get() {
    static TaskPool* pool = new TaskPool();  // never destroyed: helpers are detached
    return *pool;
  }

  // How long helpers and the caller poll before they sleep (default 200 us; 0: sleep at once).
  static void set_poll_us(int64_t us) {
    poll_ns_setting().store(std::max<int64_t>(0, us) * 1000, std::memory_order_relaxed);
  }

  // fn(0) .. fn(n - 1), on the caller and up to nthreads - 1 helpers.
  void run(int64_t n, int nthreads, const std::function<void(int64_t)>& fn) {
    std::unique_lock<std::mutex> caller(run_mu_, std::try_to_lock);
    if (!caller.owns_lock() || nthreads <= 1 || n <= 1) {
      for (int64_t t = 0; t < n; ++t) fn(t);
      return;
    }
    std::unique_lock<std::mutex> lk(mu_);
    // NOTE: a new helper is handed the generation before this call's, not left to read gen_
    // when it starts: it starts after the call is published, and took it for one already seen,
    // so a process's first call ran on the caller alone (int8_peak_gops' first 2-thread reading:
    // one thread's rate, 828 against 1613 GOP/s).
    while (static_cast<int>(helpers_) < nthreads - 1) {
      std::thread(&TaskPool::helper, this, gen_.load()).detach();
      ++helpers_;
    }
    fn_ = &fn;
    n_ = n;
    next_ = 0;
    joined_ = 0;
    max_join_ = nthreads - 1;
    gen_.fetch_add(1, std::memory_order_release);
    const bool wake = sleepers_ > 0;
    lk.unlock();
    if (wake) cv_work_.notify_all();
    lk.lock();
    drain(lk);
    if (busy_.load() != 0) {
      lk.unlock();
      poll([&] { return busy_.load(std::memory_order_acquire) == 0; });
      lk.lock();
      cv_done_.wait(lk, [&] { return busy_.load() == 0; });
    }
    fn_ = nullptr;
    n_ = 0;
  }

 private:
  void drain(std::unique_lock<std::mutex>& lk) {
    while (next_ < n_) {
      const int64_t t = next_++;
      ++busy_;
      const auto* fn = fn_;
      lk.unlock();
      try {
        (*fn)(t);
      } catch (...) {  // tasks report through their results; never let one kill a thread
      }
      lk.lock();
      if (--busy_ == 0 && next_ >= n_) cv_done_.notify_all();
    }
  }

  static std::atomic<int64_t>& poll_ns_setting() {
    static std::atomic<int64_t> ns{200000};
    return ns;
  }
  static int64_t poll_ns() { return poll_ns_setting().load(std::memory_order_relaxed); }

  // Polls until done() or `ns` have passed.
  template <typename Done>
  static void poll(const Done& done, int64_t ns = poll_ns()) {
    const auto until = std::chrono::steady_clock::now() + std::chrono::nanoseconds(ns);
    while (!done()) {
      for (int i = 0; i < 64; ++i) pause();
      if (std::chrono::steady_clock::now() > until) return;
    }
  }

  static void pause() {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
  }

  // NOTE: a helper's poll steals a core from whatever runs between two calls. When the calls come
  // far apart (a bf16 step: oneDNN's OpenMP threads run the linears, only attention is here) the
  // poll only hurts, so its budget halves after every gap longer than poll_ns() and is whole
  // again after a gap within it: bf16 classify 8 x 28 forward ran 183-187 ms without the poll,
  // 202 ms with a fixed one.
  void helper(uint64_t seen) {
    int64_t budget = poll_ns();
    while (true) {
      const auto idle_from = std::chrono::steady_clock::now();
      poll([&] { return gen_.load(std::memory_order_acquire) != seen; }, budget);
      std::unique_lock<std::mutex> lk(mu_);
      if (gen_.load() == seen) {
        ++sleepers_;
        cv_work_.wait(lk, [&] { return gen_.load() != seen; });
        --sleepers_;
      }
      const int64_t gap = std::chrono::duration_cast<std::chrono::nanoseconds>(
          std::chrono::steady_clock::now() - idle_from).count();
      budget = gap <= poll_ns() ? poll_ns() : budget / 2;
      seen = gen_.load();
      if (joined_ >= max_join_) continue;
      ++joined_;
      drain(lk);
    }
  }

  std::mutex run_mu_;  // one caller at a time
  std::mutex mu_;
  std::condition_variable cv_work_, cv_done_;
  const std::function<void(int64_t)>* fn_ = nullptr;
  int64_t n_ = 0, next_ = 0;
  std::atomic<int> busy_{0};
  int joined_ = 0, max_join_ = 0, sleepers_ = 0;
  unsigned helpers_ = 0;
  std::atomic<uint64_t> gen_{0};
};

}  // namespace freetoken
