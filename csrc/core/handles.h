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
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "common/status.h"
#include "common/thread_annotations.h"
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
  // Whether the caller's current CUDA stream is the one the event was recorded on.
  virtual bool OnCurrentStream() = 0;
  // Tells the allocator that `t`'s memory is used on the stream the event was
  // recorded on: freed, it is reused only after the work enqueued there by then.
  virtual void MarkUsedOnStream(const at::Tensor& t) = 0;
  // Runs fn on this thread with a CUDA stream of the event's device current that
  // waits for the event (a stream from torch's pool, never the caller's): what fn
  // enqueues runs after the op, and a CUDA future completed in fn records its events
  // there, so that its consumers wait for the op without the host waiting for it.
  virtual void RunAfter(const std::function<void()>& fn) = 0;
};

// The names of ops whose handles are still held. A name is taken from its op's
// submission until its handle is gone (synchronized, or dropped with the optimizer's
// hooks), not merely until the op has run: a second op of the same name is refused
// on every timing, even when the first one completed before the caller's next line.
class NameReservations {
 public:
  // Takes every name (all or none); false, with the name in *taken, if one is held
  // or repeated.
  bool Reserve(const std::vector<std::string>& names, std::string* taken) {
    MutexLock lock(mu_);
    for (size_t i = 0; i < names.size(); ++i) {
      bool dup = held_.count(names[i]) > 0;
      for (size_t j = 0; j < i && !dup; ++j) dup = names[j] == names[i];
      if (dup) {
        *taken = names[i];
        return false;
      }
    }
    held_.insert(names.begin(), names.end());
    return true;
  }
  void Release(const std::string& name) {
    MutexLock lock(mu_);
    held_.erase(name);
  }

 private:
  Mutex mu_;
  std::unordered_set<std::string> held_ HVD_GUARDED_BY(mu_);
};

class HandleState {
 public:
  HandleState() = default;
  // `waiters` counts this handle's callers while they wait for it; `names` holds
  // `name` until this handle is destroyed.
  explicit HandleState(std::shared_ptr<Waiters> waiters,
                       std::shared_ptr<NameReservations> names = nullptr, std::string name = {})
      : waiters_(std::move(waiters)), names_(std::move(names)), name_(std::move(name)) {}
  ~HandleState() {
    ReleaseName();
    if (made_on_ != nullptr && !stream_waited_.load(std::memory_order_acquire) &&
        event_ != nullptr && output_.defined()) {
      try {
        event_->MarkUsedOnStream(output_);  // see Complete()
      } catch (...) {
        // a destructor must not throw (CUDA already torn down at exit, say)
      }
    }
  }
  // Frees the op's name for a new op (once; the waiter calls it when the wait
  // returns, before the background thread may have dropped its reference).
  void ReleaseName() {
    if (names_ && !name_released_.exchange(true)) names_->Release(name_);
  }
  HandleState(const HandleState&) = delete;
  HandleState& operator=(const HandleState&) = delete;
  // A GPU op completes with the `event` its stream records after it. With `made_on`
  // (the event RecordReady() recorded on the stream that made its input), the backend
  // has not told the allocator that the output, which its stream wrote (and read, in
  // place), is used there: a recordStream per gradient costs an event record when the
  // tensor is freed and a query of it at later allocations. Memory freed after the
  // stream that made the input has waited for the op (BlockCurrentStream() called
  // there) is reused only after the op, as torch's own process groups assume when
  // they keep a tensor rather than record its stream. A handle that goes without
  // that wait (never synchronized, waited from another stream, dropped by an elastic
  // reset) tells the allocator then, in its destructor.
  void Complete(Status status, at::Tensor output = {}, at::Tensor splits = {},
                std::shared_ptr<GpuEvent> event = nullptr,
                std::shared_ptr<GpuEvent> made_on = nullptr) {
    std::vector<std::function<void()>> callbacks;
    {
      MutexLock lock(mu_);
      if (done_) return;
      status_ = std::move(status);
      output_ = std::move(output);
      splits_ = std::move(splits);
      event_ = std::move(event);
      made_on_ = event_ != nullptr ? std::move(made_on) : nullptr;
      done_ = true;
      done_flag_.store(true, std::memory_order_release);
      callbacks.swap(callbacks_);
    }
    cv_.NotifyAll();
    for (auto& fn : callbacks) fn();
  }
  // Runs fn once the op is complete: at once, on this thread, if it already is; else
  // on the thread that completes it (the background thread) right after, so fn must
  // be short and must not wait for other ops.
  void OnComplete(std::function<void()> fn) {
    {
      MutexLock lock(mu_);
      if (!done_) {
        callbacks_.push_back(std::move(fn));
        return;
      }
    }
    fn();
  }
  // The op's name ("" for a handle made without one).
  const std::string& name() const { return name_; }
  // A receive from any source: the sending rank, set before Complete (else -1).
  void SetSource(int rank) { source_.store(rank, std::memory_order_relaxed); }
  int source() const { return source_.load(std::memory_order_relaxed); }
  // Complete (the host's part; see Poll for GPU ops).
  bool done() const { return done_flag_.load(std::memory_order_acquire); }
  // Done, and for GPU ops also finished on the device.
  bool Poll() {
    std::shared_ptr<GpuEvent> event;
    {
      MutexLock lock(mu_);
      if (!done_) return false;
      event = event_;
    }
    return event == nullptr || event->Ready();
  }
  // Blocks until complete, or for at most `timeout`; true once complete. Call
  // without the Python GIL held. With spin_us > 0 it first polls that long
  // (yielding) before sleeping: a short op then returns without a
  // condition-variable wake-up (HOROVOD_SPIN_US).
  bool Wait(double spin_us, std::chrono::milliseconds timeout) {
    if (done_flag_.load(std::memory_order_acquire)) return true;
    Waiters::Scope waiting(waiters_.get());
    if (spin_us > 0) {
      auto until = std::chrono::steady_clock::now() +
                   std::chrono::microseconds(static_cast<int64_t>(spin_us));
      while (!done_flag_.load(std::memory_order_acquire) &&
             std::chrono::steady_clock::now() < until) {
        std::this_thread::yield();
      }
    }
    MutexLock lock(mu_);
    return cv_.WaitFor(mu_, timeout, [this]() HVD_REQUIRES(mu_) { return done_; });
  }
  // Once complete, with a GPU event: makes the caller's current stream wait for the op
  // (GpuEvent::BlockCurrentStream, with its `wait`), and notes whether that stream made
  // the input (see Complete()).
  void BlockCurrentStream(bool wait) {
    event_->BlockCurrentStream(output_, wait);
    if (made_on_ != nullptr && made_on_->OnCurrentStream()) {
      stream_waited_.store(true, std::memory_order_release);
    }
  }
  // Valid once Wait() returned true.
  const Status& status() const { return status_; }
  const at::Tensor& output() const { return output_; }
  const at::Tensor& splits() const { return splits_; }
  const std::shared_ptr<GpuEvent>& event() const { return event_; }

 private:
  Mutex mu_;
  CondVar cv_;
  bool done_ HVD_GUARDED_BY(mu_) = false;
  std::atomic<bool> done_flag_{false};  // done_, readable without mu_ (Wait's spin)
  Status status_ HVD_GUARDED_BY(mu_);   // immutable once done_
  at::Tensor output_;
  at::Tensor splits_;
  std::shared_ptr<GpuEvent> event_;
  std::shared_ptr<GpuEvent> made_on_;       // see Complete(); immutable once done_
  std::atomic<bool> stream_waited_{false};  // ... and BlockCurrentStream()
  std::vector<std::function<void()>> callbacks_ HVD_GUARDED_BY(mu_);  // OnComplete()
  const std::shared_ptr<Waiters> waiters_;                            // may be null
  const std::shared_ptr<NameReservations> names_;                     // may be null
  const std::string name_;
  std::atomic<bool> name_released_{false};
  std::atomic<int> source_{-1};
};

class HandleTable {
 public:
  int Add(std::shared_ptr<HandleState> state) {
    MutexLock lock(mu_);
    int h = next_++;
    table_[h] = std::move(state);
    return h;
  }
  std::shared_ptr<HandleState> Find(int handle) {
    MutexLock lock(mu_);
    auto it = table_.find(handle);
    return it == table_.end() ? nullptr : it->second;
  }
  void Release(int handle) {
    MutexLock lock(mu_);
    table_.erase(handle);
  }

 private:
  Mutex mu_;
  int next_ HVD_GUARDED_BY(mu_) = 1;
  std::unordered_map<int, std::shared_ptr<HandleState>> table_ HVD_GUARDED_BY(mu_);
};

}  // namespace hvd
