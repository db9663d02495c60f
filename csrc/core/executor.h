// The data planes seen from the Runtime: an Executor runs one fused batch of
// negotiated responses and completes each entry's handle. Two implement it: the
// host executor (core/host_executor.h: CPU tensors over the TCP mesh, shared memory
// or MPI) and the GPU backend (core/gpu_backend.h, NCCL). Control ops (barrier,
// join, process-set changes) are the Runtime's own and never reach an executor.
#pragma once

#include <string>
#include <vector>

#include "common/status.h"
#include "core/entry.h"
#include "core/timeline.h"
#include "wire/message.h"

namespace hvd {

class Executor {
 public:
  virtual ~Executor() = default;
  // `batch`: allreduces of one dtype and op (fused), or one other collective;
  // entries[i] is batch[i]'s op. `fusion_bytes` is the fusion threshold in use
  // (autotune may change it): the size of a fusion buffer worth keeping.
  virtual Status Execute(const std::vector<Response>& batch, std::vector<Entry>& entries,
                         size_t fusion_bytes) = 0;
};

// A timeline span `activity` for each op of the batch (a no-op when `timeline` is
// null or not recording).
inline void TraceBatch(Timeline* timeline, const std::vector<Response>& batch,
                       const std::string& activity) {
  if (timeline == nullptr || !timeline->active()) return;
  for (const auto& r : batch) timeline->Activity(r.name, activity);
}

}  // namespace hvd
