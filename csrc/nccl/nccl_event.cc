#include "nccl/nccl_event.h"

#include <mutex>
#include <stdexcept>
#include <unordered_map>
#include <vector>

namespace hvd {
namespace {

// CUDA events (timing disabled) are recycled: every op records two (ready and
// done), and creating and destroying them costs the submitting thread more than
// recording them. Never freed (a process keeps about as many as ops in flight).
class EventPool {
 public:
  cudaEvent_t Get(int device) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto& free = free_[device];
      if (!free.empty()) {
        cudaEvent_t e = free.back();
        free.pop_back();
        return e;
      }
    }
    c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
    cudaEvent_t e = nullptr;
    cudaEventCreateWithFlags(&e, cudaEventDisableTiming);
    return e;
  }
  void Put(int device, cudaEvent_t e) {
    std::lock_guard<std::mutex> lock(mu_);
    free_[device].push_back(e);
  }

 private:
  std::mutex mu_;
  std::unordered_map<int, std::vector<cudaEvent_t>> free_;
};

EventPool& Events() {
  static EventPool* pool = new EventPool();  // outlives every NcclEvent, also at exit
  return *pool;
}

}  // namespace

NcclEvent::NcclEvent(int device) : device_(device), event_(Events().Get(device)) {}

NcclEvent::~NcclEvent() {
  if (event_ != nullptr) Events().Put(device_, event_);
}

void DropDone(std::deque<InFlight>& ops) {
  while (!ops.empty() && ops.front().done->Ready()) ops.pop_front();
}

Status CheckInFlight(std::deque<InFlight>& ops, double timeout_s, int device) {
  DropDone(ops);
  if (ops.empty() || timeout_s <= 0) return Status::Ok();
  InFlight& op = ops.front();
  const auto now = std::chrono::steady_clock::now();
  if (op.since == std::chrono::steady_clock::time_point{}) {
    if (op.start->Ready()) op.since = now;  // its inputs are ready: it runs from here
    return Status::Ok();
  }
  const double secs = std::chrono::duration<double>(now - op.since).count();
  if (secs <= timeout_s) return Status::Ok();
  return Status::Aborted(
      "NCCL collective '" + op.name + "' has run " + std::to_string(static_cast<int>(secs)) +
      " s on GPU " + std::to_string(device) +
      " without finishing (HOROVOD_GPU_OP_TIMEOUT=" + std::to_string(static_cast<int>(timeout_s)) +
      "): a peer's GPU never joined it (its process or GPU is stuck, "
      "or the inputs it waits for never became ready)");
}

}  // namespace hvd
