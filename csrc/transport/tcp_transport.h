// TCP transport: a full mesh of authenticated sockets between the ranks of one
// communicator, set up through the rendezvous store.
//
// Algorithms (docs/design.md §transport):
//  - small allreduce / reducescatter: every rank sends its data to every peer and
//    reduces in rank order (one round trip: latency-optimal for small buffers);
//  - large allreduce / reducescatter: ring reduce-scatter (+ ring allgather),
//    chunk-pipelined so the reduction of one chunk overlaps the arrival of the next;
//  - allgather, alltoall, broadcast: direct exchanges driven concurrently by poll().
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "common/net.h"
#include "rendezvous/store.h"
#include "transport/transport.h"

namespace hvd {

struct TcpOptions {
  double connect_timeout_s = 30;   // rendezvous and connection set-up
  double io_timeout_s = 60;        // a peer making no progress this long is lost
  size_t small_allreduce_bytes = 64 * 1024;
  size_t ring_chunk_bytes = 256 * 1024;
};

class TcpTransport : public Communicator {
 public:
  // Rendezvous under `prefix` in the store, then connect to every peer.
  static Status Create(StoreClient* store, const std::string& prefix, int rank, int size,
                       const std::string& secret, const TcpOptions& options,
                       std::unique_ptr<TcpTransport>* out);

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  Status Gather(const std::string& mine, std::vector<std::string>* all) override;
  Status Bcast(std::string* data) override;
  Status Allgather(const std::string& mine, std::vector<std::string>* all) override;

  Status Allreduce(void* buf, size_t count, DataType dtype, ReduceOp op) override;
  Status Allgatherv(const void* send, void* recv, const std::vector<size_t>& bytes) override;
  Status Broadcast(void* buf, size_t bytes, int root) override;
  Status Alltoallv(const void* send, const std::vector<size_t>& send_bytes, void* recv,
                   const std::vector<size_t>& recv_bytes) override;
  Status Reducescatter(void* buf, const std::vector<size_t>& counts, DataType dtype,
                       ReduceOp op, void* out) override;
  // Aborts every socket of the mesh, including those of subset views.
  void Abort() override;

  // A communicator over `members` (ranks of this one, ascending) that shares this
  // mesh's sockets, numbered 0..members.size()-1; null if this rank is not a
  // member. Views and their parent must be used by the same single thread, and
  // every member must run the same sequence of operations on the shared sockets.
  std::unique_ptr<TcpTransport> SubsetView(const std::vector<int>& members) const;
  Status Subset(const std::vector<int>& members, std::unique_ptr<Communicator>* out) override {
    *out = SubsetView(members);
    return Status::Ok();
  }
  const char* name() const override { return "TCP"; }
  // The rank of the mesh this communicator was cut from.
  int global_rank(int r) const { return global_[r]; }

 private:
  // One transfer to or from a peer. Transfers to the same peer in the same
  // direction run in the order given; everything else runs concurrently.
  struct Xfer {
    int peer;
    bool send;
    char* buf;
    size_t len;
    std::function<void()> on_done;  // optional, runs when the transfer completes
    size_t done = 0;
  };
  Status Run(std::vector<Xfer>& xfers);

  Status DirectReduce(void* buf, const std::vector<size_t>& counts, DataType dtype,
                      ReduceOp op, void* out, bool all);
  Status RingReduceScatter(char* buf, const std::vector<size_t>& offsets,
                           const std::vector<size_t>& counts, DataType dtype, ReduceOp op);
  Status RingAllgather(char* buf, const std::vector<size_t>& offsets,
                       const std::vector<size_t>& bytes);

  TcpTransport(int rank, int size, TcpOptions options)
      : rank_(rank), size_(size), options_(options),
        sockets_(std::make_shared<std::vector<Socket>>(size)), global_(size) {
    for (int r = 0; r < size; ++r) global_[r] = r;
  }
  Socket& Peer(int r) { return (*sockets_)[global_[r]]; }

  int rank_;
  int size_;
  TcpOptions options_;
  // The whole mesh's sockets, by mesh rank (own entry unused); shared with views.
  std::shared_ptr<std::vector<Socket>> sockets_;
  std::vector<int> global_;  // this communicator's rank -> mesh rank
  std::vector<char> scratch_;
};

}  // namespace hvd
