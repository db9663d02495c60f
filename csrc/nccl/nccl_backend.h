// NCCL data plane for CUDA tensors (docs/design.md §8).
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
//   data?) to decide whether new allreduces should gather a while (docs/design.md §8).
// - Communicators of the torch.distributed backend's CUDA calls (nccl_direct.h) are
//   joined through JoinComm(), and aborted and checked with the backend's own.
// - Failure: Check() (every 100 ms from the loop) reports NCCL's asynchronous
//   error, or an op still running op_timeout_s after it started; the Runtime then
//   fails the engine and Abort()s the communicators, which ends their kernels.
//
// Threading: see core/gpu_backend.h.
#pragma once

#include <c10/cuda/CUDAStream.h>
#include <nccl.h>

#include <chrono>
#include <deque>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "common/thread_annotations.h"
#include "core/gpu_backend.h"
#include "nccl/nccl_direct.h"

namespace hvd {

class NcclBackend : public GpuBackend {
 public:
  // time_collectives: time each op on the GPU for the straggler report (Totals()).
  NcclBackend(ControlPlane* control, int rank, int size, double op_timeout_s, bool time_collectives)
      : control_(control),
        rank_(rank),
        size_(size),
        op_timeout_s_(op_timeout_s),
        time_collectives_(time_collectives) {}
  ~NcclBackend() override;

  std::shared_ptr<GpuEvent> RecordReady(const at::Tensor& tensor) override;
  Status Execute(const std::vector<Response>& batch, std::vector<Entry>& entries,
                 size_t fusion_bytes) override;
  bool Busy() override;
  void Abort() override;
  Status Check() override;
  void EndDirect(const std::string& why) override;
  void CollectiveTotals(uint64_t* ops, uint64_t* took_ns) override;
  void CompareTimes(bool on) override { compare_times_ = on; }
  std::string NewCommId() override;
  Status JoinComm(const std::string& id, int rank, int size, int device,
                  std::shared_ptr<DirectComm>* out) override;

 private:
  struct Device {
    ncclComm_t comm = nullptr;
    c10::optional<c10::cuda::CUDAStream> stream;
    at::Tensor fusion;               // uint8, allocated on the first fused op
    std::deque<InFlight> in_flight;  // oldest first
  };
  Status Ensure(int device, Device** out);
  // The DirectComms still in use (forgets the others).
  std::vector<std::shared_ptr<NcclDirect>> Directs();
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
  double op_timeout_s_;
  const bool time_collectives_;
  bool compare_times_ = true;      // background thread only
  uint64_t next_seq_ = 0;          // background thread only
  CollectiveTimes times_;          // background thread only
  std::map<int, Device> devices_;  // background thread only
  Mutex direct_mu_;
  std::vector<std::weak_ptr<NcclDirect>> direct_ HVD_GUARDED_BY(direct_mu_);  // JoinComm's
};

}  // namespace hvd
