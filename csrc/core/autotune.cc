#include "core/autotune.h"

#include <algorithm>
#include <cmath>

#include "common/logging.h"

namespace hvd {
namespace {

constexpr int64_t kMB = 1024 * 1024;
const int64_t kFusionMB[] = {0, 1, 2, 4, 8, 16, 32, 64, 128};
const double kWakeUs[] = {0, 100, 250, 500, 1000, 2500, 5000};
constexpr double kLengthScale = 0.3;

double Kernel(const std::vector<double>& a, const std::vector<double>& b) {
  double d2 = 0;
  for (size_t i = 0; i < a.size(); ++i) d2 += (a[i] - b[i]) * (a[i] - b[i]);
  return std::exp(-d2 / (2 * kLengthScale * kLengthScale));
}

// In-place Cholesky factorisation of a symmetric positive definite n x n matrix
// (row-major); the lower triangle holds L afterwards.
void Cholesky(std::vector<double>& a, size_t n) {
  for (size_t j = 0; j < n; ++j) {
    double d = a[j * n + j];
    for (size_t k = 0; k < j; ++k) d -= a[j * n + k] * a[j * n + k];
    d = std::sqrt(std::max(d, 1e-12));
    a[j * n + j] = d;
    for (size_t i = j + 1; i < n; ++i) {
      double s = a[i * n + j];
      for (size_t k = 0; k < j; ++k) s -= a[i * n + k] * a[j * n + k];
      a[i * n + j] = s / d;
    }
  }
}

// Solves L x = b (forward) for lower-triangular L.
std::vector<double> Forward(const std::vector<double>& l, size_t n, std::vector<double> b) {
  for (size_t i = 0; i < n; ++i) {
    for (size_t k = 0; k < i; ++k) b[i] -= l[i * n + k] * b[k];
    b[i] /= l[i * n + i];
  }
  return b;
}

// Solves L^T x = b (backward).
std::vector<double> Backward(const std::vector<double>& l, size_t n, std::vector<double> b) {
  for (size_t i = n; i-- > 0;) {
    for (size_t k = i + 1; k < n; ++k) b[i] -= l[k * n + i] * b[k];
    b[i] /= l[i * n + i];
  }
  return b;
}

std::string Describe(const TunedParams& p) {
  return "fusion threshold " + std::to_string(p.fusion_threshold_bytes / kMB) + " MB, wake delay " +
         std::to_string(static_cast<int>(p.wake_delay_us)) + " us, response cache " +
         (p.cache_enabled ? "on" : "off");
}

}  // namespace

std::vector<TunedParams> Autotuner::Grid() {
  std::vector<TunedParams> grid;
  for (int64_t mb : kFusionMB) {
    for (double us : kWakeUs) {
      for (bool cache : {true, false}) grid.push_back(TunedParams{mb * kMB, us, cache});
    }
  }
  return grid;
}

std::vector<double> Autotuner::Features(const TunedParams& p) {
  double fusion = 0;
  if (p.fusion_threshold_bytes > 0) {
    double mb = std::max(1.0, static_cast<double>(p.fusion_threshold_bytes) / kMB);
    fusion = std::min(1.0, (1 + std::log2(mb)) / 8);
  }
  double wake = std::min(1.0, std::log1p(std::max(0.0, p.wake_delay_us) / 100) / std::log1p(50.0));
  return {fusion, wake, p.cache_enabled ? 1.0 : 0.0};
}

int Autotuner::NextCandidate(const std::vector<std::vector<double>>& candidates,
                             const std::vector<std::vector<double>>& xs,
                             const std::vector<double>& ys, double noise,
                             std::vector<double>* posterior_mean) {
  const size_t n = xs.size();
  double mean = 0, sd = 0;
  for (double y : ys) mean += y / n;
  for (double y : ys) sd += (y - mean) * (y - mean) / n;
  sd = sd > 0 ? std::sqrt(sd) : 1;
  std::vector<double> y(n);
  for (size_t i = 0; i < n; ++i) y[i] = (ys[i] - mean) / sd;
  std::vector<double> k(n * n);
  for (size_t i = 0; i < n; ++i) {
    for (size_t j = 0; j < n; ++j) k[i * n + j] = Kernel(xs[i], xs[j]) + (i == j ? noise : 0);
  }
  Cholesky(k, n);
  std::vector<double> alpha = Backward(k, n, Forward(k, n, y));
  double best = *std::max_element(y.begin(), y.end());
  int pick = -1;
  double pick_ei = -1;
  posterior_mean->assign(candidates.size(), 0);
  for (size_t c = 0; c < candidates.size(); ++c) {
    std::vector<double> ks(n);
    for (size_t i = 0; i < n; ++i) ks[i] = Kernel(candidates[c], xs[i]);
    double mu = 0;
    for (size_t i = 0; i < n; ++i) mu += ks[i] * alpha[i];
    (*posterior_mean)[c] = mu * sd + mean;
    bool seen = false;
    for (const auto& x : xs) seen = seen || x == candidates[c];
    if (seen) continue;
    std::vector<double> v = Forward(k, n, ks);
    double var = 1.0;
    for (double e : v) var -= e * e;
    double sigma = std::sqrt(std::max(var, 1e-12));
    double z = (mu - best - 0.01) / sigma;
    double cdf = 0.5 * std::erfc(-z / std::sqrt(2.0));
    double pdf = std::exp(-0.5 * z * z) / std::sqrt(2 * M_PI);
    double ei = (mu - best - 0.01) * cdf + sigma * pdf;
    if (ei > pick_ei) {
      pick_ei = ei;
      pick = static_cast<int>(c);
    }
  }
  return pick;
}

Autotuner::Autotuner(const AutotuneOptions& options, const TunedParams& initial)
    : opt_(options),
      grid_(Grid()),
      current_(initial),
      warmups_left_(options.warmup_samples),
      rng_(options.seed) {
  opt_.steps_per_sample = std::max(1, opt_.steps_per_sample);
  opt_.max_samples = std::max(1, opt_.max_samples);
  for (const auto& p : grid_) grid_x_.push_back(Features(p));
  if (!opt_.log_path.empty()) {
    log_ = std::fopen(opt_.log_path.c_str(), "w");
    if (log_ == nullptr) {
      HVD_LOG(kWarning) << "cannot write the autotune log to '" << opt_.log_path << "'";
    } else {
      std::fputs(
          "sample,phase,fusion_threshold_bytes,wake_delay_us,cache_enabled,"
          "score_bytes_per_s\n",
          log_);
      std::fflush(log_);
    }
  }
}

Autotuner::~Autotuner() {
  if (log_) std::fclose(log_);
}

void Autotuner::Log(const char* phase, const TunedParams& p, double score) {
  if (!log_) return;
  std::fprintf(log_, "%zu,%s,%lld,%.0f,%d,%.0f\n", xs_.size(), phase,
               static_cast<long long>(p.fusion_threshold_bytes), p.wake_delay_us,
               p.cache_enabled ? 1 : 0, score);
  std::fflush(log_);
}

bool Autotuner::Step(int64_t bytes, std::chrono::steady_clock::time_point now, TunedParams* next) {
  if (done_ || bytes <= 0) return false;
  if (steps_ == 0) {
    window_start_ = now;
    bytes_ = 0;
    steps_ = 1;
    return false;
  }
  bytes_ += bytes;
  if (++steps_ <= opt_.steps_per_sample) return false;
  double seconds = std::chrono::duration<double>(now - window_start_).count();
  double score = static_cast<double>(bytes_) / std::max(seconds, 1e-9);
  steps_ = 0;
  if (warmups_left_ > 0) {
    --warmups_left_;
    Log("warmup", current_, score);
    return false;
  }
  xs_.push_back(Features(current_));
  ys_.push_back(score);
  sampled_.push_back(current_);
  Log("sample", current_, score);
  std::vector<double> mean;
  int pick;
  if (static_cast<int>(xs_.size()) >= opt_.max_samples) {
    // Keep the sampled setting the model believes best (the noise-averaged score).
    std::vector<std::vector<double>> sampled(xs_);
    NextCandidate(sampled, xs_, ys_, opt_.noise, &mean);
    size_t best = std::max_element(mean.begin(), mean.end()) - mean.begin();
    TunedParams chosen = sampled_[best];
    done_ = true;
    Log("best", chosen, mean[best]);
    HVD_LOG(kInfo) << "autotune: keeping " << Describe(chosen) << " after " << xs_.size()
                   << " samples";
    bool changed = !(chosen == current_);
    current_ = chosen;
    *next = chosen;
    return changed;
  }
  if (xs_.size() < 3) {
    // Two random settings before the model has enough points to extrapolate.
    std::uniform_int_distribution<int> any(0, static_cast<int>(grid_.size()) - 1);
    do {
      pick = any(rng_);
    } while (std::find(xs_.begin(), xs_.end(), grid_x_[pick]) != xs_.end());
  } else {
    pick = NextCandidate(grid_x_, xs_, ys_, opt_.noise, &mean);
    if (pick < 0) pick = 0;
  }
  current_ = grid_[pick];
  *next = current_;
  HVD_LOG(kDebug) << "autotune: trying " << Describe(current_);
  return true;
}

}  // namespace hvd
