// Internals of transport/shm (include only from shm*.cc and tests): the layout
// of the shared segment, the futex and process-liveness primitives, and the
// rendezvous that hands local rank 0's segment to the other local ranks.
//
// Segment layout (all offsets fixed by the local size and slot_bytes):
//   [0, kRanksOffset)        SegmentHeader
//   [kRanksOffset, ...)      one RankSlot per local rank, a cache line apart
//   [DataOffset(size), end)  kSets buffers, each of size * slot_bytes
// Every field that two processes touch concurrently is a lock-free std::atomic;
// plain fields are written before the segment is shared, or are ordered by the
// group's barrier.
#pragma once

#include <sys/types.h>

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>

#include "common/net.h"
#include "common/status.h"

namespace hvd {
namespace shm {

static_assert(std::atomic<uint32_t>::is_always_lock_free &&
                  std::atomic<int32_t>::is_always_lock_free &&
                  std::atomic<uint64_t>::is_always_lock_free,
              "the segment's atomics must be lock-free to work across processes");
static_assert(sizeof(std::atomic<uint32_t>) == sizeof(uint32_t), "futex word layout");

constexpr uint64_t kMagic = 0x31306d6873647668ull;  // "hvdshm01"
constexpr size_t kPage = 4096;
constexpr int kSets = 3;
constexpr size_t kRanksOffset = 1024;

enum RankState : uint32_t { kAbsent = 0, kJoined = 1, kLeft = 2 };
enum CallKind : uint64_t {
  kAllreduceCall = 1,
  kReduceScatterCall,
  kAllgatherCall,
  kBroadcastCall,
  kBarrierCall,
  kExchangeCall
};

// A collective as one rank called it; compared across ranks after the call's
// first barrier. `layout` hashes per-rank sizes.
struct Descriptor {
  uint64_t kind = 0, dtype = 0, op = 0, count = 0, root = 0, layout = 0;
  bool operator==(const Descriptor& o) const;
  std::string ToString() const;
};

struct SegmentHeader {
  uint64_t magic;
  uint32_t size;
  uint64_t slot_bytes;
  uint64_t bytes;
  // Whether the pids in RankSlot mean the same to every rank (one PID namespace).
  std::atomic<uint32_t> pid_checks;
  // The barrier: ranks count themselves in `arrived`; the last one resets it and
  // bumps `generation` (the futex word), which releases the others.
  alignas(64) std::atomic<uint32_t> arrived;
  alignas(64) std::atomic<uint32_t> generation;
  std::atomic<uint32_t> sleepers;  // ranks in (or about to enter) FUTEX_WAIT
  // Poison: set once, never cleared; the first poisoner writes the reason.
  alignas(64) std::atomic<uint32_t> poison;
  std::atomic<int32_t> poison_rank;
  std::atomic<uint32_t> poison_ready;
  char poison_msg[512];
};
static_assert(sizeof(SegmentHeader) <= kRanksOffset, "header overlaps the rank table");

// One per rank, written by that rank (by rank 0 during set-up).
struct alignas(64) RankSlot {
  std::atomic<int32_t> pid;
  std::atomic<uint32_t> state;  // RankState
  std::atomic<uint64_t> start_time;
  std::atomic<uint64_t> arrivals;  // barriers entered (names stragglers on a timeout)
  // Written before a call's first barrier, read by the others after it. Two,
  // alternating, so that a rank starting its next call cannot overwrite the one a
  // slower rank is still reading.
  Descriptor calls[2];
};

inline size_t RoundUp(size_t n, size_t to) { return (n + to - 1) / to * to; }
inline size_t DataOffset(int size) {
  return RoundUp(kRanksOffset + size * sizeof(RankSlot), kPage);
}
inline size_t SegmentBytes(int size, size_t slot_bytes) {
  return DataOffset(size) + kSets * size * slot_bytes;
}

// Shared (not _PRIVATE) futex operations: the word lives in a MAP_SHARED mapping
// that other processes map at other addresses.
void FutexWait(std::atomic<uint32_t>* word, uint32_t expected, std::chrono::nanoseconds d);
void FutexWake(std::atomic<uint32_t>* word);

// This process's start time (clock ticks after boot, /proc/self/stat), 0 if unknown.
uint64_t OwnStartTime();
// Whether `pid` has exited: gone, a zombie (its parent has not reaped it yet), or
// the number now names another process (a different start time; 0: unknown).
bool ProcessGone(pid_t pid, uint64_t start_time);

// Sets the poison flag (the first reason wins) and wakes every waiter.
void Poison(SegmentHeader* h, int rank, const std::string& why);

// The abstract unix socket name (without its leading '\0') for `key`.
std::string RendezvousName(const std::string& key);

// Local rank 0: listens on the key's abstract socket until local ranks
// 1..size-1 have connected, proved the secret (and had rank 0 prove it), and
// received `memfd`. `joined(rank, pid, same_pid_namespace)` runs for each before
// it gets the descriptor. Connections of other users are ignored; a wrong secret
// fails. The socket is closed on return.
Status ServeSegment(const std::string& key, const std::string& secret, int size, int memfd,
                    Clock::time_point deadline,
                    const std::function<void(int, pid_t, bool)>& joined);
// Local rank `rank` > 0: connects to local rank 0 (retrying until the deadline),
// authenticates both ways and receives the segment's descriptor in *memfd.
Status FetchSegment(const std::string& key, const std::string& secret, int rank,
                    Clock::time_point deadline, int* memfd);

}  // namespace shm
}  // namespace hvd
