// Negotiation at hundreds and thousands of ranks, simulated: the real hvd::Controller
// on N threads of one process over the in-memory control plane
// (tests/cpp/mem_control_plane.h). Each step every rank submits the same T tensors
// (in its own shuffled order) at once and runs one Controller::Cycle: step 0 is the
// full negotiation, later steps are served by the response cache.
//
//   make -C tests/cpp sim
//   tests/cpp/build/negotiation_sim [--ranks 256,1024] [--tensors 10,100,1000]
//       [--steps 50] [--capacity 1024] [--exchange allgather|gather|both] [--no-memory]
//
// --exchange gather runs every steady cycle as a gather to rank 0 plus a broadcast
// (HOROVOD_STEADY_STATE_EXCHANGE=0), for comparison.
//
// What is measured, per (ranks, tensors):
//   wall: from the first rank entering a cycle to the last leaving it. With N
//     threads on a few cores this is mostly the scheduling of N threads: read it
//     as an upper bound, not as what N machines would see.
//   CPU: CLOCK_THREAD_CPUTIME_ID around Controller::Cycle on each rank's thread,
//     also split into time inside the control plane (copying N messages in and
//     out of memory, the stand-in for the network) and the controller's own work.
//     This is what one process of a real job spends, independent of thread count.
//   bytes: logical payload per rank (see mem_control_plane.h).
//   memory: a counting operator new (16-byte header naming the owner, set per
//     thread while a controller is being built or runs a cycle): the bytes a
//     controller holds (retained) and its largest holding inside a cycle (peak).
//     The control plane's allocations (its buffers, the messages it hands out) are
//     not counted. mallinfo2() around the construction of the N controllers
//     cross-checks the first number (it also sees malloc's overhead and our 16-byte
//     headers). --no-memory skips the counting (memory columns read 0) to show its
//     cost in the CPU columns.
#include <malloc.h>
#include <pthread.h>
#include <time.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <new>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "core/controller.h"
#include "mem_control_plane.h"
#include "wire/message.h"

// ---- counting allocator -------------------------------------------------------

namespace {

struct AllocCounter {
  std::atomic<int64_t> live{0};
  std::atomic<int64_t> peak{0};
  void Reset() { peak.store(live.load()); }
};

thread_local AllocCounter* t_owner = nullptr;  // who this thread allocates for
constexpr size_t kHeader = 16;                 // keeps malloc's 16-byte alignment

void* CountedAlloc(size_t n) {
  char* p = static_cast<char*>(std::malloc(n + kHeader));
  if (p == nullptr) return nullptr;
  AllocCounter* c = t_owner;
  std::memcpy(p, &c, sizeof(c));
  std::memcpy(p + sizeof(c), &n, sizeof(n));
  if (c != nullptr) {
    int64_t v = c->live.fetch_add(static_cast<int64_t>(n), std::memory_order_relaxed) + n;
    int64_t pk = c->peak.load(std::memory_order_relaxed);
    while (v > pk && !c->peak.compare_exchange_weak(pk, v, std::memory_order_relaxed)) {
    }
  }
  return p + kHeader;
}

void CountedFree(void* q) {
  if (q == nullptr) return;
  char* p = static_cast<char*>(q) - kHeader;
  AllocCounter* c;
  size_t n;
  std::memcpy(&c, p, sizeof(c));
  std::memcpy(&n, p + sizeof(c), sizeof(n));
  if (c != nullptr) c->live.fetch_sub(static_cast<int64_t>(n), std::memory_order_relaxed);
  std::free(p);
}

bool g_charge = true;  // --no-memory: charge nothing (to see the counting's own cost)

// Allocations in this scope are charged to `c` (null: to nobody).
class Charge {
 public:
  explicit Charge(AllocCounter* c) : saved_(t_owner) { t_owner = g_charge ? c : nullptr; }
  ~Charge() { t_owner = saved_; }

 private:
  AllocCounter* saved_;
};

}  // namespace

void* operator new(size_t n) {
  void* p = CountedAlloc(n);
  if (p == nullptr) throw std::bad_alloc();
  return p;
}
void* operator new[](size_t n) { return operator new(n); }
void* operator new(size_t n, const std::nothrow_t&) noexcept { return CountedAlloc(n); }
void* operator new[](size_t n, const std::nothrow_t&) noexcept { return CountedAlloc(n); }
void operator delete(void* p) noexcept { CountedFree(p); }
void operator delete[](void* p) noexcept { CountedFree(p); }
void operator delete(void* p, size_t) noexcept { CountedFree(p); }
void operator delete[](void* p, size_t) noexcept { CountedFree(p); }
void operator delete(void* p, const std::nothrow_t&) noexcept { CountedFree(p); }
void operator delete[](void* p, const std::nothrow_t&) noexcept { CountedFree(p); }

// ---- simulation ------------------------------------------------------------------

namespace {

using hvd::Controller;
using hvd::Request;
using hvd::Response;
using hvd::Status;
using hvd_test::MemWorld;
using hvd_test::PlaneStats;

int64_t ThreadCpuNs() {
  timespec ts;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

int64_t WallNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// The rank's plane, timing its CPU; what it allocates is charged to nobody (the
// transport's memory is not the controller's).
class MeasuredPlane : public hvd::ControlPlane {
 public:
  explicit MeasuredPlane(hvd::ControlPlane* inner) : inner_(inner) {}
  int rank() const override { return inner_->rank(); }
  int size() const override { return inner_->size(); }
  Status Gather(const std::string& mine, std::vector<std::string>* all) override {
    return Timed([&] { return inner_->Gather(mine, all); });
  }
  Status Bcast(std::string* data) override {
    return Timed([&] { return inner_->Bcast(data); });
  }
  Status Allgather(const std::string& mine, std::vector<std::string>* all) override {
    return Timed([&] { return inner_->Allgather(mine, all); });
  }
  Status AllreduceBits(std::vector<uint64_t>* and_bits, std::vector<uint64_t>* or_bits) override {
    return Timed([&] { return inner_->AllreduceBits(and_bits, or_bits); });
  }
  int64_t cpu_ns = 0;

 private:
  template <typename F>
  Status Timed(F f) {
    Charge charge(nullptr);
    int64_t t0 = ThreadCpuNs();
    Status st = f();
    cpu_ns += ThreadCpuNs() - t0;
    return st;
  }
  hvd::ControlPlane* inner_;
};

struct CycleSample {
  int64_t start_ns = 0, end_ns = 0;  // wall
  int64_t cpu_ns = 0, plane_cpu_ns = 0;
  PlaneStats traffic;
  uint64_t order_hash = 0;  // of the response names, in order
  size_t responses = 0;
};

struct Result {
  int ranks = 0, tensors = 0;
  bool steady_exchange = true;
  double first_wall_ms = 0, steady_wall_ms = 0;
  double first_cpu0_ms = 0, first_cpu_other_ms = 0;
  double cpu0_us = 0, plane0_us = 0, cpu_other_us = 0, plane_other_us = 0;
  double sent_per_rank = 0, recv_per_rank = 0;  // non-coordinator, steady cycle
  double recv_rank0 = 0;
  double built_bytes = 0, built_mallinfo = 0;  // per rank, after construction
  double retained0 = 0, retained_other = 0;    // after the last step
  double peak0 = 0, peak_other = 0;            // largest inside a cycle
  std::string check = "ok";
};

double Median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::nth_element(v.begin(), v.begin() + v.size() / 2, v.end());
  return v[v.size() / 2];
}

std::vector<Request> Tensors(int t) {
  std::vector<Request> v;
  for (int i = 0; i < t; ++i) {
    Request q;
    q.name = "model.layers." + std::to_string(i) + ".mlp.weight.grad";
    q.shape = {1024, 64 + i % 7};
    v.push_back(std::move(q));
  }
  return v;
}

uint64_t HashNames(const std::vector<Response>& rs) {
  uint64_t h = 1469598103934665603ull;
  for (const auto& r : rs) {
    for (char c : r.name) h = (h ^ static_cast<uint8_t>(c)) * 1099511628211ull;
    h = (h ^ 0xff) * 1099511628211ull;
  }
  return h;
}

// Runs fn(rank) on n threads with small stacks (1024 threads x 8 MB is a lot).
void RunThreads(int n, const std::function<void(int)>& fn) {
  struct Arg {
    const std::function<void(int)>* fn;
    int rank;
  };
  std::vector<Arg> args(n);
  std::vector<pthread_t> tids(n);
  pthread_attr_t attr;
  pthread_attr_init(&attr);
  pthread_attr_setstacksize(&attr, 512 << 10);
  for (int r = 0; r < n; ++r) {
    args[r] = {&fn, r};
    int rc = pthread_create(
        &tids[r], &attr,
        [](void* a) -> void* {
          auto* arg = static_cast<Arg*>(a);
          (*arg->fn)(arg->rank);
          return nullptr;
        },
        &args[r]);
    if (rc != 0) {
      std::fprintf(stderr, "pthread_create failed for rank %d: %s\n", r, std::strerror(rc));
      std::exit(1);
    }
  }
  pthread_attr_destroy(&attr);
  for (int r = 0; r < n; ++r) pthread_join(tids[r], nullptr);
}

Result Simulate(int n, int t, int steps, size_t capacity, bool steady_exchange) {
  Result res;
  res.ranks = n;
  res.tensors = t;
  res.steady_exchange = steady_exchange;
  std::vector<AllocCounter> ctrl_mem(n);
  MemWorld world(n, /*timeout_s=*/600);
  std::vector<std::unique_ptr<MeasuredPlane>> planes;
  for (int r = 0; r < n; ++r) {
    planes.push_back(std::make_unique<MeasuredPlane>(world.plane(r)));
  }

  // Build the controllers; measure what they hold before any cycle.
  std::vector<std::unique_ptr<Controller>> ctrls(n);
  // Large blocks (the cache's entry array) come from mmap: count those too.
  auto heap = [] {
    struct mallinfo2 mi = mallinfo2();
    return mi.uordblks + mi.hblkhd;
  };
  const size_t before = heap();
  for (int r = 0; r < n; ++r) {
    Charge charge(&ctrl_mem[r]);
    ctrls[r] = std::make_unique<Controller>(planes[r].get(), capacity);
    ctrls[r]->SetSteadyExchange(steady_exchange);
  }
  res.built_mallinfo = static_cast<double>(heap() - before) / n;
  int64_t built = 0;
  for (auto& c : ctrl_mem) built += c.live.load();
  res.built_bytes = static_cast<double>(built) / n;

  const std::vector<Request> base = Tensors(t);
  std::vector<std::vector<CycleSample>> samples(n, std::vector<CycleSample>(steps));
  std::vector<std::string> errors(n);
  RunThreads(n, [&](int r) {
    std::mt19937 rng(1234u + static_cast<uint32_t>(r));
    for (int s = 0; s < steps; ++s) {
      std::vector<Request> fresh = base;
      std::shuffle(fresh.begin(), fresh.end(), rng);
      for (auto& q : fresh) q.rank = r;
      std::vector<Response> out;
      bool shutdown = false;
      CycleSample& cs = samples[r][s];
      const PlaneStats st0 = world.plane(r)->stats();
      const int64_t plane0 = planes[r]->cpu_ns;
      cs.start_ns = WallNs();
      const int64_t cpu0 = ThreadCpuNs();
      Status st;
      {
        Charge charge(&ctrl_mem[r]);
        st = ctrls[r]->Cycle(std::move(fresh), false, &out, &shutdown);
      }
      cs.cpu_ns = ThreadCpuNs() - cpu0;
      cs.end_ns = WallNs();
      cs.plane_cpu_ns = planes[r]->cpu_ns - plane0;
      cs.traffic = world.plane(r)->stats() - st0;
      if (!st.ok()) {
        errors[r] = "step " + std::to_string(s) + ": " + st.message();
        world.Abort(errors[r]);
        return;
      }
      cs.order_hash = HashNames(out);
      cs.responses = out.size();
      {
        Charge charge(&ctrl_mem[r]);  // the runtime would free these after executing them
        out.clear();
        out.shrink_to_fit();
      }
    }
  });

  // Checks: identical ordered responses; every tensor every step; the steady path.
  for (int r = 0; r < n && res.check == "ok"; ++r) {
    if (!errors[r].empty()) res.check = "rank " + std::to_string(r) + ": " + errors[r];
    for (int s = 0; s < steps && res.check == "ok"; ++s) {
      const CycleSample& cs = samples[r][s];
      if (cs.responses != static_cast<size_t>(t) || cs.order_hash != samples[0][s].order_hash) {
        res.check = "rank " + std::to_string(r) + " step " + std::to_string(s) +
                    ": responses differ from rank 0's or are incomplete";
      } else if (s > 0 && steady_exchange &&
                 (cs.traffic.gathers != 0 ||
                  cs.traffic.allgathers + cs.traffic.bit_allreduces != 1)) {
        res.check = "rank " + std::to_string(r) + " step " + std::to_string(s) +
                    ": steady cycle used " + std::to_string(cs.traffic.gathers) + " gathers, " +
                    std::to_string(cs.traffic.allgathers) + " allgathers and " +
                    std::to_string(cs.traffic.bit_allreduces) + " bit allreduces";
      }
    }
  }

  // Wall per cycle: first rank in to last rank out.
  std::vector<double> wall(steps);
  for (int s = 0; s < steps; ++s) {
    int64_t lo = INT64_MAX, hi = INT64_MIN;
    for (int r = 0; r < n; ++r) {
      lo = std::min(lo, samples[r][s].start_ns);
      hi = std::max(hi, samples[r][s].end_ns);
    }
    wall[s] = (hi - lo) / 1e6;
  }
  res.first_wall_ms = wall[0];
  res.steady_wall_ms = Median(std::vector<double>(wall.begin() + 1, wall.end()));
  res.first_cpu0_ms = samples[0][0].cpu_ns / 1e6;
  std::vector<double> first_other, cpu0, plane0, cpu_o, plane_o, sent, recv, recv0;
  for (int r = 1; r < n; ++r) first_other.push_back(samples[r][0].cpu_ns / 1e6);
  res.first_cpu_other_ms = Median(first_other);
  for (int s = 1; s < steps; ++s) {
    cpu0.push_back(samples[0][s].cpu_ns / 1e3);
    plane0.push_back(samples[0][s].plane_cpu_ns / 1e3);
    recv0.push_back(static_cast<double>(samples[0][s].traffic.bytes_recv));
    for (int r = 1; r < n; ++r) {
      cpu_o.push_back(samples[r][s].cpu_ns / 1e3);
      plane_o.push_back(samples[r][s].plane_cpu_ns / 1e3);
      sent.push_back(static_cast<double>(samples[r][s].traffic.bytes_sent));
      recv.push_back(static_cast<double>(samples[r][s].traffic.bytes_recv));
    }
  }
  res.cpu0_us = Median(cpu0);
  res.plane0_us = Median(plane0);
  res.cpu_other_us = Median(cpu_o);
  res.plane_other_us = Median(plane_o);
  res.sent_per_rank = Median(sent);
  res.recv_per_rank = Median(recv);
  res.recv_rank0 = Median(recv0);
  res.retained0 = static_cast<double>(ctrl_mem[0].live.load());
  res.peak0 = static_cast<double>(ctrl_mem[0].peak.load());
  double retained = 0, peak = 0;
  for (int r = 1; r < n; ++r) {
    retained += static_cast<double>(ctrl_mem[r].live.load());
    peak = std::max(peak, static_cast<double>(ctrl_mem[r].peak.load()));
  }
  res.retained_other = retained / std::max(1, n - 1);
  res.peak_other = peak;
  return res;
}

std::vector<int> ParseList(const char* s) {
  std::vector<int> v;
  for (const char* p = s; *p != '\0';) {
    char* end = nullptr;
    v.push_back(static_cast<int>(std::strtol(p, &end, 10)));
    p = *end == ',' ? end + 1 : end;
    if (end == p && *p != '\0') break;
  }
  return v;
}

std::string Kb(double bytes) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), bytes < 10240 ? "%.0f B" : "%.0f KB",
                bytes < 10240 ? bytes : bytes / 1024);
  return buf;
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<int> ranks = {256, 1024}, tensors = {10, 100, 1000};
  int steps = 50;
  size_t capacity = 1024;
  std::string exchange = "allgather";
  for (int i = 1; i < argc; i += 2) {
    std::string k = argv[i];
    if (k == "--no-memory") {
      g_charge = false;
      --i;
    } else if (i + 1 == argc) {
      std::fprintf(stderr, "%s needs a value\n", k.c_str());
      return 2;
    } else if (k == "--ranks") {
      ranks = ParseList(argv[i + 1]);
    } else if (k == "--tensors") {
      tensors = ParseList(argv[i + 1]);
    } else if (k == "--steps") {
      steps = std::max(2, std::atoi(argv[i + 1]));
    } else if (k == "--capacity") {
      capacity = static_cast<size_t>(std::atoll(argv[i + 1]));
    } else if (k == "--exchange") {
      exchange = argv[i + 1];
    } else {
      std::fprintf(stderr, "unknown option %s\n", k.c_str());
      return 2;
    }
  }
  std::vector<bool> modes;
  if (exchange == "allgather" || exchange == "both") modes.push_back(true);
  if (exchange == "gather" || exchange == "both") modes.push_back(false);
  std::printf("negotiation_sim: %d steps, cache capacity %zu, %u hardware threads\n", steps,
              capacity, std::thread::hardware_concurrency());
  std::printf(
      "CPU: thread CPU per Controller::Cycle, median over steady cycles (coordinator = rank 0;\n"
      "other = median over ranks 1..N-1); 'plane' is the part spent inside the in-memory\n"
      "control plane. Wall includes scheduling N threads on these cores.\n\n");
  std::printf(
      "| ranks | tensors | steady exchange | first cycle wall ms | first cycle CPU ms rank 0 / "
      "other "
      "| steady wall ms | steady CPU us rank 0 (plane) | steady CPU us other (plane) | steady "
      "bytes sent / recv per rank | rank 0 recv | ctrl heap per rank: built / retained rank 0 / "
      "retained other | peak in a cycle rank 0 / other | mallinfo2 built per rank | check |\n");
  std::string sep = "|";
  for (int c = 0; c < 14; ++c) sep += " ---: |";
  std::printf("%s\n", sep.c_str());
  for (bool mode : modes) {
    for (int n : ranks) {
      for (int t : tensors) {
        Result r = Simulate(n, t, steps, capacity, mode);
        std::printf(
            "| %d | %d | %s | %.1f | %.2f / %.2f | %.1f | %.0f (%.0f) | %.0f (%.0f) | %s / %s | "
            "%s | %s / %s / %s | %s / %s | %s | %s |\n",
            r.ranks, r.tensors, mode ? "allgather" : "gather+bcast", r.first_wall_ms,
            r.first_cpu0_ms, r.first_cpu_other_ms, r.steady_wall_ms, r.cpu0_us, r.plane0_us,
            r.cpu_other_us, r.plane_other_us, Kb(r.sent_per_rank).c_str(),
            Kb(r.recv_per_rank).c_str(), Kb(r.recv_rank0).c_str(), Kb(r.built_bytes).c_str(),
            Kb(r.retained0).c_str(), Kb(r.retained_other).c_str(), Kb(r.peak0).c_str(),
            Kb(r.peak_other).c_str(), Kb(r.built_mallinfo).c_str(), r.check.c_str());
        std::fflush(stdout);
      }
    }
  }
  return 0;
}
