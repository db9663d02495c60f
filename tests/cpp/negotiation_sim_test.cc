// The real hvd::Controller at 16 to 256 ranks (threads) over the in-memory control
// plane: identical ordered responses everywhere, every tensor once per step, and
// after the first step only the steady-state bit-vector exchange (one Allgather per
// cycle, no Gather), whose size does not depend on the number or names of tensors.
#include <gtest/gtest.h>

#include <algorithm>
#include <functional>
#include <map>
#include <random>

#include "core/controller.h"
#include "mem_control_plane.h"
#include "test_util.h"
#include "wire/message.h"

namespace hvd {
namespace {

using hvd_test::MemWorld;
using hvd_test::PlaneStats;
using hvd_test::RunRanks;
using hvd_test::Watchdog;

// What one rank saw in one step.
struct StepLog {
  std::vector<std::vector<Response>> cycles;  // responses per cycle
  PlaneStats traffic;                         // this rank's plane calls during the step
};

struct SimLog {
  std::vector<std::vector<StepLog>> steps;  // [rank][step]
  std::vector<Status> status;               // per rank
};

// Each step, every rank submits tensors(step) in its own shuffled order, spread
// over up to `chunks` cycles, and cycles until all of them have been executed.
SimLog Simulate(int n, int steps, size_t capacity, int chunks,
                const std::function<std::vector<Request>(int)>& tensors, uint32_t seed = 1) {
  MemWorld world(n, /*timeout_s=*/30);
  std::vector<std::unique_ptr<Controller>> ctrls;
  for (int r = 0; r < n; ++r)
    ctrls.push_back(std::make_unique<Controller>(world.plane(r), capacity));
  SimLog log;
  log.steps.assign(n, {});
  log.status.assign(n, Status::Ok());
  RunRanks(n, [&](int r) {
    std::mt19937 rng(seed * 7919u + static_cast<uint32_t>(r));
    auto fail = [&](Status st) {
      log.status[r] = st;
      world.Abort("rank " + std::to_string(r) + ": " + st.message());
    };
    for (int s = 0; s < steps; ++s) {
      std::vector<Request> mine = tensors(s);
      std::shuffle(mine.begin(), mine.end(), rng);
      std::vector<std::vector<Request>> parts(chunks);
      for (auto& q : mine) {
        q.rank = r;
        parts[rng() % chunks].push_back(q);
      }
      StepLog step;
      const PlaneStats before = world.plane(r)->stats();
      size_t done = 0;
      for (int c = 0; done < mine.size(); ++c) {
        if (c > chunks + 1) return fail(Status::Aborted("step " + std::to_string(s) + " stuck"));
        std::vector<Response> out;
        bool shutdown = false;
        Status st =
            ctrls[r]->Cycle(c < chunks ? parts[c] : std::vector<Request>{}, false, &out, &shutdown);
        if (!st.ok()) return fail(st);
        done += out.size();
        step.cycles.push_back(std::move(out));
      }
      step.traffic = world.plane(r)->stats() - before;
      log.steps[r].push_back(std::move(step));
    }
  });
  return log;
}

Request Req(const std::string& name, std::vector<int64_t> shape) {
  Request q;
  q.name = name;
  q.shape = std::move(shape);
  return q;
}

std::string Canonical(const std::vector<Response>& rs) {
  ResponseList l;
  l.responses = rs;
  return Encode(l);
}

// Steady-state bytes one rank sends per cycle. Up to 64 ranks an allgather of the
// "needs a full cycle" word plus the cache bits, to each of n - 1 peers; beyond, an
// AND/OR allreduce of the bits and (flag + bits + a bit per rank): ceil(log2 n) messages.
// Flags, the ready bits, and the GPU collectives' two totals (the straggler monitor's).
int64_t FastMessageBytes(size_t capacity) {
  return 8 * (1 + static_cast<int64_t>((capacity + 63) / 64) + 2);
}
int64_t FastCycleBytes(int n, size_t capacity) {
  if (n <= hvd::Controller::kPerRankBitsMaxRanks) return (n - 1) * FastMessageBytes(capacity);
  int rounds = 0;
  while ((1 << rounds) < n) ++rounds;
  const int64_t words = static_cast<int64_t>((capacity + 63) / 64);
  const int64_t rank_words = (n + 63) / 64;  // a bit per rank: who was behind (stragglers)
  return rounds * 8 * (2 * words + 1 + rank_words);
}

// Every rank finished every step with the same responses, cycle by cycle, and each
// step executed each of its tensors exactly once, with the submitted shape.
void ExpectConsistent(const SimLog& log, int steps,
                      const std::function<std::vector<Request>(int)>& tensors) {
  const int n = static_cast<int>(log.steps.size());
  for (int r = 0; r < n; ++r) {
    ASSERT_TRUE(log.status[r].ok()) << "rank " << r << ": " << log.status[r].message();
    ASSERT_EQ(static_cast<int>(log.steps[r].size()), steps) << "rank " << r;
  }
  for (int s = 0; s < steps; ++s) {
    const auto& ref = log.steps[0][s].cycles;
    for (int r = 1; r < n; ++r) {
      const auto& got = log.steps[r][s].cycles;
      ASSERT_EQ(got.size(), ref.size()) << "step " << s << " rank " << r;
      for (size_t c = 0; c < ref.size(); ++c) {
        ASSERT_TRUE(Canonical(got[c]) == Canonical(ref[c]))
            << "step " << s << " cycle " << c << ": rank " << r << " differs from rank 0";
      }
    }
    std::map<std::string, std::vector<int64_t>> want;
    for (const auto& q : tensors(s)) want[q.name] = q.shape;
    std::map<std::string, int> seen;
    for (const auto& cyc : ref) {
      for (const auto& resp : cyc) {
        EXPECT_EQ(resp.error, "") << resp.name;
        EXPECT_EQ(++seen[resp.name], 1) << "step " << s << ": '" << resp.name << "' ran twice";
        ASSERT_EQ(want.count(resp.name), 1u) << "step " << s << ": unexpected " << resp.name;
        EXPECT_EQ(resp.shape, want[resp.name]) << resp.name;
      }
    }
    EXPECT_EQ(seen.size(), want.size()) << "step " << s;
  }
}

std::function<std::vector<Request>(int)> Tensors(int t, const std::string& prefix) {
  return [t, prefix](int) {
    std::vector<Request> v;
    for (int i = 0; i < t; ++i) v.push_back(Req(prefix + std::to_string(i), {i % 5 + 1, 16}));
    return v;
  };
}

TEST(NegotiationSim, PlaneSemantics) {
  Watchdog wd(20, "NegotiationSim.PlaneSemantics");
  const int n = 8;
  MemWorld world(n, 10);
  std::vector<std::string> errors(n);
  RunRanks(n, [&](int r) {
    auto* p = world.plane(r);
    for (int it = 0; it < 20; ++it) {
      const std::string mine = std::to_string(r) + ":" + std::to_string(it);
      std::vector<std::string> all;
      if (!p->Gather(mine, &all).ok()) return void(errors[r] = "gather failed");
      if (r == 0) {
        for (int q = 0; q < n; ++q) {
          if (all[q] != std::to_string(q) + ":" + std::to_string(it)) errors[r] = "gather content";
        }
      }
      std::string b = r == 0 ? "root" + std::to_string(it) : "";
      if (!p->Bcast(&b).ok() || b != "root" + std::to_string(it)) errors[r] = "bcast";
      std::string fixed(4, static_cast<char>('a' + r));
      if (!p->Allgather(fixed, &all).ok() || static_cast<int>(all.size()) != n) {
        errors[r] = "allgather";
        continue;
      }
      for (int q = 0; q < n; ++q) {
        if (all[q] != std::string(4, static_cast<char>('a' + q))) errors[r] = "allgather content";
      }
    }
  });
  for (int r = 0; r < n; ++r) EXPECT_EQ(errors[r], "") << "rank " << r;
  const PlaneStats& s0 = world.plane(0)->stats();
  const PlaneStats& s1 = world.plane(1)->stats();
  EXPECT_EQ(s0.gathers, 20);
  EXPECT_EQ(s1.allgathers, 20);
  EXPECT_EQ(s0.msgs_recv, 20 * ((n - 1) + (n - 1)));  // gathers + allgathers
  EXPECT_EQ(s1.msgs_recv, 20 * (1 + (n - 1)));        // bcasts + allgathers
  // Rank 1's gather messages "1:0".."1:19" (10 x 3 + 10 x 4 bytes), its allgather
  // message to each of n - 1 peers.
  EXPECT_EQ(s1.bytes_sent, 70 + 20 * 4 * (n - 1));
}

TEST(NegotiationSim, OutOfStepRanksFailInsteadOfHanging) {
  Watchdog wd(20, "NegotiationSim.OutOfStepRanksFailInsteadOfHanging");
  MemWorld world(2, 10);
  std::vector<Status> st(2);
  RunRanks(2, [&](int r) {
    std::vector<std::string> all;
    st[r] = r == 0 ? world.plane(r)->Gather("x", &all) : world.plane(r)->Allgather("x", &all);
  });
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(st[r].code(), StatusCode::kAborted) << r;
    EXPECT_NE(st[r].message().find("out of step"), std::string::npos) << st[r].message();
  }
}

class NegotiationSimRanks : public ::testing::TestWithParam<int> {};

// 48 tensors in shuffled order over up to 3 cycles per step: the first step
// negotiates in full; every later cycle is one Allgather of the cache bits.
TEST_P(NegotiationSimRanks, SteadyStateIsOneBitVectorExchange) {
  Watchdog wd(60, "NegotiationSimRanks.SteadyStateIsOneBitVectorExchange");
  const int n = GetParam(), steps = 4, t = 48;
  const size_t capacity = 1024;
  auto tensors = Tensors(t, "model.layer.weight.grad.");
  SimLog log = Simulate(n, steps, capacity, /*chunks=*/3, tensors);
  ASSERT_NO_FATAL_FAILURE(ExpectConsistent(log, steps, tensors));
  for (int r = 0; r < n; ++r) {
    EXPECT_GT(log.steps[r][0].traffic.gathers, 0) << "rank " << r;
    for (int s = 1; s < steps; ++s) {
      const StepLog& st = log.steps[r][s];
      const int64_t cycles = static_cast<int64_t>(st.cycles.size());
      EXPECT_EQ(st.traffic.gathers, 0) << "rank " << r << " step " << s;
      EXPECT_EQ(st.traffic.bcasts, 0) << "rank " << r << " step " << s;
      EXPECT_EQ(st.traffic.allgathers + st.traffic.bit_allreduces, cycles)
          << "rank " << r << " step " << s;
      EXPECT_EQ(st.traffic.bit_allreduces > 0, n > hvd::Controller::kPerRankBitsMaxRanks);
      EXPECT_EQ(st.traffic.bytes_sent, cycles * FastCycleBytes(n, capacity))
          << "rank " << r << " step " << s;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(NegotiationSim, NegotiationSimRanks, ::testing::Values(64, 256));

// The steady-state message is the same for 4 short names and 600 long ones.
TEST(NegotiationSim, SteadyMessageIndependentOfTensorsAndNames) {
  Watchdog wd(60, "NegotiationSim.SteadyMessageIndependentOfTensorsAndNames");
  const int n = 16, steps = 3;
  const size_t capacity = 1024;
  auto few = Tensors(4, "a");
  auto many = Tensors(600, std::string(150, 'n'));
  SimLog small = Simulate(n, steps, capacity, 1, few);
  SimLog big = Simulate(n, steps, capacity, 1, many);
  ASSERT_NO_FATAL_FAILURE(ExpectConsistent(small, steps, few));
  ASSERT_NO_FATAL_FAILURE(ExpectConsistent(big, steps, many));
  for (int r = 0; r < n; ++r) {
    // The full first step carries the names: far more bytes for the long ones.
    EXPECT_GT(big.steps[r][0].traffic.bytes_sent + big.steps[r][0].traffic.bytes_recv,
              100 * (small.steps[r][0].traffic.bytes_sent + small.steps[r][0].traffic.bytes_recv));
    for (int s = 1; s < steps; ++s) {
      for (const SimLog* l : {&small, &big}) {
        const PlaneStats& tr = l->steps[r][s].traffic;
        EXPECT_EQ(tr.gathers, 0);
        EXPECT_EQ(tr.allgathers, 1);  // everything submitted at once: one cycle per step
        EXPECT_EQ(tr.bytes_sent, (n - 1) * FastMessageBytes(capacity));
        EXPECT_EQ(tr.bytes_recv, (n - 1) * FastMessageBytes(capacity));
      }
    }
  }
}

// A tensor whose shape changes mid-run costs one full negotiation (its cache
// entry is invalidated on every rank); the next step is steady again.
TEST(NegotiationSim, ChangedTensorRenegotiatesOnceThenSteady) {
  Watchdog wd(60, "NegotiationSim.ChangedTensorRenegotiatesOnceThenSteady");
  const int n = 32, steps = 4, t = 20;
  auto tensors = [t](int step) {
    std::vector<Request> v;
    for (int i = 0; i < t; ++i) v.push_back(Req("w" + std::to_string(i), {8}));
    if (step >= 2) v[7].shape = {9};
    return v;
  };
  SimLog log = Simulate(n, steps, 1024, 2, tensors, /*seed=*/5);
  ASSERT_NO_FATAL_FAILURE(ExpectConsistent(log, steps, tensors));
  for (int r = 0; r < n; ++r) {
    EXPECT_EQ(log.steps[r][1].traffic.gathers, 0) << r;
    EXPECT_GT(log.steps[r][2].traffic.gathers, 0) << r;
    EXPECT_EQ(log.steps[r][3].traffic.gathers, 0) << r;
  }
}

}  // namespace
}  // namespace hvd
