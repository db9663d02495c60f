// CUDA events for GPU ops (core/gpu_backend.h's GpuEvent): each op records one when
// its input is ready and one when it is done, recycled through a pool.
#pragma once

#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>

#include <chrono>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>

#include "common/status.h"
#include "core/gpu_backend.h"
#include "core/straggler.h"

namespace hvd {

// A CUDA event from the pool, returned to it when this object goes. A stream that
// waits for it keeps waiting for the work recorded then, whatever the event's
// later use.
class NcclEvent : public GpuEvent {
 public:
  // `timing`: an event that SecondsSince() can time (it costs a timestamp).
  explicit NcclEvent(int device, bool timing = false);
  ~NcclEvent() override;
  NcclEvent(const NcclEvent&) = delete;
  NcclEvent& operator=(const NcclEvent&) = delete;

  // With the event's (and the stream's) device current, as torch's CUDAEvent does: the
  // caller's current device may be another GPU (tensors placed with .cuda(local_rank)
  // and no torch.cuda.set_device), and once that GPU's context exists, recording there
  // fails with "invalid resource handle" and the op's peers wait for it forever.
  // Both return CUDA's error, with what failed, or "" on success.
  std::string Record(const c10::cuda::CUDAStream& s) {
    c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device_));
    if (event_ == nullptr) return "cudaEventCreate failed on GPU " + std::to_string(device_);
    stream_ = s;
    return Error("cudaEventRecord", cudaEventRecord(event_, s.stream()));
  }
  std::string Block(const c10::cuda::CUDAStream& s) {
    c10::cuda::CUDAGuard guard(s.device_index());
    if (event_ == nullptr) return "cudaEventCreate failed on GPU " + std::to_string(device_);
    return Error("cudaStreamWaitEvent", cudaStreamWaitEvent(s.stream(), event_, 0));
  }
  bool Ready() override { return cudaEventQuery(event_) == cudaSuccess; }
  // Seconds from `start` to this event, both recorded with `timing` and both fired
  // (-1: not timed).
  double SecondsSince(const NcclEvent& start) const;
  void BlockCurrentStream(const at::Tensor& result, bool wait) override {
    auto stream = c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(device_));
    if (wait) {
      const std::string error = Block(stream);
      if (!error.empty()) throw std::runtime_error(error);
    }
    if (result.defined() && result.is_cuda()) {
      c10::cuda::CUDACachingAllocator::recordStream(result.storage().data_ptr(), stream);
    }
  }
  bool OnCurrentStream() override {
    return stream_.has_value() &&
           c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(device_)) == *stream_;
  }
  void MarkUsedOnStream(const at::Tensor& t) override {
    if (stream_.has_value() && t.defined() && t.is_cuda()) {
      c10::cuda::CUDACachingAllocator::recordStream(t.storage().data_ptr(), *stream_);
    }
  }
  void RunAfter(const std::function<void()>& fn) override {
    const auto device = static_cast<c10::DeviceIndex>(device_);
    c10::cuda::CUDAGuard guard(device);
    auto stream = c10::cuda::getStreamFromPool(false, device);
    const std::string error = Block(stream);
    if (!error.empty()) throw std::runtime_error(error);
    c10::cuda::CUDAStreamGuard current(stream);
    fn();
  }

 private:
  std::string Error(const char* what, cudaError_t e) const {
    if (e == cudaSuccess) return "";
    cudaGetLastError();  // not sticky: the next call must not see it
    return std::string(what) + " failed on GPU " + std::to_string(device_) + ": " +
           cudaGetErrorString(e);
  }

  int device_;
  bool timing_;
  cudaEvent_t event_ = nullptr;
  std::optional<c10::cuda::CUDAStream> stream_;  // where Record() last recorded it
};

// An op on a stream not known to be done: an event recorded when it starts (its
// inputs ready, the ops before it done), one when done.
struct InFlight {
  std::shared_ptr<NcclEvent> start, done;
  std::string name;
  // When CheckInFlight() first saw it started (the default: not yet).
  std::chrono::steady_clock::time_point since{};
  int64_t seq = -1;  // its place among a backend's timed collectives (-1: not timed)
};

// Drops the done ops from the front of `ops` (oldest first), timing those with a
// sequence into *times (when given).
void DropDone(std::deque<InFlight>& ops, CollectiveTimes* times = nullptr);

// After DropDone: an error once the oldest op has run more than timeout_s (0: never)
// on GPU `device` since it started.
Status CheckInFlight(std::deque<InFlight>& ops, double timeout_s, int device,
                     CollectiveTimes* times = nullptr);

}  // namespace hvd
