// Handles: the integer a Python caller holds for an op in flight.
//
// Threading: HandleState is written once by the background thread (Complete) and
// read by Python threads (Poll/Wait); HandleTable is used by Python threads.
// A HandleState is shared between the table and the runtime's pending entry,
// because either may outlive the other (a runtime shut down with ops in flight).
#pragma once

#include <ATen/ATen.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <thread>
#include <unordered_map>

#include "common/status.h"
#include "core/waiters.h"

namespace hvd {

// Completion of GPU work, recorded on a stream. Implemented by the GPU backend.
class GpuEvent {
 public:
  virtual ~GpuEvent() = default;
  // True once the GPU work before the event has finished.
  virtual bool Ready() = 0;
  // Makes the caller's current CUDA stream wait for the event (no host wait;
  // skipped with wait=false, when the stream already waits for this event), and
  // tells the allocator that `result` is used on that stream.
  virtual void BlockCurrentStream(const at::Tensor& result, bool wait) = 0;
};

class HandleState {
 public:
  HandleState() = default;
  // `waiters` counts this handle's callers while they wait for it.
  explicit HandleState(std::shared_ptr<Waiters> waiters) : waiters_(std::move(waiters)) {}
  void Complete(Status status, at::Tensor output = {}, at::Tensor splits = {},
                std::shared_ptr<GpuEvent> event = nullptr) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (done_) return;
      status_ = std::move(status);
      output_ = std::move(output);
      splits_ = std::move(splits);
      event_ = std::move(event);
      done_ = true;
      done_flag_.store(true, std::memory_order_release);
    }
    cv_.notify_all();
  }
  // Done, and for GPU ops also finished on the device.
  bool Poll() {
    std::shared_ptr<GpuEvent> event;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!done_) return false;
      event = event_;
    }
    return event == nullptr || event->Ready();
  }
  // Blocks until complete. Call without the Python GIL held. With spin_us > 0 it
  // first polls that long (yielding) before sleeping: a short op then returns
  // without a condition-variable wake-up (HOROVOD_SPIN_US).
  void Wait(double spin_us = 0) {
    if (done_flag_.load(std::memory_order_acquire)) return;
    Waiters::Scope waiting(waiters_.get());
    if (spin_us > 0) {
      auto until = std::chrono::steady_clock::now() +
                   std::chrono::microseconds(static_cast<int64_t>(spin_us));
      while (!done_flag_.load(std::memory_order_acquire) &&
             std::chrono::steady_clock::now() < until) {
        std::this_thread::yield();
      }
    }
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [this] { return done_; });
  }
  // Valid after Wait().
  const Status& status() const { return status_; }
  const at::Tensor& output() const { return output_; }
  const at::Tensor& splits() const { return splits_; }
  const std::shared_ptr<GpuEvent>& event() const { return event_; }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  bool done_ = false;       // GUARDED_BY(mu_)
  std::atomic<bool> done_flag_{false};  // done_, readable without mu_ (Wait's spin)
  Status status_;           // GUARDED_BY(mu_), immutable once done_
  at::Tensor output_;
  at::Tensor splits_;
  std::shared_ptr<GpuEvent> event_;
  const std::shared_ptr<Waiters> waiters_;  // may be null
};

class HandleTable {
 public:
  int Add(std::shared_ptr<HandleState> state) {
    std::lock_guard<std::mutex> lock(mu_);
    int h = next_++;
    table_[h] = std::move(state);
    return h;
  }
  std::shared_ptr<HandleState> Find(int handle) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = table_.find(handle);
    return it == table_.end() ? nullptr : it->second;
  }
  void Release(int handle) {
    std::lock_guard<std::mutex> lock(mu_);
    table_.erase(handle);
  }

 private:
  std::mutex mu_;
  int next_ = 1;                                                  // GUARDED_BY(mu_)
  std::unordered_map<int, std::shared_ptr<HandleState>> table_;   // GUARDED_BY(mu_)
};

}  // namespace hvd
