// An in-memory ControlPlane: N ranks as threads of one process, for negotiation
// tests and the negotiation simulation (bench/negotiation_sim.cc) at hundreds or
// thousands of ranks, where a TCP mesh (N^2 sockets) would not fit.
//
// Semantics are those of the TCP plane: Gather delivers every rank's message to
// rank 0 only (others return once their message is deposited, as a buffered send
// would); Bcast delivers rank 0's message to every rank (rank 0 does not wait);
// Allgather gives every rank every rank's message and requires equal lengths.
// Every rank must issue the same sequence of calls; a rank that calls a different
// operation at the same position fails the world with a message naming both.
//
// Implementation: the k-th call of every rank meets in round k % kRounds of a small
// ring. A round has its own mutex and condition variable; a blocked rank sleeps on
// it (no spinning), so 1024 ranks run on two cores. A round is recycled once all N
// ranks have left it; a rank that gets kRounds calls ahead waits for that.
//
// Counters: each rank's plane counts its calls and the logical payload it sends
// and receives, as a direct point-to-point implementation would move it (one
// message per peer, no self-delivery): Gather: a member sends 1 message, rank 0
// receives N-1; Bcast: rank 0 sends N-1, each member receives 1; Allgather: every
// rank sends its message to N-1 peers and receives N-1. (A ring allgather moves
// the same bytes per rank, in N-1 sequential steps.)
//
// Threading: MemControlPlane r is used only by rank r's thread (stats() may be
// read by another thread once rank r's thread is idle, e.g. joined). Abort() may
// be called from any thread.
#pragma once

#include <array>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "transport/transport.h"

namespace hvd_test {

struct PlaneStats {
  int64_t gathers = 0, bcasts = 0, allgathers = 0, bit_allreduces = 0;  // calls
  int64_t msgs_sent = 0, msgs_recv = 0;
  int64_t bytes_sent = 0, bytes_recv = 0;
  PlaneStats operator-(const PlaneStats& o) const;
};

class MemWorld;

class MemControlPlane : public hvd::ControlPlane {
 public:
  MemControlPlane(MemWorld* world, int rank) : world_(world), rank_(rank) {}
  int rank() const override { return rank_; }
  int size() const override;
  hvd::Status Gather(const std::string& mine, std::vector<std::string>* all) override;
  hvd::Status Bcast(std::string* data) override;
  hvd::Status Allgather(const std::string& mine, std::vector<std::string>* all) override;
  // Through the Allgather machinery, but counted as recursive doubling moves it:
  // ceil(log2 N) messages of the vectors' size sent and received.
  hvd::Status AllreduceBits(std::vector<uint64_t>* and_bits,
                            std::vector<uint64_t>* or_bits) override;
  const PlaneStats& stats() const { return stats_; }

 private:
  MemWorld* world_;  // borrowed; owns this plane
  const int rank_;
  uint64_t seq_ = 0;  // calls made so far
  PlaneStats stats_;
};

class MemWorld {
 public:
  // `timeout_s`: a rank blocked longer than this in one call fails the world
  // (kAborted) instead of hanging.
  explicit MemWorld(int size, double timeout_s = 60);
  MemWorld(const MemWorld&) = delete;
  MemWorld& operator=(const MemWorld&) = delete;

  int size() const { return size_; }
  MemControlPlane* plane(int rank) { return planes_[rank].get(); }
  // Fails every blocked and future call with kAborted and `why`.
  void Abort(const std::string& why);

 private:
  friend class MemControlPlane;
  enum class Op { kNone, kGather, kBcast, kAllgather };
  struct Round {
    std::mutex mu;
    std::condition_variable cv;
    uint64_t seq = 0;      // the call number this round serves now    GUARDED_BY(mu)
    Op op = Op::kNone;     // set by the first rank to arrive          GUARDED_BY(mu)
    int op_rank = -1;      // that rank                                GUARDED_BY(mu)
    int arrived = 0;       // ranks whose message is in `slots`        GUARDED_BY(mu)
    int departed = 0;      // ranks done with this round               GUARDED_BY(mu)
    bool root_in = false;  // Bcast: rank 0's message is in slots[0]   GUARDED_BY(mu)
    // Written by rank r (slot r) before `arrived` counts it; read-only for every
    // rank once the round is complete, until the last rank departs.
    std::vector<std::string> slots;
  };
  static constexpr int kRounds = 4;

  // Waits (holding *lock on rd.mu) until rd serves `seq` and records `op`.
  hvd::Status Enter(Round& rd, std::unique_lock<std::mutex>* lock, uint64_t seq, Op op, int rank);
  // Waits for pred() on rd.cv; kAborted on abort or timeout.
  template <typename Pred>
  hvd::Status Wait(Round& rd, std::unique_lock<std::mutex>* lock, Pred pred, const char* what,
                   int rank, uint64_t seq);
  // Marks `rank` done with rd; the last one recycles it for seq + kRounds.
  void Depart(Round& rd);
  std::string Failure();

  const int size_;
  const double timeout_s_;
  std::array<Round, kRounds> rounds_;
  std::vector<std::unique_ptr<MemControlPlane>> planes_;
  std::atomic<bool> aborted_{false};
  std::mutex why_mu_;
  std::string why_;  // GUARDED_BY(why_mu_)
};

}  // namespace hvd_test
