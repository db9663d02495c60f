// Autotune (HOROVOD_AUTOTUNE=1): the coordinator searches the engine's
// performance knobs during the first steps of training and then keeps the best.
//
// A sample scores one setting by bytes reduced per second, measured over
// `steps_per_sample` cycles that reduced data. The first `warmup_samples` samples
// are discarded. The search is Bayesian optimisation over a grid of settings: a
// Gaussian process (RBF kernel, `noise` added to its diagonal, scores
// standardised) models score by setting, and the next setting is the one of
// highest expected improvement. After `max_samples` settings the one with the
// highest posterior mean is kept for the rest of the job.
//
// Only the coordinator runs an Autotuner; its choices travel to every rank in
// the ResponseList, so all ranks switch at the same cycle (see Controller).
//
// Threading: used only by the background thread. Torch-free.
#pragma once

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

namespace hvd {

// The knobs autotune moves; every rank applies the same values.
struct TunedParams {
  int64_t fusion_threshold_bytes = 64 * 1024 * 1024;
  double wake_delay_us = 0;
  bool cache_enabled = true;
  bool operator==(const TunedParams& o) const {
    return fusion_threshold_bytes == o.fusion_threshold_bytes && wake_delay_us == o.wake_delay_us &&
           cache_enabled == o.cache_enabled;
  }
};

struct AutotuneOptions {
  int warmup_samples = 3;
  int steps_per_sample = 10;
  int max_samples = 20;
  double noise = 0.8;
  std::string log_path;  // CSV of samples; empty: none
  uint32_t seed = 1;
};

class Autotuner {
 public:
  Autotuner(const AutotuneOptions& options, const TunedParams& initial);
  ~Autotuner();

  // Called once per cycle with the bytes of reductions negotiated in it. Returns
  // true when the setting changes (*next holds it).
  bool Step(int64_t bytes, std::chrono::steady_clock::time_point now, TunedParams* next);
  bool done() const { return done_; }

  // Exposed for tests: the grid and the acquisition.
  static std::vector<TunedParams> Grid();
  // Index into `candidates` of the highest expected improvement given the
  // samples (xs[i] scored ys[i]); points already sampled are skipped.
  static int NextCandidate(const std::vector<std::vector<double>>& candidates,
                           const std::vector<std::vector<double>>& xs,
                           const std::vector<double>& ys, double noise,
                           std::vector<double>* posterior_mean);
  static std::vector<double> Features(const TunedParams& p);

 private:
  void Log(const char* phase, const TunedParams& p, double score);

  AutotuneOptions opt_;
  std::vector<TunedParams> grid_;
  std::vector<std::vector<double>> grid_x_;
  std::vector<std::vector<double>> xs_;
  std::vector<double> ys_;
  std::vector<TunedParams> sampled_;  // the setting of each xs_
  TunedParams current_;
  int current_index_ = -1;
  int warmups_left_;
  bool done_ = false;
  // The sample being measured.
  int steps_ = 0;
  int64_t bytes_ = 0;
  std::chrono::steady_clock::time_point window_start_;
  std::mt19937 rng_;
  std::FILE* log_ = nullptr;
};

}  // namespace hvd
