// TCP transport: authenticated sockets between the ranks of one communicator, found
// through the rendezvous store and opened lazily, only between ranks an algorithm
// pairs up. With the algorithms below a rank talks to O(log n) peers (alltoall is
// the exception: it needs every pair).
//
// Algorithms (docs/design.md §4 for the control plane, §7 for the collectives):
//  - control plane: Gather / Bcast along a binomial tree rooted at rank 0; Allgather
//    by Bruck's algorithm. Both take ceil(log2 n) rounds.
//  - small allreduce / reducescatter: up to 4 ranks, one direct exchange; beyond,
//    recursive doubling (log2 n rounds, reduced lower rank first so every rank gets
//    bitwise identical results).
//  - large allreduce / reducescatter: ring reduce-scatter (+ ring allgather),
//    chunk-pipelined so the reduction of one chunk overlaps the arrival of the next.
//  - allgather: Bruck (log n rounds, each byte received once); broadcast: binomial
//    tree (small) or binomial scatter + Bruck allgather (large); alltoall: direct.
//  - hierarchical (the whole mesh only, not subset views; TcpOptions): ranks of one
//    host share a memory segment (ShmGroup). On one host, allreduce, reducescatter,
//    allgather and broadcast run through it; across hosts with equal rank counts,
//    allreduce is a local reduce-scatter, an allreduce of each share among the
//    ranks with the same local index, and a local allgather; allgather is an
//    allgather among the ranks with the same local index, then a local allgather
//    of what they collected. On one host the control plane runs through the
//    segment too (TcpOptions::shm_control).
//
// Connections: the higher rank of a pair connects, the lower accepts. A Run()
// first connects to the lower-ranked peers it needs (blocking, bounded), and while
// it waits for data it also accepts and authenticates (without blocking) whoever
// connects to it. A connecting rank therefore waits only while the lower rank is
// busy outside Run(), which always ends: no connection deadlock.
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
  double connect_timeout_s = 30;  // rendezvous and connection set-up
  double io_timeout_s = 60;       // a peer making no progress this long is lost
  size_t small_allreduce_bytes = 64 * 1024;
  size_t ring_chunk_bytes = 256 * 1024;
  // Shared memory among the ranks of a host (see config.h): -1 auto, 1 always, 0
  // never (the default here; the runtime passes its knobs).
  int hierarchical_allreduce = 0;
  int hierarchical_allgather = 0;
  // With a shared-memory group and every rank on one host, the control plane
  // (Gather, Bcast, Allgather, AllreduceBits) runs through the segment: a barrier
  // instead of TCP round trips. 0: TCP always.
  int shm_control = 1;
  // Threads per rank for shared-memory steps (ShmOptions::threads; -1: automatic).
  int shm_threads = -1;
  // Which host this rank is on; empty: detected (boot id and network namespace).
  // Tests set it to make threads of one process look like several hosts.
  std::string host_key;
  // Settings every rank must share (Config::ProtocolSettings): rank 0 compares them
  // in the start-up barrier, and every rank fails init() with the difference.
  std::string settings;
};

class ShmGroup;

class TcpTransport : public Communicator {
 public:
  // Publishes this rank's address under `prefix` in the store and waits (a tree
  // barrier) until every rank has. `store` is borrowed and must outlive the
  // transport and its views.
  static Status Create(StoreClient* store, const std::string& prefix, int rank, int size,
                       const std::string& secret, const TcpOptions& options,
                       std::unique_ptr<TcpTransport>* out);
  ~TcpTransport() override;

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  Status Gather(const std::string& mine, std::vector<std::string>* all) override;
  Status Bcast(std::string* data) override;
  Status Allgather(const std::string& mine, std::vector<std::string>* all) override;
  // Recursive doubling: ceil(log2 n) rounds of the vectors' size, whatever n.
  Status AllreduceBits(std::vector<uint64_t>* and_bits, std::vector<uint64_t>* or_bits) override;

  Status Allreduce(void* buf, size_t count, DataType dtype, ReduceOp op) override;
  Status Allgatherv(const void* send, void* recv, const std::vector<size_t>& bytes) override;
  Status Broadcast(void* buf, size_t bytes, int root) override;
  Status Transfer(void* buf, size_t bytes, int from, int to) override;
  Status Alltoallv(const void* send, const std::vector<size_t>& send_bytes, void* recv,
                   const std::vector<size_t>& recv_bytes) override;
  Status Reducescatter(void* buf, const std::vector<size_t>& counts, DataType dtype, ReduceOp op,
                       void* out) override;
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
  const char* PathName(OpType op, size_t bytes) const override;
  // The rank of the mesh this communicator was cut from.
  int global_rank(int r) const { return global_[r]; }
  // Sockets this process holds open to peers (for tests and the scale benchmark).
  int open_connections() const;
  // Ranks of this communicator sharing memory with this one (itself included);
  // empty when no shared-memory group was set up.
  const std::vector<int>& local_ranks() const { return local_ranks_; }

 private:
  struct Mesh;  // sockets by mesh rank, the listener, handshakes in progress

  // One transfer to or from a peer (a rank of this communicator). Transfers to the
  // same peer in the same direction run in the order given; everything else runs
  // concurrently.
  struct Xfer {
    int peer;
    bool send;
    char* buf;
    size_t len;
    std::function<void()> on_done;  // optional, runs when the transfer completes
    size_t done = 0;
  };
  Status Run(std::vector<Xfer>& xfers);
  // Connects to the lower-ranked peers among `peers` that have no socket yet.
  Status ConnectLower(const std::vector<int>& peers);

  // Blocks [first, first+count) (indices mod size_, in a virtual rank order where
  // v holds block v and real rank = (v + root) % size_) as transfers with `peer`.
  void AddBlocks(std::vector<Xfer>* xs, int peer, bool send, char* buf,
                 const std::vector<size_t>& offsets, const std::vector<size_t>& bytes, int first,
                 int count);
  Status BruckAllgather(char* buf, const std::vector<size_t>& offsets,
                        const std::vector<size_t>& bytes, int root);
  Status TreeBroadcast(char* buf, size_t bytes, int root);
  Status TreeScatter(char* buf, const std::vector<size_t>& offsets,
                     const std::vector<size_t>& bytes, int root);
  Status DirectReduce(void* buf, const std::vector<size_t>& counts, DataType dtype, ReduceOp op,
                      void* out, bool all);
  // reduce(dst, src) sets dst = op(dst, src) over `bytes`; it is always called with
  // the lower rank's data in dst, so results are identical on every rank.
  Status RecursiveDoubling(char* buf, size_t bytes,
                           const std::function<void(char*, const char*)>& reduce);
  Status RingReduceScatter(char* buf, const std::vector<size_t>& offsets,
                           const std::vector<size_t>& counts, DataType dtype, ReduceOp op);
  Status RingAllgather(char* buf, const std::vector<size_t>& offsets,
                       const std::vector<size_t>& bytes);

  // Hierarchy: which ranks share a host, the shared-memory group and the cross view.
  Status SetUpHierarchy(const std::string& secret, const std::string& prefix);
  // How a collective runs: over TCP only, entirely in the shared segment (one host),
  // or hierarchically (the segment within each host, TCP across hosts). The one
  // predicate both the collectives and PathName (the timeline) go by.
  enum class Path { kTcp, kShm, kHier };
  Path PathOf(OpType op, size_t bytes) const;
  bool ShmControl() const { return local_ && one_host_ && options_.shm_control != 0; }
  void TendListener();
  Status HierarchicalAllreduce(char* buf, size_t count, DataType dtype, ReduceOp op);
  Status HierarchicalAllgather(char* out, const std::vector<size_t>& off,
                               const std::vector<size_t>& bytes);

  TcpTransport(int rank, int size, TcpOptions options, std::shared_ptr<Mesh> mesh);
  int Fd(int r) const;

  int rank_;
  int size_;
  TcpOptions options_;
  std::shared_ptr<Mesh> mesh_;  // shared with views
  std::vector<int> global_;     // this communicator's rank -> mesh rank
  std::vector<char> scratch_;
  std::vector<int> local_ranks_;
  std::unique_ptr<ShmGroup> local_;      // null: no rank shares this host, or disabled
  std::unique_ptr<TcpTransport> cross_;  // null: one host, or hosts of unequal size
  // With cross_: for each local index j, the ranks with local index j on every host.
  std::vector<std::vector<int>> cross_groups_;
  bool one_host_ = false;
};

}  // namespace hvd
