// Helper threads of a shared-memory group (ShmGroup::Parallel, shm_collectives.cc):
// they copy and reduce the parts of one pipeline step beside the rank's own thread.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <thread>
#include <vector>

#include "common/net.h"  // Clock
#include "common/thread_annotations.h"

namespace hvd {
namespace shm {

// A spin-wait's pause.
inline void CpuRelax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield" ::: "memory");
#endif
}

// Helper threads for the parts of one pipeline step. Run() does part 0, then,
// like every helper, claims the next unclaimed part until none is left, and
// returns when the parts others claimed are done too. So a helper that wakes
// late (asleep since the last op) finds nothing left and costs nothing: a step
// never takes longer than the rank's thread alone would. Helpers spin a while
// for the next step, then sleep on a condition variable.
class Helpers {
 public:
  // Throws std::system_error if a thread cannot be started (none is left running).
  Helpers(int n, int64_t spin_ns) : spin_ns_(spin_ns) {
    try {
      for (int i = 0; i < n; ++i) threads_.emplace_back([this] { Loop(); });
    } catch (...) {
      Stop();
      throw;
    }
  }
  ~Helpers() { Stop(); }
  void Run(int parts, const std::function<void(int)>& fn) {
    uint64_t gen;
    {
      MutexLock lock(mu_);
      fn_ = &fn;
      parts_ = parts;
      done_.store(0, std::memory_order_relaxed);
      gen = gen_.load(std::memory_order_relaxed) + 1;
      ticket_.store(Ticket(gen, 1), std::memory_order_relaxed);
      gen_.store(gen, std::memory_order_release);
    }
    cv_.NotifyAll();
    fn(0);
    int mine = 1;
    for (int p; (p = Claim(gen, parts)) >= 0; ++mine) fn(p);
    while (mine + done_.load(std::memory_order_acquire) < parts) CpuRelax();
  }

 private:
  // A claim names its step's generation, so a helper still holding an older
  // step's function can never take a part of a newer step.
  static uint64_t Ticket(uint64_t gen, int next) {
    return (gen << 32) | static_cast<uint32_t>(next);
  }
  int Claim(uint64_t gen, int parts) {
    uint64_t t = ticket_.load(std::memory_order_acquire);
    for (;;) {
      const int next = static_cast<int>(t & 0xffffffffu);
      if ((t >> 32) != (gen & 0xffffffffu) || next >= parts) return -1;
      if (ticket_.compare_exchange_weak(t, t + 1, std::memory_order_acq_rel)) return next;
    }
  }
  void Stop() {
    {
      MutexLock lock(mu_);
      stop_ = true;
      gen_.fetch_add(1, std::memory_order_release);
    }
    cv_.NotifyAll();
    for (auto& t : threads_) t.join();
    threads_.clear();
  }
  void Loop() {
    uint64_t seen = 0;
    for (;;) {
      const auto spin_end = Clock::now() + std::chrono::nanoseconds(spin_ns_);
      for (int i = 0; gen_.load(std::memory_order_acquire) == seen; ++i) {
        CpuRelax();
        if ((i & 63) == 63 && Clock::now() >= spin_end) break;
      }
      const std::function<void(int)>* fn;
      int parts;
      {
        MutexLock lock(mu_);
        cv_.Wait(mu_, [&] { return gen_.load(std::memory_order_relaxed) != seen; });
        seen = gen_.load(std::memory_order_relaxed);
        if (stop_) return;
        fn = fn_;
        parts = parts_;
      }
      // fn is valid while a part of generation `seen` is unclaimed: Run() does
      // not return before every claimed part is done.
      for (int p; (p = Claim(seen, parts)) >= 0;) {
        (*fn)(p);
        done_.fetch_add(1, std::memory_order_release);
      }
    }
  }

  const int64_t spin_ns_;
  std::vector<std::thread> threads_;
  Mutex mu_;
  CondVar cv_;
  std::atomic<uint64_t> gen_{0};     // bumped per step (and to stop)
  std::atomic<uint64_t> ticket_{0};  // generation (high 32 bits), next part to claim
  std::atomic<int> done_{0};         // parts finished by helpers this step
  const std::function<void(int)>* fn_ HVD_GUARDED_BY(mu_) = nullptr;
  int parts_ HVD_GUARDED_BY(mu_) = 0;
  bool stop_ HVD_GUARDED_BY(mu_) = false;
};

}  // namespace shm
}  // namespace hvd
