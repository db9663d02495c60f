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
#include "transport/shm_segment.h"

namespace hvd {

using namespace shm;  // NOLINT: this file implements the segment's protocol

namespace {

constexpr size_t kReduceBlock = 8192;   // bytes reduced over all ranks at a time
constexpr size_t kExchangeHeader = 64;  // a control message's length, then its bytes
constexpr int kMaxThreads = 64;         // HOROVOD_SHM_THREADS above this is taken as this
// How often a sleeping waiter wakes up to look at its peers and the clock.
constexpr auto kTick = std::chrono::milliseconds(50);

void CpuRelax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield" ::: "memory");
#endif
}

void Copy(char* dst, const char* src, size_t n) {
  if (n > 0) std::memcpy(dst, src, n);
}

std::string Secs(double s) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.3g s", s);
  return buf;
}

uint64_t HashSizes(const std::vector<size_t>& v) {
  uint64_t h = 1469598103934665603ull;
  for (size_t x : v) h = (h ^ x) * 1099511628211ull;
  return h;
}

// Maps the whole segment of `memfd`, page tables filled up front.
char* MapSegment(int memfd, size_t bytes) {
  void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, memfd, 0);
  return p == MAP_FAILED ? nullptr : static_cast<char*>(p);
}

}  // namespace

namespace shm {

// Helper threads for the parts of one pipeline step. Run() does part 0, then,
// like every helper, claims the next unclaimed part until none is left, and
// returns when the parts others claimed are done too. So a helper that wakes
// late (asleep since the last op) finds nothing left and costs nothing: a step
// never takes longer than the rank's thread alone would. Helpers spin a while
// for the next step, then sleep on a condition variable.
class Helpers {
 public:
  // Throws std::system_error if a thread cannot be started (none is left running).
  Helpers(int n, int64_t spin_ns) : spin_ns_(spin_ns) {
    try {
      for (int i = 0; i < n; ++i) threads_.emplace_back([this] { Loop(); });
    } catch (...) {
      Stop();
      throw;
    }
  }
  ~Helpers() { Stop(); }
  void Run(int parts, const std::function<void(int)>& fn) {
    uint64_t gen;
    {
      MutexLock lock(mu_);
      fn_ = &fn;
      parts_ = parts;
      done_.store(0, std::memory_order_relaxed);
      gen = gen_.load(std::memory_order_relaxed) + 1;
      ticket_.store(Ticket(gen, 1), std::memory_order_relaxed);
      gen_.store(gen, std::memory_order_release);
    }
    cv_.NotifyAll();
    fn(0);
    int mine = 1;
    for (int p; (p = Claim(gen, parts)) >= 0; ++mine) fn(p);
    while (mine + done_.load(std::memory_order_acquire) < parts) CpuRelax();
  }

 private:
  // A claim names its step's generation, so a helper still holding an older
  // step's function can never take a part of a newer step.
  static uint64_t Ticket(uint64_t gen, int next) {
    return (gen << 32) | static_cast<uint32_t>(next);
  }
  int Claim(uint64_t gen, int parts) {
    uint64_t t = ticket_.load(std::memory_order_acquire);
    for (;;) {
      const int next = static_cast<int>(t & 0xffffffffu);
      if ((t >> 32) != (gen & 0xffffffffu) || next >= parts) return -1;
      if (ticket_.compare_exchange_weak(t, t + 1, std::memory_order_acq_rel)) return next;
    }
  }
  void Stop() {
    {
      MutexLock lock(mu_);
      stop_ = true;
      gen_.fetch_add(1, std::memory_order_release);
    }
    cv_.NotifyAll();
    for (auto& t : threads_) t.join();
    threads_.clear();
  }
  void Loop() {
    uint64_t seen = 0;
    for (;;) {
      const auto spin_end = Clock::now() + std::chrono::nanoseconds(spin_ns_);
      for (int i = 0; gen_.load(std::memory_order_acquire) == seen; ++i) {
        CpuRelax();
        if ((i & 63) == 63 && Clock::now() >= spin_end) break;
      }
      const std::function<void(int)>* fn;
      int parts;
      {
        MutexLock lock(mu_);
        cv_.Wait(mu_, [&] { return gen_.load(std::memory_order_relaxed) != seen; });
        seen = gen_.load(std::memory_order_relaxed);
        if (stop_) return;
        fn = fn_;
        parts = parts_;
      }
      // fn is valid while a part of generation `seen` is unclaimed: Run() does
      // not return before every claimed part is done.
      for (int p; (p = Claim(seen, parts)) >= 0;) {
        (*fn)(p);
        done_.fetch_add(1, std::memory_order_release);
      }
    }
  }

  const int64_t spin_ns_;
  std::vector<std::thread> threads_;
  Mutex mu_;
  CondVar cv_;
  std::atomic<uint64_t> gen_{0};     // bumped per step (and to stop)
  std::atomic<uint64_t> ticket_{0};  // generation (high 32 bits), next part to claim
  std::atomic<int> done_{0};         // parts finished by helpers this step
  const std::function<void(int)>* fn_ HVD_GUARDED_BY(mu_) = nullptr;
  int parts_ HVD_GUARDED_BY(mu_) = 0;
  bool stop_ HVD_GUARDED_BY(mu_) = false;
};

}  // namespace shm

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

template <typename Fn>
void ShmGroup::Parallel(size_t bytes, const Fn& fn) {
  // Smaller parts cost more to hand out than they save.
  const int parts = static_cast<int>(
      std::min<size_t>(threads_, bytes / std::max<size_t>(1, options_.min_part_bytes)));
  if (parts <= 1) {
    fn(0, 1);
    return;
  }
  if (!helpers_) {
    try {
      helpers_ = std::make_unique<Helpers>(threads_ - 1, spin_ns_);
    } catch (const std::system_error& e) {
      HVD_LOG(kWarning) << "shared memory: could not start " << threads_ - 1 << " helper threads ("
                        << e.what() << "); copying on one thread";
      threads_ = 1;
      fn(0, 1);
      return;
    }
  }
  helpers_->Run(parts, [&](int part) { fn(part, parts); });
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

// ---------------------------------------------------------------------------
// Pipelines. A step is the work between two barriers. Buffer b is reused for
// the chunk three allocations later, i.e. at least three steps later, and a
// chunk's data is dead two steps after it was written: so no barrier beyond the
// one per step is needed, also from one call to the next.

// Chunk c (up to slot_bytes per rank) of the elements is split into `size`
// shares; rank r reduces share r:
//   step c:   every rank copies its chunk, except its own share, into its slot;
//   step c+1: each rank reduces its share over the ranks in rank order (its own
//             data straight from its buffer) and writes the result into its own
//             buffer and into its slot, where its own share would have been;
//   step c+2: every rank copies the other shares' results (the parts of them
//             inside [out_begin, out_end)) from the other slots.
// So each rank writes only its own slot, and each result line has one writer.
Status ShmGroup::ReducePipeline(const shm::Descriptor& d, char* buf, size_t out_begin,
                                size_t out_end) {
  const DataType dtype = static_cast<DataType>(d.dtype);
  const ReduceOp op = static_cast<ReduceOp>(d.op);
  const size_t count = d.count;
  const size_t es = DataTypeSize(dtype);
  const size_t per = options_.slot_bytes / es;  // elements per chunk
  const size_t chunks = (count + per - 1) / per;
  // Shares are whole cache lines, so that two ranks never write one line.
  const size_t align = std::max<size_t>(1, 64 / es);
  // Elements [*lo, *hi) of the stream are share r of chunk c.
  auto share = [&](size_t c, int r, size_t* lo, size_t* hi) {
    const size_t begin = c * per, end = std::min(count, begin + per);
    const size_t n = RoundUp((end - begin + size_ - 1) / size_, align);
    *lo = std::min(end, begin + r * n);
    *hi = std::min(end, *lo + n);
  };
  // Where element i of chunk c lives in rank r's slot.
  auto at = [&](size_t c, int r, size_t i) { return Slot(next_set_ + c, r) + (i - c * per) * es; };
  // Part `part` of `parts` of elements [lo, hi), cut at cache lines.
  auto cut = [&](size_t lo, size_t hi, int part, int parts, size_t* a, size_t* b) {
    const size_t n = RoundUp((hi - lo + parts - 1) / parts, align);
    *a = std::min(hi, lo + part * n);
    *b = std::min(hi, *a + n);
  };
  // Step j: copy out the other ranks' shares of chunk j - 2, reduce this rank's
  // share of chunk j - 1, copy chunk j (but this rank's share) in. Each part of
  // the step takes its fraction of every one of these ranges.
  auto step = [&](size_t j, int part, int parts) {
    size_t lo, hi, a, b;
    if (j >= 2) {
      for (int r = 0; r < size_; ++r) {
        share(j - 2, r, &lo, &hi);
        lo = std::max(lo, out_begin);
        hi = std::min(hi, out_end);
        if (r == rank_ || lo >= hi) continue;
        cut(lo, hi, part, parts, &a, &b);
        Copy(buf + a * es, at(j - 2, r, a), (b - a) * es);
      }
    }
    if (j >= 1 && j <= chunks) {
      const size_t c = j - 1;
      share(c, rank_, &lo, &hi);
      cut(lo, hi, part, parts, &lo, &hi);
      // Block by block, in an accumulator that stays in the L1 cache while the
      // ranks' data streams past it.
      alignas(64) char acc[kReduceBlock];
      for (size_t b_lo = lo; b_lo < hi; b_lo += kReduceBlock / es) {
        const size_t n = std::min(hi, b_lo + kReduceBlock / es) - b_lo;
        for (int r = 0; r < size_; ++r) {
          const char* x = r == rank_ ? buf + b_lo * es : at(c, r, b_lo);
          if (r == 0) {
            std::memcpy(acc, x, n * es);
          } else {
            ReduceInto(acc, x, n, dtype, op);
          }
        }
        std::memcpy(at(c, rank_, b_lo), acc, n * es);
        const size_t x = std::max(b_lo, out_begin), y = std::min(b_lo + n, out_end);
        if (x < y) Copy(buf + x * es, acc + (x - b_lo) * es, (y - x) * es);
      }
    }
    if (j < chunks) {
      share(j, rank_, &lo, &hi);
      const size_t begin = j * per, end = std::min(count, begin + per);
      cut(begin, lo, part, parts, &a, &b);
      Copy(at(j, rank_, a), buf + a * es, (b - a) * es);
      cut(hi, end, part, parts, &a, &b);
      Copy(at(j, rank_, a), buf + a * es, (b - a) * es);
    }
  };
  for (size_t j = 0; j <= chunks + 1; ++j) {
    Parallel(std::min(count, per) * es, [&](int part, int parts) { step(j, part, parts); });
    if (j == 0) {
      HVD_RETURN_IF_ERROR(FirstSync(d));
    } else if (j <= chunks) {
      HVD_RETURN_IF_ERROR(Sync());
    }
  }
  next_set_ += chunks;
  return Status::Ok();
}

// Window c (one whole buffer, size * slot_bytes, of the byte stream buf[0,
// total)): step c, every rank copies the part of the window inside its own range
// [mine_begin, mine_end) in; step c+1, every rank copies the rest of it out.
Status ShmGroup::CopyPipeline(const shm::Descriptor& d, char* buf, size_t mine_begin,
                              size_t mine_end) {
  const size_t total = d.count;
  const size_t window = size_ * options_.slot_bytes;
  const size_t chunks = (total + window - 1) / window;
  for (size_t j = 0; j <= chunks; ++j) {
    if (j >= 1) {
      const size_t lo = (j - 1) * window, hi = std::min(total, lo + window);
      const char* src = Set(next_set_ + j - 1);
      const size_t a = std::min(hi, mine_begin), b = std::max(lo, mine_end);
      if (lo < a) Copy(buf + lo, src, a - lo);
      if (b < hi) Copy(buf + b, src + (b - lo), hi - b);
    }
    if (j < chunks) {
      const size_t lo = j * window, hi = std::min(total, lo + window);
      const size_t a = std::max(lo, mine_begin), b = std::min(hi, mine_end);
      if (a < b) Copy(Set(next_set_ + j) + (a - lo), buf + a, b - a);
    }
    if (j == 0) {
      HVD_RETURN_IF_ERROR(FirstSync(d));
    } else if (j < chunks) {
      HVD_RETURN_IF_ERROR(Sync());
    }
  }
  next_set_ += chunks;
  return Status::Ok();
}

// ---------------------------------------------------------------------------
// Collectives.

namespace {
Status CheckReduceOp(ReduceOp op) {
  if (op == ReduceOp::kSum || op == ReduceOp::kMin || op == ReduceOp::kMax ||
      op == ReduceOp::kProduct) {
    return Status::Ok();
  }
  return Status::InvalidArgument(std::string("shared-memory reductions support Sum, Min, Max ") +
                                 "and Product, not " + ReduceOpName(op));
}
}  // namespace

Status ShmGroup::Allreduce(void* buf, size_t count, DataType dtype, ReduceOp op) {
  HVD_RETURN_IF_ERROR(CheckReduceOp(op));
  HVD_RETURN_IF_ERROR(Ready());
  if (size_ == 1) return Status::Ok();
  Descriptor d;
  d.kind = kAllreduceCall;
  d.dtype = static_cast<uint64_t>(dtype);
  d.op = static_cast<uint64_t>(op);
  d.count = count;
  return Finish(ReducePipeline(d, static_cast<char*>(buf), 0, count));
}

Status ShmGroup::ReduceScatter(void* buf, const std::vector<size_t>& counts, DataType dtype,
                               ReduceOp op) {
  HVD_RETURN_IF_ERROR(CheckReduceOp(op));
  if (counts.size() != static_cast<size_t>(size_)) {
    return Status::InvalidArgument("ShmGroup::ReduceScatter: " + std::to_string(counts.size()) +
                                   " counts for " + std::to_string(size_) + " local ranks");
  }
  HVD_RETURN_IF_ERROR(Ready());
  if (size_ == 1) return Status::Ok();
  Descriptor d;
  d.kind = kReduceScatterCall;
  d.dtype = static_cast<uint64_t>(dtype);
  d.op = static_cast<uint64_t>(op);
  size_t begin = 0;
  for (int r = 0; r < size_; ++r) {
    if (r == rank_) begin = d.count;
    d.count += counts[r];
  }
  d.layout = HashSizes(counts);
  return Finish(ReducePipeline(d, static_cast<char*>(buf), begin, begin + counts[rank_]));
}

Status ShmGroup::Allgather(void* buf, const std::vector<size_t>& bytes) {
  if (bytes.size() != static_cast<size_t>(size_)) {
    return Status::InvalidArgument("ShmGroup::Allgather: " + std::to_string(bytes.size()) +
                                   " sizes for " + std::to_string(size_) + " local ranks");
  }
  HVD_RETURN_IF_ERROR(Ready());
  if (size_ == 1) return Status::Ok();
  Descriptor d;
  d.kind = kAllgatherCall;
  size_t begin = 0;
  for (int r = 0; r < size_; ++r) {
    if (r == rank_) begin = d.count;
    d.count += bytes[r];
  }
  d.layout = HashSizes(bytes);
  return Finish(CopyPipeline(d, static_cast<char*>(buf), begin, begin + bytes[rank_]));
}

Status ShmGroup::Broadcast(void* buf, size_t bytes, int root) {
  if (root < 0 || root >= size_) {
    return Status::InvalidArgument("ShmGroup::Broadcast: root " + std::to_string(root) +
                                   " is not a local rank (local size " + std::to_string(size_) +
                                   ")");
  }
  HVD_RETURN_IF_ERROR(Ready());
  if (size_ == 1) return Status::Ok();
  Descriptor d;
  d.kind = kBroadcastCall;
  d.count = bytes;
  d.root = static_cast<uint64_t>(root);
  const size_t mine = rank_ == root ? bytes : 0;
  return Finish(CopyPipeline(d, static_cast<char*>(buf), 0, mine));
}

Status ShmGroup::Barrier() {
  HVD_RETURN_IF_ERROR(Ready());
  Descriptor d;
  d.kind = kBarrierCall;
  return Finish(FirstSync(d));
}

// Control messages. Step k: each contributing rank writes its message's length
// and bytes [k * cap, (k + 1) * cap) into its slot of a fresh buffer; after the
// barrier the receivers copy them out. The first step tells every rank the
// longest length, hence the number of steps. Buffers rotate as in the pipelines.
Status ShmGroup::Exchange(uint64_t tag, const std::string* mine, std::vector<std::string>* all) {
  HVD_RETURN_IF_ERROR(Ready());
  if (all != nullptr) all->assign(size_, std::string());
  const size_t cap = options_.slot_bytes - kExchangeHeader;
  const uint64_t len = mine != nullptr ? mine->size() : 0;
  Descriptor d;
  d.kind = kExchangeCall;
  d.op = tag;
  size_t steps = 1;
  std::vector<uint64_t> lens(size_, 0);
  for (size_t k = 0; k < steps; ++k) {
    char* slot = Slot(next_set_ + k, rank_);
    std::memcpy(slot, &len, sizeof(len));
    if (k * cap < len) {
      Copy(slot + kExchangeHeader, mine->data() + k * cap, std::min<uint64_t>(cap, len - k * cap));
    }
    Status st = k == 0 ? FirstSync(d) : Sync();
    if (!st.ok()) {
      next_set_ += k + 1;
      return Finish(st);
    }
    if (k == 0) {
      uint64_t longest = 0;
      for (int r = 0; r < size_; ++r) {
        std::memcpy(&lens[r], Slot(next_set_, r), sizeof(uint64_t));
        longest = std::max(longest, lens[r]);
        if (all != nullptr) (*all)[r].reserve(lens[r]);
      }
      steps = std::max<size_t>(1, (longest + cap - 1) / cap);
    }
    if (all == nullptr) continue;
    for (int r = 0; r < size_; ++r) {
      if (k * cap < lens[r]) {
        (*all)[r].append(Slot(next_set_ + k, r) + kExchangeHeader,
                         std::min<uint64_t>(cap, lens[r] - k * cap));
      }
    }
  }
  next_set_ += steps;
  return Status::Ok();
}

}  // namespace hvd
