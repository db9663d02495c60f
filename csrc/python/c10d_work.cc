#include "python/c10d_work.h"

#include <deque>
#include <thread>

#include "core/gpu_backend.h"
#include "python/module_state.h"

namespace hvd {

[[noreturn]] void Fail(const std::string& message) {
  C10_THROW_ERROR(DistBackendError, "hvd backend: " + message);
}

namespace {

std::exception_ptr DistError(const std::string& message) {
  try {
    C10_THROW_ERROR(DistBackendError, message);
  } catch (...) {
    return std::current_exception();
  }
}

// How many Complete() calls this thread is inside (the futures' callbacks run there).
thread_local int completing = 0;

// Runs finish() and completes the future of one call whose ops have all completed.
void Complete(CallState& c) {
  ++completing;
  struct Leave {
    ~Leave() { --completing; }
  } leave;
  // Before the future completes: its callbacks may ask the Work for the sender.
  if (c.from_any && !c.handles.empty()) c.source = c.handles[0]->source();
  std::string message;
  for (const auto& h : c.handles) {
    if (!h->status().ok()) {
      message = h->status().message();
      break;
    }
  }
  if (message.empty()) {
    try {
      auto finish = [&c] {
        if (c.finish) c.finish(c.handles);
        c.future->markCompleted(c10::IValue(c.outputs));
      };
      GpuEvent* first = nullptr;
      for (const auto& h : c.handles) {
        if (h->event()) {
          first = h->event().get();
          break;
        }
      }
      if (first == nullptr) {
        finish();
      } else {
        first->RunAfter([&] {
          // The runtime's outputs are read on this stream; later ops' events waited for.
          for (const auto& h : c.handles) {
            if (h->event()) h->BlockCurrentStream(h->event().get() != first);
          }
          finish();
        });
      }
    } catch (const std::exception& e) {
      message = e.what();
    }
  }
  std::exception_ptr error;
  if (!message.empty()) {
    error = DistError("hvd backend: " + c.what + " failed: " + message);
    if (!c.future->completed()) c.future->setError(error);
  }
  c.handles.clear();  // the runtime's outputs, copied where they belong
  c.finish = nullptr;
  c.completion.MarkDone(error);
}

// The threads that complete calls (Complete()): one, and another whenever a call is
// pushed while every one of them is busy. A callback chained on a future may block on
// another call's future, which a single thread, busy running that callback, would then
// never complete. (A call made inside such a callback is refused: C10dCalls::Run.) A
// thread beyond the
// first ends after kIdle without work. Never destroyed, as threads may outlive the
// module's teardown.
class Completer {
 public:
  static Completer& Get() {
    static Completer* c = new Completer();
    return *c;
  }
  void Push(std::shared_ptr<CallState> c) {
    bool spawn;
    {
      MutexLock lock(mu_);
      queue_.push_back(std::move(c));
      spawn = idle_ == 0;
      if (spawn) ++threads_;
    }
    if (spawn) {
      std::thread([this] { Run(); }).detach();
    } else {
      cv_.NotifyOne();
    }
  }

 private:
  static constexpr std::chrono::seconds kIdle{30};
  void Run() {
    for (;;) {
      std::shared_ptr<CallState> c;
      {
        MutexLock lock(mu_);
        ++idle_;
        const bool work =
            cv_.WaitFor(mu_, kIdle, [this]() HVD_REQUIRES(mu_) { return !queue_.empty(); });
        --idle_;
        if (!work) {
          if (threads_ > 1) {
            --threads_;
            return;
          }
          continue;
        }
        c = std::move(queue_.front());
        queue_.pop_front();
      }
      if (!c->claimed.exchange(true)) Complete(*c);
    }
  }
  Mutex mu_;
  CondVar cv_;
  std::deque<std::shared_ptr<CallState>> queue_ HVD_GUARDED_BY(mu_);
  int idle_ HVD_GUARDED_BY(mu_) = 0;     // threads waiting for work
  int threads_ HVD_GUARDED_BY(mu_) = 0;  // threads running Run()
};

class HvdWork : public c10d::Work {
 public:
  HvdWork(std::shared_ptr<CallState> call, c10d::OpType type, std::chrono::milliseconds timeout,
          const std::vector<std::shared_ptr<HandleState>>& handles)
      : c10d::Work(-1, type),
        call_(std::move(call)),
        timeout_(timeout),
        handles_(handles.begin(), handles.end()) {}
  bool isCompleted() override { return call_->completion.Done(); }
  bool isSuccess() const override { return call_->completion.Done() && !call_->completion.Error(); }
  std::exception_ptr exception() const override { return call_->completion.Error(); }
  std::vector<at::Tensor> result() override { return call_->outputs; }
  // Blocks until the ops ran (raising their error); for CUDA tensors the caller's
  // current streams then wait for them on the GPU. The caller waits for the ops
  // themselves (spinning first, as hvd.synchronize does) and completes the call on its
  // own thread unless the completion thread has taken it already: a blocking call
  // then costs no wake-up of that thread.
  bool wait(std::chrono::milliseconds timeout) override {
    const auto limit = timeout.count() == 0 ? timeout_ : timeout;
    const auto until = std::chrono::steady_clock::now() + limit;
    const double spin_us = CurrentWaitSettings().spin_us;
    bool ran = true;
    for (const auto& weak : handles_) {
      // Gone: the call was completed already (Complete() dropped the handles).
      if (auto h = weak.lock()) ran = ran && h->Wait(spin_us, TimeLeft(until));
    }
    if (ran && !call_->claimed.exchange(true)) Complete(*call_);
    if (!ran || !call_->completion.WaitFor(TimeLeft(until))) {
      Fail(call_->what + " did not complete within " + std::to_string(limit.count()) +
           " ms (a rank has not called it, or is stuck before it)");
    }
    if (auto e = call_->completion.Error()) std::rethrow_exception(e);
    call_->future->wait();
    return true;
  }
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override { return call_->future; }
  // A receive from any source: the group rank it received from (-1 before it completed).
  int sourceRank() const override {
    return call_->from_any ? call_->source.load() : c10d::Work::sourceRank();
  }

 private:
  std::shared_ptr<CallState> call_;
  std::chrono::milliseconds timeout_;
  // The call's ops, not kept alive: Complete() drops them (and their outputs) at once.
  const std::vector<std::weak_ptr<HandleState>> handles_;
};

}  // namespace

bool InFutureCallback() { return completing > 0; }

c10::intrusive_ptr<c10d::Work> StartWork(std::shared_ptr<CallState> call, c10d::OpType type,
                                         std::chrono::milliseconds timeout) {
  // A copy: once the last op completes, whoever completes the call drops call->handles.
  const std::vector<std::shared_ptr<HandleState>> handles = call->handles;
  call->remaining = static_cast<int>(handles.size());
  for (const auto& h : handles) {
    HandleState* raw = h.get();
    h->OnComplete([call, raw] {
      raw->ReleaseName();
      if (--call->remaining == 0) Completer::Get().Push(call);
    });
  }
  return c10::make_intrusive<HvdWork>(call, type, timeout, handles);
}

}  // namespace hvd
