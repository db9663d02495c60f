// The straggler monitor driven by real controllers over the TCP mesh, in the
// steady-state exchange over Controller::kPerRankBitsMaxRanks ranks (the AND/OR
// allreduce, where no rank's bits reach the coordinator): the rank that is behind is
// still named, on every rank.
#include <gtest/gtest.h>

#include <chrono>
#include <thread>

#include "core/controller.h"
#include "test_util.h"

namespace hvd {
namespace {

using hvd_test::RunRanks;
using hvd_test::Watchdog;
using hvd_test::World;

Request Grad(int rank) {
  Request r;
  r.name = "grad";
  r.type = OpType::kAllreduce;
  r.shape = {4};
  r.rank = rank;
  return r;
}

// Steps of six cycles at least 5 ms apart; every rank submits the same allreduce in a
// step's first cycle except `slow`, which submits it in the fourth (`slow` -1: none).
// Returns what rank 1 was last told of stragglers (the coordinator reports about once
// a second, and at once when the straggler changes).
StragglerReport RunSteps(int n, int slow, int steps) {
  World world;
  Status st = hvd_test::MakeWorld(n, hvd_test::FastOptions(), &world);
  EXPECT_TRUE(st.ok()) << st.message();
  std::vector<std::unique_ptr<Controller>> ctrls;
  for (int r = 0; r < n; ++r) {
    ctrls.push_back(std::make_unique<Controller>(world.transports[r].get(), 16));
  }
  ctrls[0]->EnableStragglerMonitor(StragglerOptions{});
  RunRanks(n, [&](int r) {
    for (int s = 0; s < steps; ++s) {
      for (int c = 0; c < 6; ++c) {
        std::vector<Request> fresh;
        if (c == (r == slow ? 3 : 0)) fresh.push_back(Grad(r));
        std::this_thread::sleep_for(std::chrono::milliseconds(5));
        std::vector<Response> out;
        bool shutdown = false;
        Status cs = ctrls[r]->Cycle(std::move(fresh), false, &out, &shutdown);
        ASSERT_TRUE(cs.ok()) << "rank " << r << ": " << cs.message();
      }
    }
  });
  return ctrls[1]->stragglers();
}

TEST(ControllerStragglers, ManyRanksNameTheRankBehindInTheSteadyState) {
  Watchdog wd(240, "ManyRanksNameTheRankBehindInTheSteadyState");
  const int n = Controller::kPerRankBitsMaxRanks + 2;
  const StragglerReport rep = RunSteps(n, n - 2, 60);
  ASSERT_EQ(static_cast<int>(rep.ranks.size()), n);
  EXPECT_EQ(rep.straggler, n - 2);
  EXPECT_GE(rep.samples, 16);
  // Last in (nearly) every sample: on a loaded 2-core host another of the 66 threads
  // is now and then descheduled long enough to be behind once.
  EXPECT_GE(rep.ranks[n - 2].last_share, 0.9);
  EXPECT_GE(rep.ranks[n - 2].median_s, 0.015);  // three cycles of at least 5 ms
  EXPECT_EQ(rep.ranks[0].median_s, 0);
}

TEST(ControllerStragglers, ManyBalancedRanksNameNobody) {
  Watchdog wd(240, "ManyBalancedRanksNameNobody");
  const int n = Controller::kPerRankBitsMaxRanks + 2;
  const StragglerReport rep = RunSteps(n, -1, 80);
  EXPECT_GE(rep.cycles, 32);  // the steady state's completions were measured
  EXPECT_EQ(rep.samples, 0);  // and nobody was behind
  EXPECT_EQ(rep.straggler, -1);
}

}  // namespace
}  // namespace hvd
