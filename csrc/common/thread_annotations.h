// Lock annotations that Clang checks (-Wthread-safety: tools/check_thread_safety.sh,
// run by `make cpp-check` and so by `make test`). A member marked
// HVD_GUARDED_BY(mu_) may only be touched with mu_ held; a function marked
// HVD_REQUIRES(mu_) only called with it held. GCC sees nothing.
//
// The analysis knows only annotated lock types, so guarded state uses Mutex and
// MutexLock below (std::mutex and std::lock_guard in libstdc++ are not annotated);
// CondVar waits on a Mutex the caller holds.
#pragma once

#include <chrono>
#include <condition_variable>
#include <mutex>

#if defined(__clang__)
#define HVD_TSA(x) __attribute__((x))
#else
#define HVD_TSA(x)
#endif

#define HVD_CAPABILITY(name) HVD_TSA(capability(name))
#define HVD_SCOPED_CAPABILITY HVD_TSA(scoped_lockable)
#define HVD_GUARDED_BY(mu) HVD_TSA(guarded_by(mu))
#define HVD_PT_GUARDED_BY(mu) HVD_TSA(pt_guarded_by(mu))
#define HVD_REQUIRES(...) HVD_TSA(requires_capability(__VA_ARGS__))
#define HVD_EXCLUDES(...) HVD_TSA(locks_excluded(__VA_ARGS__))
#define HVD_ACQUIRE(...) HVD_TSA(acquire_capability(__VA_ARGS__))
#define HVD_RELEASE(...) HVD_TSA(release_capability(__VA_ARGS__))
#define HVD_NO_THREAD_SAFETY_ANALYSIS HVD_TSA(no_thread_safety_analysis)

namespace hvd {

class HVD_CAPABILITY("mutex") Mutex {
 public:
  void lock() HVD_ACQUIRE() { mu_.lock(); }
  void unlock() HVD_RELEASE() { mu_.unlock(); }

 private:
  friend class CondVar;
  std::mutex mu_;
};

// std::lock_guard for a Mutex, which the analysis understands.
class HVD_SCOPED_CAPABILITY MutexLock {
 public:
  explicit MutexLock(Mutex& mu) HVD_ACQUIRE(mu) : mu_(mu) { mu_.lock(); }
  ~MutexLock() HVD_RELEASE() {
    if (held_) mu_.unlock();
  }
  // Lets go of the mutex for a while (a sleep), then takes it back.
  void Unlock() HVD_RELEASE() {
    mu_.unlock();
    held_ = false;
  }
  void Lock() HVD_ACQUIRE() {
    mu_.lock();
    held_ = true;
  }
  MutexLock(const MutexLock&) = delete;
  MutexLock& operator=(const MutexLock&) = delete;

 private:
  Mutex& mu_;
  bool held_ = true;
};

// std::condition_variable over a Mutex the caller holds (through a MutexLock): the
// waits release it while blocked and hold it again when they return, as
// std::condition_variable's do. The predicate runs with the mutex held; lambdas are
// not analysed, so a predicate reading guarded state is checked by the caller's
// annotation only.
class CondVar {
 public:
  template <typename Pred>
  void Wait(Mutex& mu, Pred pred) HVD_REQUIRES(mu) {
    std::unique_lock<std::mutex> lock(mu.mu_, std::adopt_lock);
    cv_.wait(lock, pred);
    lock.release();  // still held: the caller's MutexLock unlocks it
  }
  // False if it timed out with `pred` still false.
  template <typename Clock, typename Duration, typename Pred>
  bool WaitUntil(Mutex& mu, const std::chrono::time_point<Clock, Duration>& deadline, Pred pred)
      HVD_REQUIRES(mu) {
    std::unique_lock<std::mutex> lock(mu.mu_, std::adopt_lock);
    const bool ok = cv_.wait_until(lock, deadline, pred);
    lock.release();
    return ok;
  }
  template <typename Rep, typename Period, typename Pred>
  bool WaitFor(Mutex& mu, const std::chrono::duration<Rep, Period>& timeout, Pred pred)
      HVD_REQUIRES(mu) {
    std::unique_lock<std::mutex> lock(mu.mu_, std::adopt_lock);
    const bool ok = cv_.wait_for(lock, timeout, pred);
    lock.release();
    return ok;
  }
  void NotifyAll() { cv_.notify_all(); }
  void NotifyOne() { cv_.notify_one(); }

 private:
  std::condition_variable cv_;
};

}  // namespace hvd
