// TaskPool: the small thread pool of the CPU kernels (ops_cpu.cpp's top-k, linear_cpu.cpp's panel
// linear), one for the whole extension.
//
// Why not at::parallel_for: it is serial in this extension (setup.py builds without -fopenmp, so
// ATen's inline OpenMP backend is a plain call), and an OpenMP region is a static split then a
// join of every thread. Here the caller starts on the tasks at once and waits only for tasks a
// helper has actually claimed: a helper that wakes late (PASSIVE wait policy, or a core busy with
// another process on these shared machines) finds the work done and costs nothing. One caller at a
// time: a second concurrent caller, or a forked child (no helpers), runs its tasks alone.
#pragma once

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

  // fn(0) .. fn(n - 1), on the caller and up to nthreads - 1 helpers.
  void run(int64_t n, int nthreads, const std::function<void(int64_t)>& fn) {
    std::unique_lock<std::mutex> caller(run_mu_, std::try_to_lock);
    if (!caller.owns_lock() || nthreads <= 1 || n <= 1) {
      for (int64_t t = 0; t < n; ++t) fn(t);
      return;
    }
    std::unique_lock<std::mutex> lk(mu_);
    while (static_cast<int>(helpers_) < nthreads - 1) {
      std::thread(&TaskPool::helper, this).detach();
      ++helpers_;
    }
    fn_ = &fn;
    n_ = n;
    next_ = 0;
    joined_ = 0;
    max_join_ = nthreads - 1;
    ++gen_;
    lk.unlock();
    cv_work_.notify_all();
    lk.lock();
    drain(lk);
    cv_done_.wait(lk, [&] { return busy_ == 0; });
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

  void helper() {
    std::unique_lock<std::mutex> lk(mu_);
    uint64_t seen = gen_;
    while (true) {
      cv_work_.wait(lk, [&] { return gen_ != seen; });
      seen = gen_;
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
  int busy_ = 0, joined_ = 0, max_join_ = 0;
  unsigned helpers_ = 0;
  uint64_t gen_ = 0;
};

}  // namespace freetoken
