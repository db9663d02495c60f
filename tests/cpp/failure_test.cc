// Failure handling of the TCP transport: dead peers, Abort() from another
// thread, wrong job secret, ranks that never reach the rendezvous. Every test
// bounds its run time; detection times are measured and asserted.
#include <gtest/gtest.h>

#include <atomic>

#include "test_util.h"
#include "transport/tcp_transport.h"

namespace hvd {
namespace {

using hvd_test::MakeWorld;
using hvd_test::RunRanks;
using hvd_test::SecondsSince;
using hvd_test::Watchdog;
using hvd_test::World;
using Clock = std::chrono::steady_clock;

// Options where only end-of-stream detection (not the I/O timeout) can make a
// collective fail within the test's 5 s budget.
TcpOptions NoTimeoutOptions() {
  TcpOptions o;
  o.connect_timeout_s = 5;
  o.io_timeout_s = 30;
  return o;
}

void WarmUp(World& w) {
  std::vector<Status> st(w.size());
  RunRanks(w.size(), [&](int r) {
    std::vector<float> x(100000, 1.0f);  // both the direct and the ring path
    st[r] = w.transports[r]->Allreduce(x.data(), 10, DataType::kFloat32, ReduceOp::kSum);
    if (st[r].ok()) {
      st[r] = w.transports[r]->Allreduce(x.data(), x.size(), DataType::kFloat32, ReduceOp::kSum);
    }
    if (st[r].ok() && x[0] != static_cast<float>(w.size() * w.size())) {
      st[r] = Status::Aborted("wrong warm-up result");
    }
  });
  for (auto& s : st) ASSERT_TRUE(s.ok()) << s.message();
}

enum class Death { kAbort, kDestroy };

struct Outcome {
  Status st;
  double seconds = 0;
};

// Rank 2 of 3 dies (Abort() or its transport destroyed); ranks 0 and 1 then run
// one allreduce of `count` floats. With `propagate`, a survivor that fails aborts
// its own transport, as Runtime::Loop does, so the failure spreads over sockets.
std::vector<Outcome> SurvivorsAfterDeath(World& w, Death how, size_t count, bool propagate) {
  if (how == Death::kAbort) {
    w.transports[2]->Abort();
  } else {
    w.transports[2].reset();
  }
  std::vector<Outcome> out(2);
  RunRanks(2, [&](int r) {
    std::vector<float> x(count, 1.0f);
    auto t0 = Clock::now();
    out[r].st = w.transports[r]->Allreduce(x.data(), count, DataType::kFloat32, ReduceOp::kSum);
    out[r].seconds = SecondsSince(t0);
    if (!out[r].st.ok() && propagate) w.transports[r]->Abort();
  });
  return out;
}

void ExpectFailedFast(const std::vector<Outcome>& out, double limit_s) {
  for (size_t r = 0; r < out.size(); ++r) {
    EXPECT_FALSE(out[r].st.ok()) << "rank " << r << " did not notice the dead peer";
    EXPECT_EQ(out[r].st.code(), StatusCode::kAborted) << out[r].st.message();
    EXPECT_FALSE(out[r].st.message().empty());
    EXPECT_LT(out[r].seconds, limit_s) << "rank " << r << ": " << out[r].st.message();
  }
}

struct DeadPeerCase {
  Death how;
  size_t count;
  const char* name;
};

class DeadPeer : public ::testing::TestWithParam<DeadPeerCase> {};

TEST_P(DeadPeer, SurvivorsFailWithin5s) {
  Watchdog wd(40, std::string("DeadPeer ") + GetParam().name);
  World w;
  Status st = MakeWorld(3, NoTimeoutOptions(), &w);
  ASSERT_TRUE(st.ok()) << st.message();
  ASSERT_NO_FATAL_FAILURE(WarmUp(w));
  auto out = SurvivorsAfterDeath(w, GetParam().how, GetParam().count, /*propagate=*/true);
  ExpectFailedFast(out, 5.0);
  // Rank 0 talks to rank 2 directly in both algorithms: it must name it.
  EXPECT_NE(out[0].st.message().find("rank 2"), std::string::npos) << out[0].st.message();
}

INSTANTIATE_TEST_SUITE_P(Transport, DeadPeer,
                         ::testing::Values(DeadPeerCase{Death::kAbort, 100, "AbortSmall"},
                                           DeadPeerCase{Death::kAbort, 300000, "AbortRing"},
                                           DeadPeerCase{Death::kDestroy, 100, "DestroySmall"},
                                           DeadPeerCase{Death::kDestroy, 300000, "DestroyRing"}),
                         [](const ::testing::TestParamInfo<DeadPeerCase>& i) {
                           return std::string(i.param.name);
                         });

// 16 ranks: nobody but the dead rank's recursive-doubling / ring partners holds
// a socket to it; the others learn of the death as the failure spreads through
// aborted neighbours, still within seconds.
TEST(DeadPeerAtScale, FailureSpreadsThroughPartners) {
  Watchdog wd(60, "FailureSpreadsThroughPartners");
  const int n = 16, dead = 5;
  for (size_t count : {size_t{100}, size_t{300000}}) {
    World w;
    Status st = MakeWorld(n, NoTimeoutOptions(), &w);
    ASSERT_TRUE(st.ok()) << st.message();
    ASSERT_NO_FATAL_FAILURE(WarmUp(w));
    w.transports[dead]->Abort();
    std::vector<Outcome> out(n);
    RunRanks(n, [&](int r) {
      if (r == dead) return;
      std::vector<float> x(count, 1.0f);
      auto t0 = Clock::now();
      out[r].st = w.transports[r]->Allreduce(x.data(), count, DataType::kFloat32, ReduceOp::kSum);
      out[r].seconds = SecondsSince(t0);
      if (!out[r].st.ok()) w.transports[r]->Abort();
    });
    out.erase(out.begin() + dead);
    ExpectFailedFast(out, 5.0);
  }
}

// Direct (small) allreduce: every survivor talks to the dead rank itself and
// notices without any help.
TEST(DeadPeerNoPropagation, SmallAllreduceDetectsDirectly) {
  Watchdog wd(40, "SmallAllreduceDetectsDirectly");
  World w;
  Status st = MakeWorld(3, NoTimeoutOptions(), &w);
  ASSERT_TRUE(st.ok()) << st.message();
  ASSERT_NO_FATAL_FAILURE(WarmUp(w));
  ExpectFailedFast(SurvivorsAfterDeath(w, Death::kAbort, 100, /*propagate=*/false), 5.0);
}

// Ring allreduce without propagation: rank 1 never reads from rank 2. It learns
// of the death either from the RST its data to rank 2 provokes (Linux resets
// data arriving after shutdown(SHUT_RD)) or, at the latest, from the I/O
// timeout (2 s here).
TEST(DeadPeerNoPropagation, RingWithoutPropagation) {
  Watchdog wd(40, "RingWithoutPropagation");
  TcpOptions opt = NoTimeoutOptions();
  opt.io_timeout_s = 2;
  World w;
  Status st = MakeWorld(3, opt, &w);
  ASSERT_TRUE(st.ok()) << st.message();
  ASSERT_NO_FATAL_FAILURE(WarmUp(w));
  ExpectFailedFast(SurvivorsAfterDeath(w, Death::kAbort, 300000, /*propagate=*/false), 5.0);
}

// Abort() from another thread wakes a call blocked on a peer that never comes.
// (Both survivors are aborted: a rank only watches the sockets of peers it still
// has transfers with, so rank 1, blocked on the absent rank 2, would not notice
// rank 0's abort before io_timeout_s.)
TEST(TransportAbort, WakesABlockedCollective) {
  Watchdog wd(40, "WakesABlockedCollective");
  World w;
  Status st = MakeWorld(3, NoTimeoutOptions(), &w);
  ASSERT_TRUE(st.ok()) << st.message();
  std::vector<Outcome> out(2);
  std::atomic<int> started{0};
  Clock::time_point aborted_at;
  std::thread killer([&] {
    while (started < 2) std::this_thread::yield();
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    aborted_at = Clock::now();
    w.transports[0]->Abort();
    w.transports[1]->Abort();
  });
  RunRanks(2, [&](int r) {
    std::vector<float> x(1000, 1.0f);
    ++started;
    out[r].st = w.transports[r]->Allreduce(x.data(), x.size(), DataType::kFloat32, ReduceOp::kSum);
  });
  killer.join();
  double since_abort = SecondsSince(aborted_at);
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(out[r].st.code(), StatusCode::kAborted) << "rank " << r;
  }
  EXPECT_LT(since_abort, 5.0);
}

// Rank 2 is aborted from outside while all three ranks loop over collectives;
// every rank's loop must end with kAborted within 5 s of the abort.
TEST(TransportAbort, AbortDuringCollectives) {
  Watchdog wd(40, "AbortDuringCollectives");
  World w;
  Status st = MakeWorld(3, NoTimeoutOptions(), &w);
  ASSERT_TRUE(st.ok()) << st.message();
  std::vector<Status> last(3);
  std::vector<int> iterations(3, 0);
  std::vector<double> finished(3, 0);
  std::atomic<bool> go{false};
  std::atomic<int64_t> t_abort_ns{Clock::now().time_since_epoch().count()};
  std::thread killer([&] {
    while (!go) std::this_thread::yield();
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    t_abort_ns = Clock::now().time_since_epoch().count();
    w.transports[2]->Abort();
  });
  RunRanks(3, [&](int r) {
    go = true;
    std::vector<float> x(200000, 0.5f);
    auto t0 = Clock::now();
    while (SecondsSince(t0) < 20) {
      size_t count = iterations[r] % 2 ? x.size() : 17;
      last[r] = w.transports[r]->Allreduce(x.data(), count, DataType::kFloat32, ReduceOp::kMax);
      if (!last[r].ok()) {
        w.transports[r]->Abort();
        break;
      }
      ++iterations[r];
    }
    finished[r] = (Clock::now().time_since_epoch().count() - t_abort_ns.load()) * 1e-9;
  });
  killer.join();
  for (int r = 0; r < 3; ++r) {
    EXPECT_EQ(last[r].code(), StatusCode::kAborted)
        << "rank " << r << " after " << iterations[r] << " iterations";
    EXPECT_LT(finished[r], 5.0) << "rank " << r;
  }
}

// A rank that does not know the job secret cannot join the mesh.
TEST(TransportSecret, WrongSecretCannotJoin) {
  Watchdog wd(30, "WrongSecretCannotJoin");
  StoreServer server("127.0.0.1", 0, hvd_test::kSecret);
  ASSERT_TRUE(server.status().ok());
  TcpOptions opt;
  opt.connect_timeout_s = 2;
  opt.io_timeout_s = 2;
  const int n = 3;
  std::vector<Status> st(n);
  std::vector<double> took(n);
  std::vector<std::unique_ptr<StoreClient>> clients(n);
  std::vector<std::unique_ptr<TcpTransport>> ts(n);
  RunRanks(n, [&](int r) {
    auto t0 = Clock::now();
    st[r] = StoreClient::Connect("127.0.0.1", server.port(), hvd_test::kSecret, 5, &clients[r]);
    if (st[r].ok()) {
      std::string secret = r == 2 ? "an-impostor" : hvd_test::kSecret;
      st[r] = TcpTransport::Create(clients[r].get(), "job", r, n, secret, opt, &ts[r]);
    }
    took[r] = SecondsSince(t0);
  });
  for (int r = 0; r < n; ++r) {
    EXPECT_FALSE(st[r].ok()) << "rank " << r << " completed set-up with an impostor";
    EXPECT_EQ(st[r].code(), StatusCode::kAborted);
    EXPECT_LT(took[r], 5.0) << "rank " << r;
  }
  EXPECT_NE(st[2].message().find("secret"), std::string::npos) << st[2].message();
  // The others waited for rank 2 and say so.
  EXPECT_NE(st[0].message().find("rank 2 did not reach the rendezvous"), std::string::npos)
      << st[0].message();
  EXPECT_FALSE(ts[2]);
}

// A rank that never shows up: the others give up after connect_timeout_s with a
// message naming the problem.
TEST(TransportRendezvous, MissingRankTimesOut) {
  Watchdog wd(30, "MissingRankTimesOut");
  StoreServer server("127.0.0.1", 0, hvd_test::kSecret);
  ASSERT_TRUE(server.status().ok());
  TcpOptions opt;
  opt.connect_timeout_s = 1;
  opt.io_timeout_s = 1;
  std::vector<Status> st(3);
  std::vector<double> took(3);
  std::vector<std::unique_ptr<StoreClient>> clients(3);
  std::vector<std::unique_ptr<TcpTransport>> ts(3);
  RunRanks(3, [&](int r) {
    if (r == 1) return;  // never shows up
    auto t0 = Clock::now();
    st[r] = StoreClient::Connect("127.0.0.1", server.port(), hvd_test::kSecret, 5, &clients[r]);
    if (st[r].ok())
      st[r] = TcpTransport::Create(clients[r].get(), "job", r, 3, hvd_test::kSecret, opt, &ts[r]);
    took[r] = SecondsSince(t0);
  });
  for (int r : {0, 2}) {
    EXPECT_FALSE(st[r].ok()) << "rank " << r;
    EXPECT_LT(took[r], 5.0) << "rank " << r;
  }
  EXPECT_NE(st[2].message().find("rank 1 did not reach the rendezvous"), std::string::npos)
      << st[2].message();
}

}  // namespace
}  // namespace hvd
