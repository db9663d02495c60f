#include "transport/shm.h"

#include <fcntl.h>
#include <sched.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <functional>
#include <new>
#include <system_error>
#include <thread>

#include "common/logging.h"
#include "common/net.h"
#include "common/thread_annotations.h"
#include "transport/shm_helpers.h"
#include "transport/shm_segment.h"

namespace hvd {

using namespace shm;  // NOLINT: this file implements the segment's protocol

namespace {

constexpr int kMaxThreads = 64;  // HOROVOD_SHM_THREADS above this is taken as this
// How often a sleeping waiter wakes up to look at its peers and the clock.
constexpr auto kTick = std::chrono::milliseconds(50);

std::string Secs(double s) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.3g s", s);
  return buf;
}

// Maps the whole segment of `memfd`, page tables filled up front.
char* MapSegment(int memfd, size_t bytes) {
  void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, memfd, 0);
  return p == MAP_FAILED ? nullptr : static_cast<char*>(p);
}

}  // namespace

ShmGroup::ShmGroup(int rank, int size, const ShmOptions& options, char* base, size_t bytes)
    : rank_(rank),
      size_(size),
      options_(options),
      base_(base),
      bytes_(bytes),
      header_(reinterpret_cast<SegmentHeader*>(base)),
      ranks_(reinterpret_cast<RankSlot*>(base + kRanksOffset)),
      data_(base + DataOffset(size)) {
  if (options_.spin_us >= 0) {
    spin_ns_ = static_cast<int64_t>(options_.spin_us * 1000);
  } else {
    // Spinning only pays when every rank has a CPU to spin on.
    cpu_set_t set;
    int cpus = ::sched_getaffinity(0, sizeof(set), &set) == 0 ? CPU_COUNT(&set) : 1;
    spin_ns_ = size_ <= cpus ? 50000 : 0;
  }
  if (options_.threads >= 1) {
    threads_ = std::min(options_.threads, kMaxThreads);
  } else {
    cpu_set_t set;
    int cpus = ::sched_getaffinity(0, sizeof(set), &set) == 0 ? CPU_COUNT(&set) : 1;
    // Half the CPUs per local rank: each rank also has its Python thread and
    // waits that spin, and oversubscribed helpers cost far more than they save.
    threads_ = std::clamp(cpus / (2 * size_), 1, 4);
  }
}

ShmGroup::~ShmGroup() {
  // Others blocked on this rank learn at once that it is gone, not at a timeout.
  ranks_[rank_].state.store(kLeft);
  FutexWake(&header_->generation);
  ::munmap(base_, bytes_);
}

std::string ShmGroup::RendezvousName(const std::string& key) { return shm::RendezvousName(key); }

char* ShmGroup::Set(uint64_t set) const {
  return data_ + (set % kSets) * size_ * options_.slot_bytes;
}

// Local rank 0 creates, sizes, seals and maps the segment, then hands it out;
// the others fetch and map it. Then each registers (pid, start time) and all meet
// in a first barrier, after which every wait watches the others.
Status ShmGroup::Create(const std::string& key, const std::string& secret, int rank, int size,
                        const ShmOptions& options, std::unique_ptr<ShmGroup>* out) {
  if (size < 1 || rank < 0 || rank >= size) {
    return Status::InvalidArgument("ShmGroup: rank " + std::to_string(rank) + " is not in [0, " +
                                   std::to_string(size) + ")");
  }
  if (options.timeout_s <= 0) return Status::InvalidArgument("ShmGroup: timeout_s must be > 0");
  ShmOptions opt = options;
  opt.slot_bytes = RoundUp(std::max<size_t>(opt.slot_bytes, 1), kPage);
  const size_t bytes = SegmentBytes(size, opt.slot_bytes);
  const auto deadline =
      Clock::now() + std::chrono::microseconds(static_cast<int64_t>(opt.timeout_s * 1e6));
  const std::string group = "shared-memory group '" + key + "': ";
  std::unique_ptr<ShmGroup> g;

  if (rank == 0) {
    Socket memfd(::memfd_create("horovod_torch-shm", MFD_CLOEXEC | MFD_ALLOW_SEALING));
    if (!memfd.valid()) return Status::Aborted(Errno(group + "memfd_create"));
    if (::ftruncate(memfd.fd(), static_cast<off_t>(bytes)) != 0) {
      return Status::Aborted(
          Errno(group + "sizing the segment to " + std::to_string(bytes) + " bytes"));
    }
    // Nobody may resize it under the others' mappings (that would be SIGBUS).
    ::fcntl(memfd.fd(), F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL);
    char* p = MapSegment(memfd.fd(), bytes);
    if (p == nullptr) return Status::Aborted(Errno(group + "mmap"));
    g.reset(new ShmGroup(rank, size, opt, p, bytes));
    SegmentHeader* h = new (p) SegmentHeader();
    h->magic = kMagic;
    h->size = static_cast<uint32_t>(size);
    h->slot_bytes = opt.slot_bytes;
    h->bytes = bytes;
    h->pid_checks.store(1);
    h->poison_rank.store(-1);
    for (int r = 0; r < size; ++r) new (&g->ranks_[r]) RankSlot();
    g->ranks_[0].pid.store(::getpid());
    if (size > 1) {
      HVD_RETURN_IF_ERROR(ServeSegment(
          key, secret, size, memfd.fd(), deadline, [&](int r, pid_t pid, bool same_ns) {
            // Watched from now on, even if it dies before registering itself.
            g->ranks_[r].pid.store(pid);
            if (!same_ns && h->pid_checks.exchange(0) == 1) {
              HVD_LOG(kWarning) << group << "local ranks live in different PID namespaces; "
                                << "a dead local rank is only noticed at the timeout";
            }
          }));
    }
  } else {
    int fd = -1;
    HVD_RETURN_IF_ERROR(FetchSegment(key, secret, rank, deadline, &fd));
    Socket memfd(fd);
    struct stat sb {};
    if (::fstat(memfd.fd(), &sb) != 0 || static_cast<size_t>(sb.st_size) != bytes) {
      Status mismatch = Status::Mismatch(
          group + "local rank 0's segment has " + std::to_string(sb.st_size) +
          " bytes, local rank " + std::to_string(rank) + " expects " + std::to_string(bytes) +
          " (the local ranks disagree on the local size or ShmOptions)");
      // Tell the others now rather than at their timeout.
      char* p = MapSegment(memfd.fd(), kPage);
      if (p != nullptr) {
        auto* h = reinterpret_cast<SegmentHeader*>(p);
        if (h->magic == kMagic) shm::Poison(h, rank, mismatch.message());
        ::munmap(p, kPage);
      }
      return mismatch;
    }
    char* p = MapSegment(memfd.fd(), bytes);
    if (p == nullptr) return Status::Aborted(Errno(group + "mmap"));
    g.reset(new ShmGroup(rank, size, opt, p, bytes));
    if (g->header_->magic != kMagic || g->header_->size != static_cast<uint32_t>(size) ||
        g->header_->slot_bytes != opt.slot_bytes) {
      Status mismatch = Status::Mismatch(group + "local rank " + std::to_string(rank) +
                                         " disagrees with local rank 0 on the local size or "
                                         "slot_bytes");
      g->Poison(mismatch.message());
      return mismatch;
    }
  }

  RankSlot& me = g->ranks_[rank];
  me.pid.store(::getpid());
  me.start_time.store(OwnStartTime());
  me.state.store(kJoined);
  HVD_RETURN_IF_ERROR(g->Sync());
  *out = std::move(g);
  return Status::Ok();
}

// ---------------------------------------------------------------------------
// Waiting. The barrier is a counter and a generation in the segment; waiters
// spin briefly, then sleep on the generation (futex) in ticks, between which
// they look at the poison flag, the clock and the other ranks' processes.

Status ShmGroup::Sync() {
  if (header_->poison.load(std::memory_order_acquire) != 0) return PoisonStatus();
  // Read the generation before arriving: it cannot move until this rank arrives.
  const uint32_t seen = header_->generation.load(std::memory_order_acquire);
  RankSlot& me = ranks_[rank_];
  me.arrivals.store(me.arrivals.load(std::memory_order_relaxed) + 1, std::memory_order_relaxed);
  if (header_->arrived.fetch_add(1, std::memory_order_acq_rel) + 1 ==
      static_cast<uint32_t>(size_)) {
    header_->arrived.store(0, std::memory_order_relaxed);
    header_->generation.store(seen + 1);  // seq_cst: pairs with `sleepers` below
    if (header_->sleepers.load() > 0) FutexWake(&header_->generation);
    return Status::Ok();
  }
  return WaitGeneration(seen);
}

Status ShmGroup::WaitGeneration(uint32_t seen) {
  std::atomic<uint32_t>& gen = header_->generation;
  const auto start = Clock::now();
  // Spin first (cheap when every rank has a CPU), then sleep in the kernel.
  const auto spin_end = start + std::chrono::nanoseconds(spin_ns_);
  for (int i = 0; spin_ns_ > 0 && gen.load(std::memory_order_acquire) == seen; ++i) {
    CpuRelax();
    if ((i & 63) == 63 && Clock::now() >= spin_end) break;
  }
  const auto deadline =
      start + std::chrono::microseconds(static_cast<int64_t>(options_.timeout_s * 1e6));
  bool look = false;  // look at the peers only after a sleep that changed nothing
  while (gen.load(std::memory_order_acquire) == seen) {
    if (header_->poison.load() != 0) return PoisonStatus();
    if (look) {
      std::string gone = CheckPeers();
      // A peer that passed this barrier and then died or left is no failure.
      if (!gone.empty() && gen.load() == seen) {
        // The first reason wins: a peer that exited after another rank's poison
        // (which this rank had not seen yet) is not the cause.
        Poison(gone);
        return PoisonStatus();
      }
    }
    auto now = Clock::now();
    if (now >= deadline && gen.load() == seen) {
      std::string late;
      uint64_t mine = ranks_[rank_].arrivals.load(std::memory_order_relaxed);
      for (int r = 0; r < size_; ++r) {
        if (ranks_[r].arrivals.load(std::memory_order_relaxed) < mine) {
          late += (late.empty() ? "" : ", ") + std::to_string(r);
        }
      }
      std::string why = "local rank " + std::to_string(rank_) + " timed out after " +
                        Secs(options_.timeout_s) + " waiting for local ranks [" + late +
                        "] in a shared-memory collective (are they stuck or stopped?)";
      Poison(why);
      return Status::Aborted(why);
    }
    auto nap = std::min<std::chrono::nanoseconds>(kTick, deadline - now);
    header_->sleepers.fetch_add(1);
    if (gen.load() == seen) FutexWait(&gen, seen, nap);
    header_->sleepers.fetch_sub(1);
    look = true;
  }
  return Status::Ok();
}

std::string ShmGroup::CheckPeers() const {
  const bool pids = header_->pid_checks.load(std::memory_order_relaxed) != 0;
  const pid_t self = ::getpid();
  for (int r = 0; r < size_; ++r) {
    if (r == rank_) continue;
    const RankSlot& info = ranks_[r];
    if (info.state.load() == kLeft) {
      return "local rank " + std::to_string(r) +
             " left the shared-memory group (destroyed it) while local rank " +
             std::to_string(rank_) + " was waiting for it in a collective";
    }
    pid_t pid = info.pid.load();
    if (pids && pid > 0 && pid != self && ProcessGone(pid, info.start_time.load())) {
      return "local rank " + std::to_string(r) + " (pid " + std::to_string(pid) +
             ") died during a shared-memory collective (killed, crashed or exited early); "
             "see that rank's output for the cause";
    }
  }
  return "";
}

void ShmGroup::Poison(const std::string& why) { shm::Poison(header_, rank_, why); }

Status ShmGroup::PoisonStatus() const {
  // The first poisoner may still be writing its reason.
  for (int i = 0; i < 100 && header_->poison_ready.load(std::memory_order_acquire) == 0; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  std::string why = header_->poison_ready.load(std::memory_order_acquire) != 0
                        ? std::string(header_->poison_msg)
                        : std::string("reason unknown");
  int who = header_->poison_rank.load();
  if (who == rank_) return Status::Aborted(why);
  return Status::Aborted("shared-memory group of this host aborted by local rank " +
                         std::to_string(who) + ": " + why);
}

void ShmGroup::Abort() { Poison("Abort() was called on local rank " + std::to_string(rank_)); }

Status ShmGroup::Ready() {
  if (failed_.ok() && header_->poison.load(std::memory_order_acquire) != 0) {
    failed_ = PoisonStatus();
  }
  return failed_;
}

Status ShmGroup::Finish(Status st) {
  if (st.code() == StatusCode::kAborted) failed_ = st;
  return st;
}

Status ShmGroup::FirstSync(const shm::Descriptor& d) {
  const int which = static_cast<int>(calls_++ % 2);
  ranks_[rank_].calls[which] = d;
  HVD_RETURN_IF_ERROR(Sync());
  bool same = true;
  for (int r = 0; r < size_; ++r) same = same && ranks_[r].calls[which] == d;
  if (same) return Status::Ok();
  std::string calls;
  for (int r = 0; r < size_; ++r) {
    calls += "; local rank " + std::to_string(r) + ": " + ranks_[r].calls[which].ToString();
  }
  return Status::Mismatch("local ranks made different shared-memory collectives" + calls);
}

}  // namespace hvd
