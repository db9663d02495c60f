// The "hvd" backend's calls on CUDA tensors (c10d_backend.cc) when
// HOROVOD_C10D_CUDA_DIRECT is on: all-reduce, broadcast, all-gather into a tensor and
// reduce-scatter from one, each enqueued by the caller's thread, in the group's call
// order, on an NCCL communicator of the group's own (core/gpu_backend.h's DirectComm),
// as torch's NCCL process group does. Every rank of a group makes its calls in the
// same order, which is all NCCL needs; nothing is negotiated or fused.
//
// The communicator (one per device) is joined at the group's first such call: rank 0
// makes its id and broadcasts it as one of the group's engine calls, so every rank
// takes it at the same point of its order.
//
// Work.wait() makes the caller's current stream wait for the call's end (no host
// wait); its future is complete at once for consumers on the GPU. A failure of the
// engine (a peer lost, NCCL's asynchronous error, an op past HOROVOD_GPU_OP_TIMEOUT)
// aborts the communicator, which ends its kernels; wait() and later calls then raise.
#ifndef HOROVOD_TORCH_PYTHON_C10D_DIRECT_H_
#define HOROVOD_TORCH_PYTHON_C10D_DIRECT_H_

#include <torch/csrc/distributed/c10d/Work.hpp>

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "common/thread_annotations.h"
#include "core/gpu_backend.h"
#include "python/c10d_calls.h"
#include "python/module_state.h"

namespace hvd {

class C10dDirect {
 public:
  // `calls`: the group's engine calls (for the communicator's id); `process_set_id`:
  // the group's process set.
  C10dDirect(int rank, int size, int32_t process_set_id, C10dCalls* calls)
      : rank_(rank),
        size_(size),
        process_set_id_(process_set_id),
        calls_(calls),
        enabled_(C10dCudaDirect()) {}

  // Whether a call on `tensors` goes this way: the knob is on, there is NCCL, and
  // every tensor is a dense contiguous CUDA tensor of one device; with `op`, one that
  // NCCL reduces in the tensors' type.
  bool Takes(const std::vector<at::Tensor>& tensors, const ReduceOp* op);

  // One op of `kind` per tensor, in place.
  static std::vector<DirectOp> InPlace(DirectOp::Kind kind, const std::vector<at::Tensor>& tensors,
                                       ReduceOp op, int root);
  // Whether a call from inputs[i] into outputs[i] goes this way (Takes(), and each pair
  // of one type); if so, *ops gets one op of `kind` per pair.
  bool Pairs(DirectOp::Kind kind, const std::vector<at::Tensor>& inputs,
             const std::vector<at::Tensor>& outputs, const ReduceOp* op,
             std::vector<DirectOp>* ops);

  // Enqueues `ops` (one NCCL group) and returns the call's Work, whose value is `outputs`.
  c10::intrusive_ptr<c10d::Work> Run(c10d::OpType type, const char* what, std::vector<DirectOp> ops,
                                     std::vector<at::Tensor> outputs);

 private:
  std::shared_ptr<DirectComm> Comm(int device, const char* what) HVD_REQUIRES(mu_);

  const int rank_, size_;
  const int32_t process_set_id_;
  C10dCalls* calls_;    // the backend's
  const bool enabled_;  // the knob, read when the group was created
  Mutex mu_;            // one call at a time; every rank must enqueue in the same order
  std::map<int, std::shared_ptr<DirectComm>> comms_ HVD_GUARDED_BY(mu_);  // by device
};

}  // namespace hvd

#endif  // HOROVOD_TORCH_PYTHON_C10D_DIRECT_H_
