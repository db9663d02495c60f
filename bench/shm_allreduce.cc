// Allreduce through shared memory (transport/shm) against the loopback TCP
// transport, both with the same number of ranks as threads of this process, float32
// sum, in the same run: the result is a ratio.
//
// Build and run from the repository root (no gtest needed; -O3 as setup.py builds
// the extension, which vectorizes the reductions):
//   g++ -std=c++17 -O3 -Icsrc -pthread -o /tmp/shm_allreduce bench/shm_allreduce.cc
//       csrc/transport/shm*.cc csrc/transport/tcp_*.cc csrc/rendezvous/store.cc
//       csrc/common/*.cc
//   /tmp/shm_allreduce [--ranks=8] [--mb=1,4,16,64] [--slot_kb=1024] [--spin_us=-1] [--procs]
//                      [--threads=-1] [--no_tcp]
// --procs runs the shared-memory side as forked processes (closer to real use);
// the TCP side always uses threads. "memcpy ms" is every rank copying its buffer
// once, all at the same time: a floor for any scheme that copies data in and out
// of shared memory.
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "rendezvous/store.h"
#include "transport/shm.h"
#include "transport/tcp_transport.h"

namespace {

using Clock = std::chrono::steady_clock;
constexpr const char* kSecret = "bench-secret";
constexpr hvd::DataType kF32 = hvd::DataType::kFloat32;
constexpr hvd::ReduceOp kSum = hvd::ReduceOp::kSum;

void Die(const std::string& what, const hvd::Status& st) {
  std::fprintf(stderr, "%s: %s\n", what.c_str(), st.message().c_str());
  std::exit(1);
}

void RunRanks(int n, const std::function<void(int)>& fn) {
  std::vector<std::thread> t;
  for (int r = 0; r < n; ++r) t.emplace_back(fn, r);
  for (auto& x : t) x.join();
}

int Iters(size_t mb) { return std::max<int>(5, static_cast<int>(128 / mb)); }
constexpr int kReps = 5;

// Seconds per allreduce of `count` floats on one rank: a warm-up call, then the
// best of kReps timed loops of Iters calls, each loop between two barriers (the
// best, because this is meant to run on shared, noisy machines). `sync` is the
// barrier, `op` the allreduce.
double TimeRank(size_t count, int iters, const std::function<void()>& sync,
                const std::function<void(float*)>& op) {
  std::vector<float> x(count, 1.0f);
  op(x.data());
  double best = 1e30;
  for (int rep = 0; rep < kReps; ++rep) {
    sync();
    auto t0 = Clock::now();
    for (int i = 0; i < iters; ++i) op(x.data());
    sync();
    best = std::min(best, std::chrono::duration<double>(Clock::now() - t0).count() / iters);
  }
  return best;
}

struct Flags {
  int ranks = 8;
  std::vector<size_t> mb = {1, 4, 16, 64};
  hvd::ShmOptions shm;
  bool procs = false;
  bool tcp = true;
};

double ShmThreads(const Flags& f, size_t mb) {
  const int n = f.ranks;
  std::vector<std::unique_ptr<hvd::ShmGroup>> g(n);
  const std::string key = "bench/" + std::to_string(::getpid()) + "/" + std::to_string(mb);
  std::vector<double> secs(n);
  RunRanks(n, [&](int r) {
    hvd::Status st = hvd::ShmGroup::Create(key, kSecret, r, n, f.shm, &g[r]);
    if (!st.ok()) Die("shm create", st);
    secs[r] = TimeRank(
        mb << 18, Iters(mb), [&] { g[r]->Barrier(); },
        [&](float* x) {
          hvd::Status s = g[r]->Allreduce(x, mb << 18, kF32, kSum);
          if (!s.ok()) Die("shm allreduce", s);
        });
  });
  return *std::max_element(secs.begin(), secs.end());
}

double ShmProcs(const Flags& f, size_t mb) {
  const int n = f.ranks;
  const std::string key = "bench/" + std::to_string(::getpid()) + "/p" + std::to_string(mb);
  int p[2];
  if (::pipe(p) != 0) std::exit(1);
  std::vector<pid_t> kids;
  for (int r = 0; r < n; ++r) {
    pid_t pid = ::fork();
    if (pid == 0) {
      std::unique_ptr<hvd::ShmGroup> g;
      hvd::Status st = hvd::ShmGroup::Create(key, kSecret, r, n, f.shm, &g);
      if (!st.ok()) Die("shm create", st);
      double s = TimeRank(
          mb << 18, Iters(mb), [&] { g->Barrier(); },
          [&](float* x) {
            hvd::Status s2 = g->Allreduce(x, mb << 18, kF32, kSum);
            if (!s2.ok()) Die("shm allreduce", s2);
          });
      if (::write(p[1], &s, sizeof(s)) != sizeof(s)) ::_exit(1);
      ::_exit(0);
    }
    kids.push_back(pid);
  }
  ::close(p[1]);
  double worst = 0, s = 0;
  while (::read(p[0], &s, sizeof(s)) == sizeof(s)) worst = std::max(worst, s);
  ::close(p[0]);
  for (pid_t k : kids) ::waitpid(k, nullptr, 0);
  return worst;
}

// The floor for any shared-memory scheme that must read each rank's input and
// write its output in private memory: every rank copies its buffer once, all at
// the same time.
double Memcpy(const Flags& f, size_t mb) {
  const int n = f.ranks;
  std::vector<double> secs(n);
  std::atomic<int> ready{0};
  RunRanks(n, [&](int r) {
    std::vector<float> y(mb << 18, 2.0f);
    secs[r] = TimeRank(
        mb << 18, Iters(mb),
        [&] {  // a spinning barrier, good enough between reps
          int target = (ready.fetch_add(1) / n + 1) * n;
          while (ready.load() < target) std::this_thread::yield();
        },
        [&](float* x) { std::memcpy(y.data(), x, mb << 20); });
  });
  return *std::max_element(secs.begin(), secs.end());
}

double Tcp(const Flags& f, size_t mb) {
  const int n = f.ranks;
  hvd::StoreServer server("127.0.0.1", 0, kSecret);
  if (!server.status().ok()) Die("store", server.status());
  std::vector<std::unique_ptr<hvd::StoreClient>> clients(n);
  std::vector<std::unique_ptr<hvd::TcpTransport>> t(n);
  std::vector<double> secs(n);
  RunRanks(n, [&](int r) {
    hvd::Status st =
        hvd::StoreClient::Connect("127.0.0.1", server.port(), kSecret, 10, &clients[r]);
    if (st.ok()) {
      st = hvd::TcpTransport::Create(clients[r].get(), "bench", r, n, kSecret, hvd::TcpOptions(),
                                     &t[r]);
    }
    if (!st.ok()) Die("tcp create", st);
    secs[r] = TimeRank(
        mb << 18, Iters(mb),
        [&] {
          float one = 0;
          t[r]->Allreduce(&one, 1, kF32, kSum);
        },
        [&](float* x) {
          hvd::Status s = t[r]->Allreduce(x, mb << 18, kF32, kSum);
          if (!s.ok()) Die("tcp allreduce", s);
        });
  });
  return *std::max_element(secs.begin(), secs.end());
}

}  // namespace

int main(int argc, char** argv) {
  Flags f;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    auto val = [&](const char* name) -> const char* {
      size_t n = std::strlen(name);
      return a.compare(0, n, name) == 0 ? a.c_str() + n : nullptr;
    };
    if (const char* v = val("--ranks="))
      f.ranks = std::atoi(v);
    else if (const char* v = val("--slot_kb="))
      f.shm.slot_bytes = std::atoll(v) * 1024;
    else if (const char* v = val("--spin_us="))
      f.shm.spin_us = std::atof(v);
    else if (const char* v = val("--threads="))
      f.shm.threads = std::atoi(v);
    else if (a == "--procs")
      f.procs = true;
    else if (a == "--no_tcp")
      f.tcp = false;
    else if (const char* v = val("--mb=")) {
      f.mb.clear();
      for (const char* p = v; *p != '\0';) {
        f.mb.push_back(std::strtoull(p, const_cast<char**>(&p), 10));
        if (*p == ',') ++p;
      }
    } else {
      std::fprintf(stderr, "unknown flag %s\n", a.c_str());
      return 2;
    }
  }
  std::printf(
      "allreduce float32 sum, %d ranks, %u CPUs, shm slot %zu KiB, spin %g us, "
      "threads per rank %d (-1: automatic), shm as %s\n",
      f.ranks, std::thread::hardware_concurrency(), f.shm.slot_bytes >> 10, f.shm.spin_us,
      f.shm.threads, f.procs ? "processes" : "threads");
  std::printf("%6s %10s %10s %10s %10s %9s %8s\n", "MB", "shm ms", "tcp ms", "shm GB/s", "tcp GB/s",
              "memcpy ms", "tcp/shm");
  for (size_t mb : f.mb) {
    double shm = f.procs ? ShmProcs(f, mb) : ShmThreads(f, mb);
    double tcp = f.tcp ? Tcp(f, mb) : 0;
    double floor = Memcpy(f, mb);
    double gb = static_cast<double>(mb) / 1024;  // algorithm bandwidth: buffer / time
    std::printf("%6zu %10.2f %10.2f %10.2f %10.2f %9.2f %7.1fx\n", mb, shm * 1e3, tcp * 1e3,
                gb / shm, gb / tcp, floor * 1e3, tcp / shm);
    std::fflush(stdout);
  }
  return 0;
}
