// The GPU data plane seen from the core: an Executor (core/executor.h) with no CUDA
// or NCCL types, so the core compiles the same with or without them (docs/design.md
// §2). The one implementation, csrc/nccl/, is compiled only when CUDA and NCCL are
// found; the build then links csrc/nccl/registry.cc instead of csrc/nccl/no_nccl.cc,
// and CreateGpuBackend() returns it.
//
// Threading: RecordReady() runs on the submitting Python thread; Execute() and
// Abort() on the Runtime's background thread; GpuEvent methods on Python threads.
#pragma once

#include <ATen/ATen.h>

#include <memory>
#include <string>
#include <vector>

#include "core/entry.h"
#include "core/executor.h"
#include "transport/transport.h"
#include "wire/message.h"

namespace hvd {

// A collective its caller enqueues itself (the torch.distributed backend's calls on CUDA
// tensors, docs/torch_distributed.md): no negotiation, no fusion; every rank of the
// communicator enqueues the same ops in the same order.
struct DirectOp {
  enum class Kind { kAllreduce, kBroadcast, kAllgather, kReducescatter };
  Kind kind = Kind::kAllreduce;
  at::Tensor input;              // contiguous, on the communicator's device
  at::Tensor output;             // may be `input` (in place), or hold it (an all-gather in place)
  ReduceOp op = ReduceOp::kSum;  // a reduction's; Average only for floating types
  int root = 0;                  // a broadcast's
};

// A communicator of its own for DirectOps, on one device, with its own stream.
// Threading: Enqueue() from one caller at a time; Abort() from any thread.
class DirectComm {
 public:
  virtual ~DirectComm() = default;
  // Enqueues `ops` as one group on the communicator's stream, after the work already
  // on the caller's current stream of the device, and returns an event that follows
  // them. Throws std::runtime_error (also once the communicator was aborted).
  virtual std::shared_ptr<GpuEvent> Enqueue(const std::vector<DirectOp>& ops,
                                            const std::string& name) = 0;
  // Why the communicator is unusable ("" while it is usable).
  virtual std::string Broken() = 0;
};

// Whether a DirectOp can reduce tensors of type t with op (NCCL's own types).
bool DirectReducible(at::ScalarType t, ReduceOp op);

// Execute() enqueues the batch on the backend's stream and completes the entries'
// handles with a done event; it does not wait for the GPU.
class GpuBackend : public Executor {
 public:
  // Marks "tensor is ready" on the caller's current CUDA stream.
  virtual std::shared_ptr<GpuEvent> RecordReady(const at::Tensor& tensor) = 0;
  // True while a collective this backend enqueued is moving data on the GPU.
  virtual bool Busy() = 0;
  // Aborts communicators after a peer was lost, so no GPU work waits forever.
  virtual void Abort() = 0;
  // A failure of the data plane that no op reported: NCCL's asynchronous error, or
  // the oldest op still running op_timeout_s after it started (a peer's GPU never
  // joined it). Cheap enough for every few cycles.
  virtual Status Check() = 0;
  // The engine stops after a negotiated shutdown: every DirectComm becomes unusable
  // (`why`), and one whose calls still run a second later is aborted (a peer that shut
  // down will not join them, and Check() runs no more).
  virtual void EndDirect(const std::string& why) = 0;
  // The straggler report's GPU signal (core/straggler.h): of this backend's
  // collectives, in the order they were executed, the first *ops are complete and ran
  // *took_ns on the GPU in total, each from its start (its inputs ready, the ops before
  // it done) to its end. Zero when the backend does not time them.
  virtual void CollectiveTotals(uint64_t* ops, uint64_t* took_ns) = 0;
  // Whether the next ops' times are comparable across ranks (the runtime says so per
  // cycle, the same on every rank): not while a rank that joined runs them with zeros.
  // Only allreduces are timed: every rank's share of their work is equal.
  virtual void CompareTimes(bool on) = 0;
  // A unique id for a new DirectComm, made by its rank 0 and handed to the others.
  virtual std::string NewCommId() = 0;
  // Joins the DirectComm of `size` ranks that rank 0's `id` names, as `rank`, on
  // `device`; blocks until every rank has joined. Abort() aborts it too, and Check()
  // reports its asynchronous errors and ops that outlast op_timeout_s.
  virtual Status JoinComm(const std::string& id, int rank, int size, int device,
                          std::shared_ptr<DirectComm>* out) = 0;
};

// nullptr when this build has no GPU data plane. op_timeout_s: see Check() (0: none);
// time_collectives: see CollectiveTotals().
std::unique_ptr<GpuBackend> CreateGpuBackend(ControlPlane* control, int rank, int size,
                                             double op_timeout_s, bool time_collectives);
// NCCL_VERSION_CODE the build used, or 0.
int NcclVersionBuilt();

}  // namespace hvd
