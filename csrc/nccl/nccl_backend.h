// NCCL data plane for CUDA tensors (DESIGN.md §4).
//
// - One communicator per device, created on first use from a unique id that rank 0
//   sends over the control plane (every rank reaches that point at the same
//   response, so the creation is collective).
// - One dedicated stream per device. Each op's stream waits on the tensor's ready
//   event (recorded on the caller's stream at submission): no device-wide sync.
// - Fusion buffer on the device, allocated through PyTorch's caching allocator
//   with the fusion threshold in use (autotune's, when it runs) or the batch's
//   size if larger, and again only when a batch outgrows it; packing is one cat kernel,
//   unpacking one multi-tensor copy. A fused reduce-scatter packs into a fresh
//   buffer of the caching allocator (its parts are regrouped by rank), and its
//   outputs are copied out of this rank's part with one multi-tensor copy. For floating types the
//   prescale and a plain Average are folded into NCCL's reduction (a pre-multiplied sum, ncclAvg);
//   a postscale, and other types' factors, are one kernel over the fused buffer.
// - Completion: a done event recorded after the op completes the handle at once;
//   synchronize() makes the caller's stream wait on it. The background loop never
//   waits for the GPU; it only asks Busy() (is the oldest unfinished op moving
//   data?) to decide whether new allreduces should gather a while (DESIGN.md §8).
//
// Threading: see core/gpu_backend.h.
#pragma once

#include <c10/cuda/CUDAStream.h>
#include <nccl.h>

#include <deque>
#include <map>
#include <memory>
#include <vector>

#include "core/gpu_backend.h"

namespace hvd {

class NcclBackend : public GpuBackend {
 public:
  NcclBackend(ControlPlane* control, int rank, int size)
      : control_(control), rank_(rank), size_(size) {}
  ~NcclBackend() override;

  std::shared_ptr<GpuEvent> RecordReady(const at::Tensor& tensor) override;
  Status Execute(const std::vector<Response>& batch, std::vector<Entry>& entries,
                 size_t fusion_bytes) override;
  bool Busy() override;
  void Abort() override;

 private:
  struct Device {
    ncclComm_t comm = nullptr;
    c10::optional<c10::cuda::CUDAStream> stream;
    at::Tensor fusion;  // uint8, allocated on the first fused op
    // Ops on `stream` not known to be done, oldest first: an event recorded
    // when the op starts (inputs ready, the ops before it done), one when done.
    std::deque<std::pair<std::shared_ptr<GpuEvent>, std::shared_ptr<GpuEvent>>> in_flight;
  };
  Status Ensure(int device, Device** out);
  static void DropDone(Device& d);
  Status Allreduce(Device& d, const std::vector<Response>& batch, std::vector<Entry>& entries,
                   size_t fusion_bytes);
  Status Allgather(Device& d, const Response& r, Entry& e, at::Tensor* out);
  Status Broadcast(Device& d, const Response& r, Entry& e, at::Tensor* out);
  Status Alltoall(Device& d, const Response& r, Entry& e, at::Tensor* out, at::Tensor* splits);
  Status Reducescatter(Device& d, const std::vector<Response>& batch, std::vector<Entry>& entries,
                       std::vector<at::Tensor>* outs);
  // Reduces `buf` in place (count elements) with the response's op and scales.
  Status ReduceInPlace(Device& d, at::Tensor buf, const Response& r);

  ControlPlane* control_;  // borrowed from the Runtime
  int rank_;
  int size_;
  std::map<int, Device> devices_;  // background thread only
};

}  // namespace hvd
