// The host executor: a fused batch of CPU ops run over one communicator (the TCP
// mesh, shared memory or MPI). Allreduces and reduce-scatters are packed into the
// fusion buffer, reduced once and unpacked; the other collectives run one at a time.
//
// Threading: the Runtime's background thread only.
#pragma once

#include <vector>

#include "core/executor.h"
#include "transport/transport.h"

namespace hvd {

class HostExecutor : public Executor {
 public:
  // `comm`, `fusion_buffer` and `timeline` (null: no spans) are borrowed; one
  // fusion buffer serves every process set's executor.
  HostExecutor(Communicator* comm, std::vector<char>* fusion_buffer, Timeline* timeline)
      : comm_(comm), fusion_buffer_(fusion_buffer), timeline_(timeline) {}

  Status Execute(const std::vector<Response>& batch, std::vector<Entry>& entries,
                 size_t fusion_bytes) override;

 private:
  Status Allreduce(const std::vector<Response>& batch, std::vector<Entry>& entries);
  Status Reducescatter(const std::vector<Response>& batch, std::vector<Entry>& entries);
  // Broadcast, allgather or alltoall: batch holds the one op.
  Status RunOne(const std::vector<Response>& batch, Entry& e);
  void TraceCollective(const std::vector<Response>& batch, size_t bytes);
  char* Buffer(size_t bytes);

  Communicator* comm_;
  std::vector<char>* fusion_buffer_;
  Timeline* timeline_;
};

}  // namespace hvd
