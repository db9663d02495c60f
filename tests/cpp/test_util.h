// Shared helpers for the C++ unit tests: ranks as threads in one process, a
// rendezvous store per test, a watchdog so a hung collective fails the run
// instead of hanging it.
#pragma once

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "common/status.h"
#include "rendezvous/store.h"
#include "transport/tcp_transport.h"

namespace hvd_test {

constexpr const char* kSecret = "unit-test-secret";

// Aborts the whole process (with a message naming `what`) if it is still alive
// after `seconds`: a deadlocked rank thread cannot be cancelled otherwise.
class Watchdog {
 public:
  Watchdog(double seconds, std::string what);
  ~Watchdog();
  Watchdog(const Watchdog&) = delete;
  Watchdog& operator=(const Watchdog&) = delete;

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  bool done_ = false;
  std::thread thread_;
};

// Runs fn(rank) for rank = 0..n-1, each on its own thread, and joins them all.
void RunRanks(int n, const std::function<void(int)>& fn);

double SecondsSince(std::chrono::steady_clock::time_point t);

// Options with small timeouts so that a failing test fails fast.
hvd::TcpOptions FastOptions();

// A store plus `n` connected transports, one per rank (built concurrently, each
// rank with its own StoreClient, the same prefix).
struct World {
  std::unique_ptr<hvd::StoreServer> server;
  std::vector<std::unique_ptr<hvd::StoreClient>> clients;
  std::vector<std::unique_ptr<hvd::TcpTransport>> transports;
  int size() const { return static_cast<int>(transports.size()); }
};

// Builds a World; on failure returns the first rank's error.
hvd::Status MakeWorld(int n, const hvd::TcpOptions& options, World* world,
                      const std::string& prefix = "job");
// The same with options per rank, the store on `host` (a numeric address).
hvd::Status MakeWorld(int n, const std::function<hvd::TcpOptions(int)>& options, World* world,
                      const std::string& prefix = "job", const std::string& host = "127.0.0.1");

// Captures stderr (gtest's CaptureStderr) until Take(), or until it goes out of
// scope, so that a failed ASSERT does not leave the capture on for later tests.
class StderrCapture {
 public:
  StderrCapture() { ::testing::internal::CaptureStderr(); }
  ~StderrCapture() {
    if (active_) ::testing::internal::GetCapturedStderr();
  }
  StderrCapture(const StderrCapture&) = delete;
  StderrCapture& operator=(const StderrCapture&) = delete;
  std::string Take() {
    active_ = false;
    return ::testing::internal::GetCapturedStderr();
  }

 private:
  bool active_ = true;
};

// Rank r of `w` runs small allreduces (whose sums it checks) until rank 0 has seen
// `stop` (all ranks then leave after the same round) or one fails; returns that
// failure, or Ok. Keeps every rank inside Run(), where it accepts and authenticates
// connections. *rounds (if given) counts them.
hvd::Status AllreduceUntil(World& w, int r, const std::atomic<bool>& stop, int* rounds = nullptr);

// Connects a StoreClient to `server`, failing the test on error.
std::unique_ptr<hvd::StoreClient> ConnectClient(const hvd::StoreServer& server,
                                                const std::string& secret = kSecret,
                                                double timeout_s = 5.0);

std::string StatusString(const hvd::Status& st);

}  // namespace hvd_test

// gtest-friendly status assertions.
#define HVD_ASSERT_OK(expr)                                                \
  do {                                                                     \
    ::hvd::Status _s = (expr);                                             \
    ASSERT_TRUE(_s.ok()) << #expr << ": " << ::hvd_test::StatusString(_s); \
  } while (0)
#define HVD_EXPECT_OK(expr)                                                \
  do {                                                                     \
    ::hvd::Status _s = (expr);                                             \
    EXPECT_TRUE(_s.ok()) << #expr << ": " << ::hvd_test::StatusString(_s); \
  } while (0)
