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
};

// nullptr when this build has no GPU data plane. op_timeout_s: see Check() (0: none).
std::unique_ptr<GpuBackend> CreateGpuBackend(ControlPlane* control, int rank, int size,
                                             double op_timeout_s);
// NCCL_VERSION_CODE the build used, or 0.
int NcclVersionBuilt();

}  // namespace hvd
