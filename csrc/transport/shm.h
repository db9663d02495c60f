// Shared-memory collectives among the ranks of one host (the "local" ranks).
//
// Set-up: local rank 0 creates an anonymous memfd segment (no name in any file
// system, so a crash cannot leave it behind), maps it, and hands its descriptor to
// the other local ranks (SCM_RIGHTS) over a Linux abstract unix socket whose name
// is derived from `key` (abstract names vanish with their socket). Both ends check
// that the peer runs as the same user and prove the job secret to each other. The
// listening socket is closed as soon as every local rank holds the segment.
//
// Data: the segment holds three buffers of `size` slots of `slot_bytes`, used in
// rotation by a pipeline with one barrier per step: while one buffer is being
// filled, the previous one is being reduced and the one before is being copied
// out. Reductions are element-wise in local-rank order (hvd::ReduceInto), each
// element computed once by one rank, so every local rank gets identical bits.
//
// Hierarchical allreduce composes as: ReduceScatter(buf, counts) locally, an
// allreduce of this rank's segment across hosts, then Allgather(buf, bytes of
// counts) locally. Linux only (memfd_create, abstract sockets, futex).
//
// Threading: a ShmGroup is used by one thread at a time (collectives are called
// in the same order on every local rank), except Abort(), which any thread may
// call. Groups with different keys are independent, also within one process.
// Ownership: buffers are borrowed for the duration of a call; the group owns its
// mapping and unmaps it on destruction (the memory is freed when the last local
// rank unmaps or exits).
// Errors: every wait is bounded by timeout_s and watches the other local ranks: a
// rank that died, left (destroyed its group) or timed out, or an Abort(), makes
// every blocked or later call on every local rank return kAborted (the segment
// carries a poison flag and the first reason). kInvalidArgument: bad arguments on
// this rank. kMismatch: the local ranks called different collectives or passed
// different sizes (every rank gets it and the group stays usable).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "common/status.h"
#include "common/types.h"

namespace hvd {
namespace shm {
struct Descriptor;
struct SegmentHeader;
struct RankSlot;
class Helpers;
}  // namespace shm

struct ShmOptions {
  // Bytes each rank moves through the segment per pipeline step (rounded up to a
  // multiple of 4096). The segment takes about 3 * local_size * slot_bytes.
  size_t slot_bytes = 1 << 20;
  // Longest wait, in set-up or in any collective, for the other local ranks.
  double timeout_s = 60;
  // Busy-wait before sleeping in the kernel (futex) while waiting for the other
  // local ranks; negative: automatic (spin only if there are no more local ranks
  // than CPUs this process may run on).
  double spin_us = -1;
  // Threads that copy and reduce one pipeline step together (this rank's thread
  // and helpers): one core's memory bandwidth bounds a copy, and idle cores
  // multiply it. Used for steps of 256 KiB and more. Negative: automatic
  // (CPUs this process may run on / (2 * local ranks), at most 4).
  int threads = -1;
  // The least bytes one thread takes of a step (tests lower it).
  size_t min_part_bytes = 128 << 10;
};

class ShmGroup {
 public:
  // Collective over the `size` local ranks (rank in [0, size)), which pass the
  // same key, secret and options. `key` names the group on this host (two live
  // groups with the same key on one host are an error); it should be unique to
  // the job and its generation, e.g. "<job id>/<generation>/<host>".
  static Status Create(const std::string& key, const std::string& secret, int rank, int size,
                       const ShmOptions& options, std::unique_ptr<ShmGroup>* out);
  ~ShmGroup();
  ShmGroup(const ShmGroup&) = delete;
  ShmGroup& operator=(const ShmGroup&) = delete;

  // The abstract unix socket name (without its leading '\0') that the group of
  // `key` uses while it is being set up; /proc/net/unix shows it as "@<name>".
  static std::string RendezvousName(const std::string& key);

  int rank() const { return rank_; }
  int size() const { return size_; }

  // In place: buf holds this rank's `count` elements, then their reduction over
  // the local ranks. `op`: Sum, Min, Max or Product (Average: Sum, then scale).
  Status Allreduce(void* buf, size_t count, DataType dtype, ReduceOp op);
  // buf holds sum(counts) elements (counts has size() entries). On return this
  // rank's segment (counts[rank] elements at offset sum(counts[0..rank))) holds
  // the reduction of that segment over the local ranks; the rest of buf is
  // unchanged.
  Status ReduceScatter(void* buf, const std::vector<size_t>& counts, DataType dtype, ReduceOp op);
  // In place: rank r's bytes[r] bytes lie at offset sum(bytes[0..r)) of buf; on
  // return every rank's buf holds every rank's bytes.
  Status Allgather(void* buf, const std::vector<size_t>& bytes);
  // root's `bytes` bytes of buf reach every local rank's buf.
  Status Broadcast(void* buf, size_t bytes, int root);
  Status Barrier();
  // Small messages of any length (the control plane): every local rank calls it
  // with the same `tag`. A rank with `mine` non-null contributes it; a rank with
  // `all` non-null receives every rank's message by local rank ("" from ranks that
  // contribute none). One barrier per slot_bytes of the longest message.
  Status Exchange(uint64_t tag, const std::string* mine, std::vector<std::string>* all);
  // Any thread, any time before destruction: fails blocked and later calls on
  // every local rank with kAborted.
  void Abort();

 private:
  ShmGroup(int rank, int size, const ShmOptions& options, char* base, size_t bytes);

  // Ready(): the sticky failure, or the poison, if any (checked before a call).
  // Finish(st): makes a kAborted result sticky and returns it.
  Status Ready();
  Status Finish(Status st);
  // The pipelines behind the collectives (see shm.cc).
  Status ReducePipeline(const shm::Descriptor& d, char* buf, size_t out_begin, size_t out_end);
  // Runs fn(part, parts) for every part of a step of `bytes`, on this thread and
  // helpers (as many parts as options_.threads and the size allow).
  template <typename Fn>
  void Parallel(size_t bytes, const Fn& fn);
  Status CopyPipeline(const shm::Descriptor& d, char* buf, size_t mine_begin, size_t mine_end);
  // The first barrier of a collective: publishes this rank's call, waits for every
  // local rank, and checks that they all made the same one.
  Status FirstSync(const shm::Descriptor& d);
  // The barrier: every local rank arrives, then all proceed. Bounded; watches peers.
  Status Sync();
  Status WaitGeneration(uint32_t seen);
  // The first reason why a peer is gone, or "" if all look alive.
  std::string CheckPeers() const;
  void Poison(const std::string& why);
  Status PoisonStatus() const;
  // Buffer `set` (taken modulo 3) as a whole, and rank r's slot in it.
  char* Set(uint64_t set) const;
  char* Slot(uint64_t set, int r) const { return Set(set) + r * options_.slot_bytes; }

  const int rank_;
  const int size_;
  const ShmOptions options_;
  char* const base_;    // the mapping
  const size_t bytes_;  // its length
  shm::SegmentHeader* const header_;
  shm::RankSlot* const ranks_;             // size_ entries
  char* const data_;                       // the three buffers
  uint64_t next_set_ = 0;                  // rotation of the buffers (the same on every rank)
  uint64_t calls_ = 0;                     // collectives begun (selects the descriptor slot)
  int64_t spin_ns_ = 0;                    // busy-wait before a futex sleep
  int threads_ = 1;                        // options_.threads resolved
  std::unique_ptr<shm::Helpers> helpers_;  // created on the first step that uses them
  Status failed_;                          // sticky: once a call failed with kAborted, all do
};

}  // namespace hvd
