// core/autotune: the Gaussian-process search and the sampling schedule.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <fstream>
#include <string>

#include "core/autotune.h"

namespace hvd {
namespace {

using Clock = std::chrono::steady_clock;

TEST(Autotune, GridCoversEveryKnobAndFeaturesAreNormalised) {
  auto grid = Autotuner::Grid();
  EXPECT_EQ(grid.size(), 9u * 7u * 2u);
  for (const auto& p : grid) {
    for (double f : Autotuner::Features(p)) {
      EXPECT_GE(f, 0.0);
      EXPECT_LE(f, 1.0);
    }
  }
  EXPECT_EQ(Autotuner::Features(TunedParams{0, 0, false}), (std::vector<double>{0, 0, 0}));
  EXPECT_EQ(Autotuner::Features(TunedParams{128 << 20, 5000, true}),
            (std::vector<double>{1, 1, 1}));
}

// On a smooth score with a single peak, expected improvement walks towards the
// peak: after a handful of samples the best sampled point is near it.
TEST(Autotune, ExpectedImprovementFindsThePeak) {
  std::vector<std::vector<double>> candidates;
  for (int i = 0; i <= 20; ++i) {
    for (int j = 0; j <= 20; ++j) candidates.push_back({i / 20.0, j / 20.0});
  }
  auto score = [](const std::vector<double>& x) {
    return 100 - 80 * ((x[0] - 0.7) * (x[0] - 0.7) + (x[1] - 0.3) * (x[1] - 0.3));
  };
  std::vector<std::vector<double>> xs = {{0, 0}, {1, 1}, {0.5, 0.5}};
  std::vector<double> ys;
  for (auto& x : xs) ys.push_back(score(x));
  std::vector<double> mean;
  for (int it = 0; it < 12; ++it) {
    int pick = Autotuner::NextCandidate(candidates, xs, ys, 0.01, &mean);
    ASSERT_GE(pick, 0);
    xs.push_back(candidates[pick]);
    ys.push_back(score(candidates[pick]));
  }
  double best = *std::max_element(ys.begin(), ys.end());
  EXPECT_GT(best, 99.0) << "did not approach the peak (100)";
}

// The schedule: warmup samples are discarded, each sample spans steps_per_sample
// cycles that reduce bytes, idle cycles do not count, and after max_samples the
// tuner keeps the best setting and stops changing it. The log records it all.
TEST(Autotune, SamplesThenKeepsTheBest) {
  std::string log = ::testing::TempDir() + "autotune_test.csv";
  AutotuneOptions opt;
  opt.warmup_samples = 2;
  opt.steps_per_sample = 3;
  opt.max_samples = 6;
  opt.noise = 0.01;
  opt.log_path = log;
  TunedParams initial;
  Autotuner t(opt, initial);
  TunedParams current = initial;
  auto now = Clock::now();
  int changes = 0, cycles = 0;
  while (!t.done() && cycles < 1000) {
    ++cycles;
    now += std::chrono::milliseconds(1);
    // Score: bigger fusion buffers move more bytes per cycle.
    int64_t bytes = 1000 + current.fusion_threshold_bytes / 1024;
    TunedParams next;
    EXPECT_FALSE(t.Step(0, now, &next)) << "an idle cycle changed the setting";
    if (t.Step(bytes, now, &next)) {
      current = next;
      ++changes;
    }
  }
  ASSERT_TRUE(t.done());
  // (1 + warmups + samples) windows of (steps + 1) cycles each, roughly.
  EXPECT_LE(cycles, (opt.warmup_samples + opt.max_samples) * (opt.steps_per_sample + 1) + 2);
  EXPECT_GE(changes, opt.max_samples - 1);
  EXPECT_GE(current.fusion_threshold_bytes, 32ll << 20) << "kept a poor setting";
  TunedParams next;
  for (int i = 0; i < 50; ++i) EXPECT_FALSE(t.Step(1, now, &next));

  std::ifstream in(log);
  std::string line;
  int warmup = 0, sample = 0, best = 0;
  while (std::getline(in, line)) {
    warmup += line.find(",warmup,") != std::string::npos;
    sample += line.find(",sample,") != std::string::npos;
    best += line.find(",best,") != std::string::npos;
  }
  EXPECT_EQ(warmup, opt.warmup_samples);
  EXPECT_EQ(sample, opt.max_samples);
  EXPECT_EQ(best, 1);
  std::remove(log.c_str());
}

}  // namespace
}  // namespace hvd
