#include "core/straggler.h"

#include <algorithm>
#include <cmath>

#include "core/response_cache.h"

namespace hvd {
namespace {

int64_t Ns(StragglerMonitor::Clock::time_point t) {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(t.time_since_epoch()).count();
}

// The q-quantile of `v` (nearest rank); sorts it.
double Quantile(std::vector<float>* v, double q) {
  if (v->empty()) return 0;
  std::sort(v->begin(), v->end());
  size_t k = static_cast<size_t>(std::ceil(q * static_cast<double>(v->size())));
  return (*v)[std::min(v->size() - 1, k == 0 ? 0 : k - 1)];
}

template <typename F>
void ForEachBit(uint64_t word, size_t w, F f) {
  for (; word != 0; word &= word - 1) f(w * 64 + static_cast<size_t>(__builtin_ctzll(word)));
}

}  // namespace

StragglerMonitor::StragglerMonitor(int size, StragglerOptions options)
    : size_(size),
      options_(options),
      prev_bits_(size),
      cycle_ns_(size, 0),
      ring_(static_cast<size_t>(std::max(1, options.window)) * size, 0.f),
      steps_(static_cast<size_t>(std::max(1, options.window)), 0.f),
      hosts_(size),
      sites_(size),
      gpu_totals_(size),
      gpu_waited_(size, 0) {
  report_.ranks.resize(size);
}

void StragglerMonitor::NoteRank(int rank, const std::string& host, const std::string& wait_site) {
  if (rank < 0 || rank >= size_) return;
  hosts_[rank] = host;
  if (!wait_site.empty()) sites_[rank] = wait_site;
}

void StragglerMonitor::Reserve(size_t words) {
  if (last_done_ns_.size() < words * 64) {
    last_done_ns_.resize(words * 64, 0);
    seen_ns_.resize(words * 64 * static_cast<size_t>(size_), 0);
  }
  if (prev_any_.size() < words) prev_any_.resize(words, 0);
}

void StragglerMonitor::FirstSeen(size_t pos, int64_t now_ns) {
  std::fill_n(&seen_ns_[pos * size_], size_, now_ns);
}

void StragglerMonitor::ObserveBits(const std::vector<const std::vector<uint64_t>*>& bits,
                                   const std::vector<uint64_t>& done,
                                   const std::vector<uint64_t>& invalid, Clock::time_point now) {
  const size_t words = done.size();
  if (static_cast<int>(bits.size()) != size_) return;
  Reserve(words);
  const int64_t now_ns = Ns(now);
  // A position newly pending somewhere starts every rank's time (a rank that has it
  // only later gets its own below, then), so no rank keeps a time from a past step.
  for (size_t w = 0; w < words; ++w) {
    uint64_t any = 0;
    for (int r = 0; r < size_; ++r) any |= w < bits[r]->size() ? (*bits[r])[w] : 0;
    ForEachBit(any & ~prev_any_[w], w, [&](size_t pos) { FirstSeen(pos, now_ns); });
    prev_any_[w] |= any;
  }
  // A position newly set on a rank: it became ready there now.
  for (int r = 0; r < size_; ++r) {
    std::vector<uint64_t>& prev = prev_bits_[r];
    prev.resize(words, 0);
    const std::vector<uint64_t>& cur = *bits[r];
    for (size_t w = 0; w < words; ++w) {
      const uint64_t now_bits = w < cur.size() ? cur[w] : 0;
      ForEachBit(now_bits & ~prev[w], w,
                 [&](size_t pos) { seen_ns_[pos * size_ + static_cast<size_t>(r)] = now_ns; });
      prev[w] = now_bits;
    }
  }
  // A completed position is a sample when every rank had it (not so for a joined
  // rank); either way its bits are forgotten, so a repeat next cycle counts anew.
  for (size_t w = 0; w < words; ++w) {
    ForEachBit(done[w], w, [&](size_t pos) {
      bool everyone = true;
      for (int r = 0; r < size_; ++r) everyone = everyone && (prev_bits_[r][w] >> (pos % 64)) & 1;
      if (everyone) AddOp(&seen_ns_[pos * size_], now_ns, &last_done_ns_[pos]);
    });
    Forget(done, invalid, w);
  }
}

void StragglerMonitor::ObserveAny(const std::vector<uint64_t>& any,
                                  const std::vector<uint64_t>& behind,
                                  const std::vector<uint64_t>& done,
                                  const std::vector<uint64_t>& invalid, Clock::time_point now) {
  const size_t words = done.size();
  Reserve(words);
  const int64_t now_ns = Ns(now);
  std::vector<int> late;  // the ranks that were behind another this cycle
  for (int r = 0; r < size_; ++r) {
    if (TestBit(behind, static_cast<size_t>(r))) late.push_back(r);
  }
  for (size_t w = 0; w < words; ++w) {
    const uint64_t cur = w < any.size() ? any[w] : 0;
    ForEachBit(cur & ~prev_any_[w], w, [&](size_t pos) { FirstSeen(pos, now_ns); });
    ForEachBit(done[w], w, [&](size_t pos) {
      int64_t* seen = &seen_ns_[pos * size_];
      // Pending before this cycle: the ranks that set a position late now were behind.
      if (TestBit(prev_any_, pos)) {
        for (int r : late) seen[r] = now_ns;
      }
      AddOp(seen, now_ns, &last_done_ns_[pos]);
    });
    prev_any_[w] |= cur;
    Forget(done, invalid, w);
  }
}

void StragglerMonitor::Forget(const std::vector<uint64_t>& done,
                              const std::vector<uint64_t>& invalid, size_t w) {
  const uint64_t gone = done[w] | (w < invalid.size() ? invalid[w] : 0);
  for (int r = 0; r < size_; ++r) {
    if (w < prev_bits_[r].size()) prev_bits_[r][w] &= ~gone;
  }
  if (w < prev_any_.size()) prev_any_[w] &= ~gone;
}

void StragglerMonitor::ObserveNamed(const std::vector<Clock::time_point>& arrived) {
  if (static_cast<int>(arrived.size()) != size_) return;
  std::vector<int64_t> ns(size_);
  for (int r = 0; r < size_; ++r) ns[r] = Ns(arrived[r]);
  AddOp(ns.data(), 0, nullptr);
}

void StragglerMonitor::AddOp(const int64_t* seen_ns, int64_t done_ns, int64_t* last_done_ns) {
  const int64_t first = *std::min_element(seen_ns, seen_ns + size_);
  for (int r = 0; r < size_; ++r) cycle_ns_[r] = std::max(cycle_ns_[r], seen_ns[r] - first);
  cycle_has_ = true;
  if (last_done_ns != nullptr) NoteStep(done_ns, last_done_ns);
}

void CollectiveTimes::Add(uint64_t seq, uint64_t ns) {
  if (ended) return;
  later[seq] = ns;
  while (!later.empty() && later.begin()->first == ops) {
    if (later.begin()->second == kUntimed) {
      ended = true;
      later.clear();
      return;
    }
    took_ns += later.begin()->second;
    ++ops;
    later.erase(later.begin());
  }
}

void StragglerMonitor::ObserveGpuWaits(int rank, uint64_t ops, uint64_t waited_ns) {
  if (rank < 0 || rank >= size_ || ops <= gpu_ops_) return;
  auto& mine = gpu_totals_[rank];
  mine[ops] = waited_ns;
  while (mine.size() > 256) mine.erase(mine.begin());  // a rank far ahead keeps its latest
  // A count becomes common to every rank when its last rank sends it, so only this one
  // can have: a larger common count was taken when it was sent, and this one is then
  // behind the last sample (refused above).
  for (int r = 0; r < size_; ++r) {
    if (gpu_totals_[r].count(ops) == 0) return;
  }
  const uint64_t common = ops;
  const bool first = gpu_ops_ == 0;
  std::vector<int64_t> took(size_);
  for (int r = 0; r < size_; ++r) {
    auto& totals = gpu_totals_[r];
    const uint64_t total = totals.at(common);
    took[r] = static_cast<int64_t>(total - gpu_waited_[r]);
    gpu_waited_[r] = total;
    totals.erase(totals.begin(), totals.upper_bound(common));
  }
  gpu_ops_ = common;
  if (first) return;  // the totals before it are where the next sample starts
  // The rank whose collectives took the least was the one the others waited for: each
  // rank is as late as the longest time less its own (AddOp's lateness, from a shared
  // end).
  const int64_t longest = *std::max_element(took.begin(), took.end());
  for (int64_t& t : took) t = longest - t;
  AddOp(took.data(), 0, nullptr);
}

void StragglerMonitor::NoteStep(int64_t done_ns, int64_t* last_done_ns) {
  if (*last_done_ns != 0) {
    steps_[steps_head_] = static_cast<float>(static_cast<double>(done_ns - *last_done_ns) * 1e-9);
    steps_head_ = (steps_head_ + 1) % static_cast<int>(steps_.size());
    steps_count_ = std::min(steps_count_ + 1, static_cast<int>(steps_.size()));
  }
  *last_done_ns = done_ns;
}

bool StragglerMonitor::EndCycle(Clock::time_point now) {
  sample_out_.clear();
  if (cycle_has_) {
    float* row = &ring_[static_cast<size_t>(head_) * size_];
    sample_out_.resize(size_);
    float top = 0;
    for (int r = 0; r < size_; ++r) {
      sample_out_[r] = static_cast<double>(cycle_ns_[r]) * 1e-9;
      row[r] = static_cast<float>(sample_out_[r]);
      top = std::max(top, row[r]);
      cycle_ns_[r] = 0;
    }
    if (Counts(top)) {
      ++counted_;
      if (candidate_ >= 0 && row[candidate_] == top) ++candidate_last_;
    }
    const int window = static_cast<int>(ring_.size()) / size_;
    head_ = (head_ + 1) % window;
    count_ = std::min(count_ + 1, window);
    cycle_has_ = false;
  }
  if (now < next_eval_) return false;
  next_eval_ = now + std::chrono::milliseconds(250);
  const int before = report_.straggler;
  Evaluate();
  return report_.straggler != before;
}

bool StragglerMonitor::Counts(float top_lag_s) const {
  return top_lag_s > 0 && top_lag_s >= options_.min_lag_s;
}

void StragglerMonitor::Evaluate() {
  StragglerReport& rep = report_;
  rep.cycles = count_;
  std::vector<float> steps(steps_.begin(), steps_.begin() + steps_count_);
  rep.step_s = Quantile(&steps, 0.5);
  rep.threshold_s = std::max(options_.min_lag_s, options_.lag_fraction * rep.step_s);
  // The samples that count: cycles in which some rank was at least min_lag behind (a
  // wait worth naming). Cycles of ops every rank reached together (a metric's
  // allreduce right after the gradients', a commit's broadcast) say nothing about who
  // holds the job up, and would dilute a straggler's share and median.
  std::vector<const float*> rows;
  for (int i = 0; i < count_; ++i) {
    const float* row = &ring_[static_cast<size_t>(i) * size_];
    if (Counts(*std::max_element(row, row + size_))) rows.push_back(row);
  }
  rep.samples = static_cast<int32_t>(rows.size());
  std::vector<int> last(size_, 0);
  for (const float* row : rows) {
    const float top = *std::max_element(row, row + size_);
    for (int r = 0; r < size_; ++r) last[r] += row[r] == top ? 1 : 0;
  }
  // Enough samples to judge: a quarter of the window (at least 8).
  const int enough = std::max(8, static_cast<int>(ring_.size()) / size_ / 4);
  int pick = -1;
  std::vector<float> lags(rows.size());
  for (int r = 0; r < size_; ++r) {
    for (size_t i = 0; i < rows.size(); ++i) lags[i] = rows[i][r];
    RankLag& out = rep.ranks[r];
    out.host = hosts_[r];
    out.p95_s = Quantile(&lags, 0.95);
    out.median_s = Quantile(&lags, 0.5);
    out.last_share = rows.empty() ? 0 : static_cast<double>(last[r]) / rows.size();
    if (rep.samples >= enough && out.last_share > options_.share &&
        out.median_s >= rep.threshold_s && (pick < 0 || out.median_s > rep.ranks[pick].median_s)) {
      pick = r;
    }
  }
  // Hysteresis: a rank that stands out is named once it was also last in more than
  // `share` of the next `enough` (or more) counted samples, and stays named while it
  // stands out. A rank that is behind for a while and then another (scheduling noise,
  // a job whose collectives alternate with another library's) is named neither time.
  if (pick != candidate_) {
    candidate_ = pick;
    candidate_since_ = counted_;
    candidate_last_ = 0;
  }
  const int64_t since = counted_ - candidate_since_;
  const bool confirmed = since >= enough && candidate_last_ > options_.share * since;
  rep.straggler = pick >= 0 && (pick == rep.straggler || confirmed) ? pick : -1;
  // Where the others wait for it: rank 0's last long wait, else another rank's.
  rep.wait_site.clear();
  for (int r = 0; r < size_ && rep.straggler >= 0 && rep.wait_site.empty(); ++r) {
    if (r != rep.straggler) rep.wait_site = sites_[r];
  }
}

}  // namespace hvd
