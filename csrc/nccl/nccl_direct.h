// DirectComm (core/gpu_backend.h) on NCCL: a communicator and a stream of its own on
// one device, for collectives their caller enqueues in its own order (the
// torch.distributed backend's calls on CUDA tensors, docs/torch_distributed.md), as
// torch's NCCL process group does. NcclBackend creates them (JoinComm), aborts them
// with its own communicators, and checks them from the background loop.
#pragma once

#include <c10/cuda/CUDAStream.h>
#include <nccl.h>

#include <atomic>
#include <deque>
#include <memory>
#include <string>
#include <vector>

#include "common/status.h"
#include "common/thread_annotations.h"
#include "core/gpu_backend.h"
#include "nccl/nccl_event.h"

namespace hvd {

// NCCL's asynchronous error on `comm` (GPU `device`) as a status.
Status AsyncError(ncclComm_t comm, int device);

class NcclDirect : public DirectComm {
 public:
  // Joins the communicator (blocks until every rank has); *status says if it failed.
  NcclDirect(const std::string& id, int rank, int size, int device, Status* status);
  ~NcclDirect() override;
  NcclDirect(const NcclDirect&) = delete;
  NcclDirect& operator=(const NcclDirect&) = delete;

  std::shared_ptr<GpuEvent> Enqueue(const std::vector<DirectOp>& ops,
                                    const std::string& name) override;
  std::string Broken() override;

  // From the engine's background loop: ends its kernels (after a peer was lost), and
  // NCCL's asynchronous error or an op that outlasted timeout_s.
  void Abort(const std::string& why);
  // The engine stops: unusable from now on (`why`); aborted when calls still run
  // `grace_s` later.
  void End(const std::string& why, double grace_s);
  Status Check(double timeout_s);

 private:
  void Fail(const std::string& why);

  const int device_;
  ncclComm_t comm_ = nullptr;  // set once, before any other thread sees this object
  c10::optional<c10::cuda::CUDAStream> stream_;
  std::atomic<bool> aborted_{false};
  std::atomic<int> users_{0};  // callers inside Enqueue()
  Mutex mu_;
  std::string broken_ HVD_GUARDED_BY(mu_);
  std::deque<InFlight> in_flight_ HVD_GUARDED_BY(mu_);  // oldest first
};

}  // namespace hvd
