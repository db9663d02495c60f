// The Work of one torch.distributed call of the "hvd" backend (c10d_backend.cc), and
// the threads that complete calls.
//
// Completion: the background thread completes an op's handles; the last one hands
// the call's state to one completion thread (or a caller of Work.wait() that saw
// them complete first takes it), which copies results into the caller's
// tensors where the runtime allocated them (allgather, reduce-scatter, alltoall),
// then completes the Work's future (for CUDA tensors on a pool stream that waits for
// the op, so that consumers' streams wait for it and the host does not). User
// callbacks chained on the future (DDP comm hooks) run on that thread, never on the
// engine's; a call that completes while that thread is busy (a callback waiting for
// another call's future) gets a thread of its own.
#ifndef HOROVOD_TORCH_PYTHON_C10D_WORK_H_
#define HOROVOD_TORCH_PYTHON_C10D_WORK_H_

#include <ATen/core/ivalue.h>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <exception>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "common/thread_annotations.h"
#include "core/handles.h"

namespace hvd {

// Throws DistBackendError("hvd backend: " + message).
[[noreturn]] void Fail(const std::string& message);

// What is left until `until`, for a wait (0 once it has passed).
inline std::chrono::milliseconds TimeLeft(std::chrono::steady_clock::time_point until) {
  return std::max(std::chrono::duration_cast<std::chrono::milliseconds>(
                      until - std::chrono::steady_clock::now()),
                  std::chrono::milliseconds(0));
}

// Whether a call has completed, and its error.
class Completion {
 public:
  bool WaitFor(std::chrono::milliseconds timeout) {
    MutexLock lock(mu_);
    return cv_.WaitFor(mu_, timeout, [this]() HVD_REQUIRES(mu_) { return done_; });
  }
  bool Done() {
    MutexLock lock(mu_);
    return done_;
  }
  std::exception_ptr Error() {
    MutexLock lock(mu_);
    return error_;
  }
  void MarkDone(std::exception_ptr e) {
    {
      MutexLock lock(mu_);
      error_ = std::move(e);
      done_ = true;
    }
    cv_.NotifyAll();
  }

 private:
  Mutex mu_;
  CondVar cv_;
  bool done_ HVD_GUARDED_BY(mu_) = false;
  std::exception_ptr error_ HVD_GUARDED_BY(mu_);
};

// One torch.distributed call in flight. Once submitted, `handles`, `finish` and
// `future` are touched only by the thread that took `claimed`.
struct CallState {
  std::string what;                                   // "allreduce", for messages
  std::vector<std::shared_ptr<HandleState>> handles;  // its ops (dropped once complete)
  std::vector<at::Tensor> outputs;                    // the future's value
  // Copies the ops' results into `outputs` (null: they were written in place).
  std::function<void(const std::vector<std::shared_ptr<HandleState>>&)> finish;
  c10::intrusive_ptr<c10::ivalue::Future> future;
  std::atomic<int> remaining{0};  // handles not yet complete
  // Taken by the thread that completes the call: the completion thread, or a caller of
  // Work.wait() that saw its ops complete first.
  std::atomic<bool> claimed{false};
  bool from_any = false;        // a receive from any source
  std::atomic<int> source{-1};  // its sender, once complete
  Completion completion;
};

// Whether this thread runs the callbacks of a call's future (inside its completion).
bool InFutureCallback();

// Watches `call`'s handles (its ops, submitted) and returns its Work: once the last
// op completes, the completion thread (or a caller of wait()) runs finish() and
// completes the future.
// `timeout` bounds wait() without a timeout of its own.
c10::intrusive_ptr<c10d::Work> StartWork(std::shared_ptr<CallState> call, c10d::OpType type,
                                         std::chrono::milliseconds timeout);

}  // namespace hvd

#endif  // HOROVOD_TORCH_PYTHON_C10D_WORK_H_
