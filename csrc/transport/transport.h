// The two interfaces a transport implements for one communicator (a fixed group of
// ranks numbered 0..size-1):
//   ControlPlane: small negotiation messages between rank 0 (coordinator) and the rest.
//   Collectives:  the data plane on host memory.
//
// Threading: an instance is used by exactly one thread, the Runtime's background
// thread, except Abort(), which any thread may call to wake a blocked operation.
// Ownership: buffers are borrowed for the duration of a call.
// Errors: any I/O failure or silent peer returns Status kAborted; the transport is
// then unusable and must be rebuilt (a reset).
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "common/status.h"
#include "common/types.h"
#include "wire/message.h"

namespace hvd {

class ControlPlane {
 public:
  virtual ~ControlPlane() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  // Rank 0 receives every rank's `mine` in *all (indexed by rank); others send.
  virtual Status Gather(const std::string& mine, std::vector<std::string>* all) = 0;
  // Rank 0's *data reaches every rank.
  virtual Status Bcast(std::string* data) = 0;
  // Every rank gets every rank's `mine` (indexed by rank) in one exchange; all
  // ranks pass messages of the same length.
  virtual Status Allgather(const std::string& mine, std::vector<std::string>* all) = 0;
  // Every rank ends with the AND over ranks of *and_bits and the OR of *or_bits
  // (each vector the same length on every rank). The steady-state negotiation of
  // many ranks uses it; this default goes through Allgather.
  virtual Status AllreduceBits(std::vector<uint64_t>* and_bits, std::vector<uint64_t>* or_bits);
};

inline Status ControlPlane::AllreduceBits(std::vector<uint64_t>* and_bits,
                                          std::vector<uint64_t>* or_bits) {
  const size_t na = and_bits->size(), no = or_bits->size();
  std::string mine((na + no) * 8, '\0');
  std::memcpy(&mine[0], and_bits->data(), na * 8);
  std::memcpy(&mine[na * 8], or_bits->data(), no * 8);
  std::vector<std::string> all;
  HVD_RETURN_IF_ERROR(Allgather(mine, &all));
  for (size_t r = 0; r < all.size(); ++r) {
    if (all[r].size() != mine.size()) {
      return Status::Aborted("rank " + std::to_string(r) + " sent a bit vector of another length");
    }
    for (size_t i = 0; i < na + no; ++i) {
      uint64_t w;
      std::memcpy(&w, all[r].data() + i * 8, 8);
      if (i < na) {
        (*and_bits)[i] &= w;
      } else {
        (*or_bits)[i - na] |= w;
      }
    }
  }
  return Status::Ok();
}

class Collectives {
 public:
  virtual ~Collectives() = default;
  // In place: buf holds this rank's `count` elements, then the reduction over ranks.
  // Every rank gets bitwise identical results. `op`: Sum, Min, Max or Product.
  virtual Status Allreduce(void* buf, size_t count, DataType dtype, ReduceOp op) = 0;
  // recv gets every rank's block in rank order; bytes[r] is rank r's block size.
  virtual Status Allgatherv(const void* send, void* recv, const std::vector<size_t>& bytes) = 0;
  virtual Status Broadcast(void* buf, size_t bytes, int root) = 0;
  // Point to point: rank `from` sends `bytes` of buf to rank `to`, which receives them
  // into buf; only these two ranks call it.
  virtual Status Transfer(void* buf, size_t bytes, int from, int to) = 0;
  // send holds send_bytes[r] bytes for each rank r in order; recv gets recv_bytes[r]
  // bytes from each rank r in order.
  virtual Status Alltoallv(const void* send, const std::vector<size_t>& send_bytes, void* recv,
                           const std::vector<size_t>& recv_bytes) = 0;
  // buf holds sum(counts) elements of this rank (it is used as scratch); out gets the
  // reduction of segment `rank` (counts[rank] elements).
  virtual Status Reducescatter(void* buf, const std::vector<size_t>& counts, DataType dtype,
                               ReduceOp op, void* out) = 0;
  // Wakes and fails any blocked call (used when shutting down after an error).
  virtual void Abort() = 0;
};

// Both planes for one fixed group of ranks: the TCP mesh (TcpTransport) or an MPI
// communicator (csrc/mpi).
class Communicator : public ControlPlane, public Collectives {
 public:
  // A communicator over `members` (ranks of this one, ascending); *out is null when
  // this rank is not a member. Every rank of this communicator calls it at the same
  // point of its op sequence (MPI creates sub-communicators collectively).
  virtual Status Subset(const std::vector<int>& members, std::unique_ptr<Communicator>* out) = 0;
  // "TCP" or "MPI": the transport.
  virtual const char* name() const = 0;
  // The path a collective of `op` over `bytes` (a control op: bytes 0) takes, which
  // names it in the timeline ("<path>_<OP>", e.g. SHM_ALLREDUCE): "SHM" when it runs
  // entirely in a host's shared memory, "SHM_TCP" when hierarchical (shared memory
  // within each host, TCP across hosts), else the transport's name ("TCP", "MPI").
  virtual const char* PathName(OpType op, size_t bytes) const { return name(); }
};

}  // namespace hvd
