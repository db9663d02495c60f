// Waiters: how many caller threads are blocked waiting for an op that has not
// been executed yet. The background loop holds fresh GPU allreduces back while
// the NCCL stream is busy, so that later gradients join them (docs/design.md §8);
// a caller already waiting for its result gains nothing from that and sends no
// more work meanwhile, so the hold ends as soon as one is waiting.
//
// Threading: Enter/Leave from any caller thread, Any/Nap from the background one.
#pragma once

#include <chrono>

#include "common/thread_annotations.h"

namespace hvd {

class Waiters {
 public:
  void Enter() {
    {
      MutexLock lock(mu_);
      ++count_;
    }
    cv_.NotifyAll();
  }
  void Leave() {
    MutexLock lock(mu_);
    --count_;
  }
  bool Any() {
    MutexLock lock(mu_);
    return count_ > 0;
  }
  // Sleeps for `period`, or less when a caller starts waiting; true if one is.
  bool Nap(std::chrono::microseconds period) {
    MutexLock lock(mu_);
    return cv_.WaitFor(mu_, period, [this]() HVD_REQUIRES(mu_) { return count_ > 0; });
  }

  // Counts the current thread as waiting for its lifetime (nothing if null).
  class Scope {
   public:
    explicit Scope(Waiters* w) : w_(w) {
      if (w_ != nullptr) w_->Enter();
    }
    ~Scope() {
      if (w_ != nullptr) w_->Leave();
    }
    Scope(const Scope&) = delete;
    Scope& operator=(const Scope&) = delete;

   private:
    Waiters* w_;
  };

 private:
  Mutex mu_;
  CondVar cv_;
  int count_ HVD_GUARDED_BY(mu_) = 0;
};

}  // namespace hvd
