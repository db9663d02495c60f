#include "nccl/nccl_event.h"

#include <mutex>
#include <stdexcept>
#include <unordered_map>
#include <vector>

namespace hvd {
namespace {

// CUDA events are recycled: every op records two or three (ready, and start and
// done), and creating and destroying them costs the submitting thread more than
// recording them. Never freed (a process keeps about as many as ops in flight). Events
// that time (NcclEvent's `timing`) are kept apart: they cost a timestamp each.
class EventPool {
 public:
  cudaEvent_t Get(int device, bool timing) {
    const int key = device * 2 + (timing ? 1 : 0);
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto& free = free_[key];
      if (!free.empty()) {
        cudaEvent_t e = free.back();
        free.pop_back();
        return e;
      }
    }
    c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
    cudaEvent_t e = nullptr;
    cudaEventCreateWithFlags(&e, timing ? cudaEventDefault : cudaEventDisableTiming);
    return e;
  }
  void Put(int device, bool timing, cudaEvent_t e) {
    std::lock_guard<std::mutex> lock(mu_);
    free_[device * 2 + (timing ? 1 : 0)].push_back(e);
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

NcclEvent::NcclEvent(int device, bool timing)
    : device_(device), timing_(timing), event_(Events().Get(device, timing)) {}

NcclEvent::~NcclEvent() {
  if (event_ != nullptr) Events().Put(device_, timing_, event_);
}

double NcclEvent::SecondsSince(const NcclEvent& start) const {
  if (!timing_ || !start.timing_ || event_ == nullptr || start.event_ == nullptr) return -1;
  c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device_));
  float ms = 0;
  if (cudaEventElapsedTime(&ms, start.event_, event_) != cudaSuccess) {
    cudaGetLastError();  // not sticky
    return -1;
  }
  return static_cast<double>(ms) * 1e-3;
}

void DropDone(std::deque<InFlight>& ops, CollectiveTimes* times) {
  while (!ops.empty() && ops.front().done->Ready()) {
    const InFlight& op = ops.front();
    if (times != nullptr && op.seq >= 0) {
      const double s = op.done->SecondsSince(*op.start);
      times->Add(static_cast<uint64_t>(op.seq),
                 s >= 0 ? static_cast<uint64_t>(s * 1e9) : CollectiveTimes::kUntimed);
    }
    ops.pop_front();
  }
}

Status CheckInFlight(std::deque<InFlight>& ops, double timeout_s, int device,
                     CollectiveTimes* times) {
  DropDone(ops, times);
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
