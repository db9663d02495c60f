// core/straggler: lateness from per-rank ready bits and from named arrivals, the
// window's statistics, who is named and when, and silence when ranks are balanced.
#include <gtest/gtest.h>

#include <random>

#include "core/straggler.h"

namespace hvd {
namespace {

using Clock = StragglerMonitor::Clock;
using std::chrono::milliseconds;

// Drives a monitor with one op (cache position 3) per step: each rank sets its bit
// `lag_ms(step, rank)` after the step starts, cycles run every millisecond, and the
// op completes in the cycle in which the last rank set it.
class Driver {
 public:
  Driver(int size, StragglerOptions o = {}) : size_(size), mon_(size, o), t_(Clock::now()) {}
  template <typename F>
  int Step(int step_ms, F lag_ms) {  // returns how many times the straggler changed
    std::vector<int> lag(size_);
    int last = 0;
    for (int r = 0; r < size_; ++r) last = std::max(last, lag[r] = lag_ms(r));
    int changes = 0;
    for (int ms = 0; ms <= last; ++ms) {
      std::vector<std::vector<uint64_t>> bits(size_, std::vector<uint64_t>(1, 0));
      std::vector<const std::vector<uint64_t>*> ptrs;
      for (int r = 0; r < size_; ++r) {
        if (ms >= lag[r]) bits[r][0] = 1ull << 3;
        ptrs.push_back(&bits[r]);
      }
      std::vector<uint64_t> done(1, ms == last ? 1ull << 3 : 0), invalid(1, 0);
      mon_.ObserveBits(ptrs, done, invalid, t_ + milliseconds(ms));
      changes += mon_.EndCycle(t_ + milliseconds(ms)) ? 1 : 0;
    }
    t_ += milliseconds(step_ms);
    // An idle cycle between steps: no sample.
    std::vector<std::vector<uint64_t>> none(size_, std::vector<uint64_t>(1, 0));
    std::vector<const std::vector<uint64_t>*> ptrs;
    for (auto& b : none) ptrs.push_back(&b);
    mon_.ObserveBits(ptrs, std::vector<uint64_t>(1, 0), std::vector<uint64_t>(1, 0), t_);
    changes += mon_.EndCycle(t_) ? 1 : 0;
    return changes;
  }
  StragglerMonitor& mon() { return mon_; }

 private:
  int size_;
  StragglerMonitor mon_;
  Clock::time_point t_;
};

TEST(Straggler, SlowRankIsNamedWithItsLag) {
  Driver d(3);
  int changes = 0;
  for (int s = 0; s < 40; ++s) changes += d.Step(300, [](int r) { return r == 1 ? 40 : 0; });
  const StragglerReport& rep = d.mon().report();
  EXPECT_EQ(rep.straggler, 1);
  EXPECT_EQ(changes, 1);  // named once
  EXPECT_EQ(rep.samples, 40);
  EXPECT_EQ(rep.cycles, 40);
  EXPECT_NEAR(rep.step_s, 0.300, 1e-3);
  EXPECT_NEAR(rep.threshold_s, 0.030, 1e-6);  // 0.1 of the step
  EXPECT_NEAR(rep.ranks[1].median_s, 0.040, 1e-6);
  EXPECT_DOUBLE_EQ(rep.ranks[1].last_share, 1.0);
  EXPECT_EQ(rep.ranks[0].median_s, 0);
  EXPECT_EQ(rep.ranks[2].last_share, 0);
}

TEST(Straggler, LagBelowTheThresholdOrTooFewSamplesNamesNobody) {
  Driver below(3);  // 20 ms behind in a 300 ms step: under 10 %
  for (int s = 0; s < 40; ++s) below.Step(300, [](int r) { return r == 2 ? 20 : 0; });
  EXPECT_EQ(below.mon().report().straggler, -1);
  EXPECT_DOUBLE_EQ(below.mon().report().ranks[2].last_share, 1.0);
  Driver few(3);  // 15 samples: under a quarter of the window (16)
  for (int s = 0; s < 15; ++s) few.Step(300, [](int r) { return r == 2 ? 100 : 0; });
  EXPECT_EQ(few.mon().report().straggler, -1);
  // At 16 rank 2 stands out; it is named when it has stood out through 16 more.
  for (int s = 0; s < 16; ++s) few.Step(300, [](int r) { return r == 2 ? 100 : 0; });
  EXPECT_EQ(few.mon().report().straggler, -1);
  few.Step(300, [](int r) { return r == 2 ? 100 : 0; });
  EXPECT_EQ(few.mon().report().straggler, 2);
}

// Hysteresis: lateness that moves from rank to rank (each behind for 20 steps, long
// enough to stand out but not to be named) names nobody, however long it goes on.
TEST(Straggler, LatenessThatMovesBetweenRanksIsNotNamed) {
  Driver d(3);
  for (int s = 0; s < 600; ++s) {
    const int slow = (s / 20) % 3;
    ASSERT_EQ(d.Step(300, [&](int r) { return r == slow ? 60 : 0; }), 0) << "step " << s;
  }
  EXPECT_EQ(d.mon().report().straggler, -1);
}

TEST(Straggler, BalancedRanksWithJitterStaySilent) {
  std::mt19937 rng(7);
  Driver d(4);
  for (int s = 0; s < 500; ++s) {
    ASSERT_EQ(d.Step(20, [&](int) { return static_cast<int>(rng() % 4); }), 0) << "step " << s;
  }
  EXPECT_EQ(d.mon().report().straggler, -1);
  EXPECT_EQ(d.mon().report().cycles, 64);
}

// A second op per step that every rank reaches together (a commit's broadcast, a
// metric) neither dilutes the straggler's share nor its median.
TEST(Straggler, OpsReachedTogetherDoNotHideTheStraggler) {
  Driver d(3);
  for (int s = 0; s < 40; ++s) {
    d.Step(0, [](int r) { return r == 2 ? 60 : 0; });
    d.Step(300, [](int r) { return r == 0 ? 1 : 0; });  // rank 0 last, by 1 ms
  }
  const StragglerReport& rep = d.mon().report();
  EXPECT_EQ(rep.cycles, 64);
  EXPECT_EQ(rep.samples, 32);
  EXPECT_EQ(rep.straggler, 2);
  EXPECT_NEAR(rep.ranks[2].median_s, 0.060, 1e-6);
  EXPECT_DOUBLE_EQ(rep.ranks[2].last_share, 1.0);
}

TEST(Straggler, RecoveryUnnamesAndAnotherRankCanBeNamed) {
  Driver d(2);
  for (int s = 0; s < 40; ++s) d.Step(100, [](int r) { return r == 0 ? 50 : 0; });
  EXPECT_EQ(d.mon().report().straggler, 0);
  for (int s = 0; s < 64; ++s) d.Step(100, [](int) { return 0; });
  EXPECT_EQ(d.mon().report().straggler, -1);
  for (int s = 0; s < 64; ++s) d.Step(100, [](int r) { return r == 1 ? 50 : 0; });
  EXPECT_EQ(d.mon().report().straggler, 1);
}

TEST(Straggler, NamedArrivalsAndTheWaitSite) {
  StragglerMonitor mon(2, StragglerOptions{});
  Clock::time_point t = Clock::now();
  mon.NoteRank(0, "hostA", "train.py:10 in main");
  mon.NoteRank(1, "hostB", "");
  for (int s = 0; s < 40; ++s) {
    t += milliseconds(100);
    mon.ObserveNamed({t, t + milliseconds(30)});
    mon.EndCycle(t + milliseconds(30));
  }
  mon.EndCycle(t + milliseconds(1000));  // a quarter second later: evaluated again
  const StragglerReport& rep = mon.report();
  EXPECT_EQ(rep.straggler, 1);
  EXPECT_EQ(rep.step_s, 0);  // named ops give no step time: the floor applies
  EXPECT_NEAR(rep.threshold_s, 0.005, 1e-9);
  EXPECT_EQ(rep.ranks[1].host, "hostB");
  EXPECT_EQ(rep.wait_site, "train.py:10 in main");
}

// Over 64 ranks: the OR of the ranks' bits gives the first rank's time, the mask of
// ranks that were behind the last rank's. One op per step; `late(r)` is how many ms
// after the others rank r sets it.
template <typename F>
int ManyRanksStep(StragglerMonitor* mon, int size, Clock::time_point* t, F late) {
  const size_t rank_words = (static_cast<size_t>(size) + 63) / 64;
  std::vector<int> lag(size);
  int last = 0;
  for (int r = 0; r < size; ++r) last = std::max(last, lag[r] = late(r));
  int changes = 0;
  const std::vector<uint64_t> bit(1, 1ull << 5), none(1, 0);
  for (int ms = 0; ms <= last; ++ms) {
    std::vector<uint64_t> behind(rank_words, 0);
    for (int r = 0; r < size; ++r) {
      if (ms > 0 && lag[r] == ms) behind[r / 64] |= 1ull << (r % 64);
    }
    mon->ObserveAny(bit, behind, ms == last ? bit : none, none, *t + milliseconds(ms));
    changes += mon->EndCycle(*t + milliseconds(ms)) ? 1 : 0;
  }
  *t += milliseconds(200);
  return changes;
}

TEST(Straggler, ManyRanksNameTheRankThatWasBehind) {
  const int size = 100;
  StragglerMonitor mon(size, StragglerOptions{});
  Clock::time_point t = Clock::now();
  int changes = 0;
  for (int s = 0; s < 40; ++s) {
    changes += ManyRanksStep(&mon, size, &t, [](int r) { return r == 77 ? 30 : 0; });
  }
  const StragglerReport& rep = mon.report();
  EXPECT_EQ(changes, 1);
  EXPECT_EQ(rep.straggler, 77);
  EXPECT_NEAR(rep.ranks[77].median_s, 0.030, 1e-6);
  EXPECT_DOUBLE_EQ(rep.ranks[77].last_share, 1.0);
  EXPECT_EQ(rep.ranks[3].median_s, 0);
  EXPECT_NEAR(rep.step_s, 0.200, 1e-3);
}

TEST(Straggler, ManyRanksWithJitterStaySilent) {
  const int size = 130;
  StragglerMonitor mon(size, StragglerOptions{});
  Clock::time_point t = Clock::now();
  std::mt19937 rng(11);
  for (int s = 0; s < 300; ++s) {
    // Every step some rank is behind by up to 9 ms: a different one each time.
    const int slow = static_cast<int>(rng() % size), by = 1 + static_cast<int>(rng() % 9);
    ASSERT_EQ(ManyRanksStep(&mon, size, &t, [&](int r) { return r == slow ? by : 0; }), 0)
        << "step " << s;
  }
  EXPECT_EQ(mon.report().straggler, -1);
}

TEST(Straggler, AJoinedRanksOpGivesNoSample) {
  StragglerMonitor mon(2, StragglerOptions{});
  std::vector<uint64_t> a(1, 1), b(1, 0), done(1, 1), none(1, 0);
  mon.ObserveBits({&a, &b}, done, none, Clock::now());  // rank 1 never had it
  mon.EndCycle(Clock::now());
  EXPECT_TRUE(mon.cycle_sample().empty());
  EXPECT_EQ(mon.report().samples, 0);
}

}  // namespace
}  // namespace hvd

namespace hvd {
namespace {

// Over 64 ranks the steady state has no per-rank bits: completions seen there are
// forgotten, so a position set again at the next full cycle counts from then, not from
// its previous step (which made every rank look a step late).
TEST(Straggler, CompletionsWithoutPerRankBitsAreForgotten) {
  StragglerMonitor mon(2, StragglerOptions{});
  const Clock::time_point t0 = Clock::now();
  std::vector<uint64_t> set(1, 1), none(1, 0);
  mon.ObserveBits({&set, &none}, none, none, t0);  // rank 0 has position 0 pending
  // ... it completes in a cycle without per-rank bits (rank 1 was behind)
  mon.ObserveAny(set, std::vector<uint64_t>(1, 2), set, none, t0 + milliseconds(1));
  mon.EndCycle(t0 + milliseconds(1));
  // A full cycle a second later: both have it again, set in this very cycle.
  mon.ObserveBits({&set, &set}, set, none, t0 + milliseconds(1000));
  mon.EndCycle(t0 + milliseconds(1000));
  ASSERT_EQ(mon.cycle_sample().size(), 2u);
  EXPECT_EQ(mon.cycle_sample()[0], 0);
  EXPECT_EQ(mon.cycle_sample()[1], 0);  // not 1 s late
}

// With HOROVOD_STRAGGLER_MIN_LAG_MS=0 and LAG=0, cycles in which every rank arrived
// together are no samples, so nobody is named in a balanced job.
TEST(Straggler, ZeroMinimumLagNamesNobodyInABalancedJob) {
  StragglerOptions o;
  o.min_lag_s = 0;
  o.lag_fraction = 0;
  Driver d(3, o);
  for (int s = 0; s < 40; ++s) d.Step(10, [](int) { return 0; });
  EXPECT_EQ(d.mon().report().straggler, -1);
  EXPECT_EQ(d.mon().report().samples, 0);
}

// The GPU signal (ObserveGpuWaits): each rank's total GPU time of its first n
// collectives. Every step adds `ops` collectives; rank r's took `took_ms(r)` in all.
class GpuDriver {
 public:
  explicit GpuDriver(int size) : size_(size), mon_(size, {}), t_(Clock::now()), totals_(size) {}
  template <typename F>
  int Step(int ops, F took_ms) {
    n_ += static_cast<uint64_t>(ops);
    for (int r = 0; r < size_; ++r) {
      totals_[r] += static_cast<uint64_t>(took_ms(r) * 1e6);
      mon_.ObserveGpuWaits(r, n_, totals_[r]);
    }
    t_ += milliseconds(50);
    return mon_.EndCycle(t_) ? 1 : 0;
  }
  StragglerMonitor& mon() { return mon_; }

 private:
  int size_;
  StragglerMonitor mon_;
  Clock::time_point t_;
  uint64_t n_ = 0;
  std::vector<uint64_t> totals_;
};

// Rank 1's GPU is 40 ms behind: its collectives start when its inputs are ready, so
// they take 40 ms less than the others', which wait inside them.
TEST(Straggler, AGpuTheOthersWaitForIsNamed) {
  GpuDriver d(3);
  int changes = 0;
  for (int s = 0; s < 60; ++s) changes += d.Step(2, [](int r) { return r == 1 ? 3.0 : 43.0; });
  const StragglerReport& rep = d.mon().report();
  EXPECT_EQ(rep.straggler, 1);
  EXPECT_EQ(changes, 1);
  // Every sample counts (as of the last evaluation, every 250 ms); the first totals are
  // where sampling starts.
  EXPECT_EQ(rep.samples, rep.cycles);
  EXPECT_GE(rep.cycles, 55);
  EXPECT_LE(rep.cycles, 59);
  EXPECT_NEAR(rep.ranks[1].median_s, 0.040, 1e-4);
  EXPECT_DOUBLE_EQ(rep.ranks[1].last_share, 1.0);
  EXPECT_EQ(rep.ranks[0].median_s, 0);
}

// Totals that reach the coordinator at different counts (a rank ahead, a rank that
// sends two steps' at once) are compared only at counts every rank has sent.
TEST(Straggler, GpuTotalsAreComparedAtCountsEveryRankSent) {
  StragglerMonitor mon(2, {});
  mon.ObserveGpuWaits(0, 2, 10'000'000);
  mon.ObserveGpuWaits(1, 2, 10'000'000);  // the start
  mon.ObserveGpuWaits(0, 4, 60'000'000);  // rank 0: 50 ms over ops 2-3
  mon.ObserveGpuWaits(0, 6, 110'000'000);
  mon.ObserveGpuWaits(1, 6, 30'000'000);  // rank 1 skips 4: 20 ms over ops 2-5
  mon.EndCycle(Clock::now());
  ASSERT_EQ(mon.cycle_sample().size(), 2u);
  EXPECT_NEAR(mon.cycle_sample()[0], 0.0, 1e-9);
  EXPECT_NEAR(mon.cycle_sample()[1], 0.080, 1e-9);  // 100 ms against its 20
  mon.ObserveGpuWaits(1, 4, 20'000'000);            // behind the last sample: ignored
  mon.EndCycle(Clock::now());
  EXPECT_TRUE(mon.cycle_sample().empty());
}

TEST(Straggler, BalancedGpusWithJitterStaySilent) {
  std::mt19937 rng(11);
  GpuDriver d(4);
  for (int s = 0; s < 500; ++s) {
    ASSERT_EQ(d.Step(3, [&](int) { return 20.0 + (rng() % 2000) / 1000.0; }), 0) << "step " << s;
  }
  EXPECT_EQ(d.mon().report().straggler, -1);
  EXPECT_EQ(d.mon().report().samples, 0);  // no rank 5 ms behind
}

}  // namespace
// A rank's totals over its timed ops in execution order: ops that complete past a
// gap (on another device) wait for it; an op the GPU could not time ends the totals
// where they were (counted as zero, it would make this rank look waited for).
TEST(Straggler, CollectiveTimesSumTheCompletedPrefix) {
  CollectiveTimes t;
  t.Add(1, 20);  // past the gap at 0
  EXPECT_EQ(t.ops, 0u);
  t.Add(0, 10);
  EXPECT_EQ(t.ops, 2u);
  EXPECT_EQ(t.took_ns, 30u);
  t.Add(3, 40);
  t.Add(2, CollectiveTimes::kUntimed);
  t.Add(4, 50);
  EXPECT_TRUE(t.ended);
  EXPECT_EQ(t.ops, 2u);
  EXPECT_EQ(t.took_ns, 30u);
  EXPECT_TRUE(t.later.empty());
}

}  // namespace hvd
