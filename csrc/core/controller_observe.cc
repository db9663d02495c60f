// What the coordinator watches beside matching: stalled names (the stall inspector),
// the negotiation trace of cached names on the timeline, the straggler monitor, and
// the bytes reduced per cycle that autotune scores.
#include <algorithm>
#include <cstdio>

#include "common/logging.h"
#include "core/c10d_names.h"
#include "core/controller.h"

namespace hvd {

void Controller::AutotuneStep(const ResponseList& out) {
  TunedParams next;
  if (tuner_ && tuner_->Step(ReducedBytes(out), std::chrono::steady_clock::now(), &next)) {
    params_pending_ = true;
    pending_params_ = next;
  }
}

void Controller::TrackPartialBits(const std::vector<uint64_t>& any,
                                  const std::vector<uint64_t>& all) {
  using Clock = std::chrono::steady_clock;
  const auto now = Clock::now();
  // Cache positions set on some ranks but not all: OR & ~AND, a word at a time
  // (this runs every cycle on the coordinator).
  const size_t words = std::min(any.size(), all.size());
  std::map<int, Clock::time_point> still;
  for (size_t w = 0; w < words; ++w) {
    for (uint64_t partial = any[w] & ~all[w]; partial != 0; partial &= partial - 1) {
      int pos = static_cast<int>(w * 64 + static_cast<size_t>(__builtin_ctzll(partial)));
      auto it = partial_bits_.find(pos);
      still[pos] = it == partial_bits_.end() ? now : it->second;
    }
  }
  partial_bits_.swap(still);
}

void Controller::InspectStalls(const std::vector<RequestList>& lists, ResponseList* out) {
  using Clock = std::chrono::steady_clock;
  const auto now = Clock::now();
  const int size = static_cast<int>(lists.size());
  {
    // OR and AND of the ranks' ready bits (an empty list set: nothing partial).
    const size_t words = cache_.num_words();
    std::vector<uint64_t> any(words, 0), all(words, size > 0 ? ~0ull : 0);
    for (const auto& l : lists) {
      for (size_t w = 0; w < words && w < l.ready_bits.size(); ++w) {
        any[w] |= l.ready_bits[w];
        all[w] &= l.ready_bits[w];
      }
    }
    TrackPartialBits(any, all);
  }
  double age_s = std::chrono::duration<double>(now - last_stall_log_).count();
  if (age_s < stall_.check_s) return;
  std::string report;
  bool fatal = false;
  // One line of the report, about a wait of `waited` seconds.
  auto add = [&](const std::string& line, double waited) {
    report += "\n  " + line + " for " + std::to_string(static_cast<int>(waited)) + " s";
    fatal = fatal || (stall_.shutdown_s > 0 && waited >= stall_.shutdown_s);
  };
  // `expected`: the ranks that submit the name (null: every rank; Submitters()).
  auto describe = [&](const std::string& name, double waited, auto has,
                      const std::vector<int64_t>* expected = nullptr) {
    std::string ready, missing;
    for (int r = 0; r < size; ++r) {
      if (expected && std::find(expected->begin(), expected->end(), r) == expected->end()) {
        continue;
      }
      std::string& dst = has(r) ? ready : missing;
      dst += (dst.empty() ? "" : ", ") + std::to_string(r);
    }
    add("'" + name + "': submitted by ranks [" + ready + "], missing on ranks [" + missing + "]",
        waited);
  };
  for (const auto& kv : table_) {
    double waited = std::chrono::duration<double>(now - kv.second.since).count();
    if (waited < stall_.check_s) continue;
    // A receive from any source is submitted by its receiver alone, and waits for a send.
    const Request* recv = nullptr;
    for (const Request& q : kv.second.by_rank) {
      if (!q.name.empty() && IsAnyRecv(q)) recv = &q;
    }
    if (recv != nullptr) {
      P2pName p2p;
      const std::string tag =
          ParseP2pName(kv.first, &p2p) ? " with tag " + std::to_string(p2p.tag) : "";
      add("'" + kv.first + "': a receive from any source on rank " + std::to_string(recv->rank) +
              " has had no send to it" + tag,
          waited);
      continue;
    }
    describe(
        kv.first, waited, [&](int r) { return !kv.second.by_rank[r].name.empty(); },
        Submitters(kv.second));
  }
  for (const auto& kv : partial_bits_) {
    double waited = std::chrono::duration<double>(now - kv.second).count();
    if (waited < stall_.check_s) continue;
    describe(cache_.Get(kv.first).name, waited,
             [&](int r) { return TestBit(lists[r].ready_bits, kv.first); });
  }
  if (report.empty()) return;
  last_stall_log_ = now;
  // Where each rank is waiting, from the waits the ranks sent with their lists; a
  // missing rank that waits for nothing is busy outside horovod_torch.
  std::string where;
  for (int r = 0; r < size; ++r) {
    for (const std::string& w : lists[r].waits) {
      const size_t tab = w.find('\t');
      if (tab == std::string::npos) continue;
      where += "\n  rank " + std::to_string(r) + " waits for '" + w.substr(0, tab) + "' at " +
               w.substr(tab + 1);
    }
  }
  if (!where.empty()) where = "\nwhere the ranks wait (the Python caller):" + where;
  std::string message =
      "stalled collectives: some ranks submitted these and others have not (a rank skipped "
      "a collective, submitted a different name, or is stuck):" +
      report + where;
  HVD_LOG(kWarning) << message;
  if (fatal) {
    out->fatal = message + "\nstopping the job (HOROVOD_STALL_SHUTDOWN_TIME_SECONDS=" +
                 std::to_string(static_cast<int>(stall_.shutdown_s)) + ")";
  }
}

void Controller::TraceCachedBits(const std::vector<RequestList>& lists, const ResponseList& out) {
  const int size = static_cast<int>(lists.size());
  for (size_t pos = 0; pos < cache_.capacity(); ++pos) {
    const int p = static_cast<int>(pos);
    auto it = traced_bits_.find(p);
    for (int r = 0; r < size; ++r) {
      if (!TestBit(lists[r].ready_bits, pos)) continue;
      if (it == traced_bits_.end()) {
        const Response& cached = cache_.Get(p);
        timeline_->NegotiateStart(cached.name, OpName(cached));
        it = traced_bits_.emplace(p, std::vector<bool>(size, false)).first;
      }
      if (!it->second[r]) {
        it->second[r] = true;
        timeline_->NegotiateRankReady(cache_.Get(p).name, r);
      }
    }
    if (it != traced_bits_.end() &&
        (TestBit(out.ready_bits, pos) || TestBit(out.invalid_bits, pos))) {
      timeline_->NegotiateEnd(cache_.Get(p).name);
      traced_bits_.erase(it);
    }
  }
}

void Controller::EnableStragglerMonitor(const StragglerOptions& options) {
  if (control_->rank() == 0 && control_->size() > 1) {
    straggler_ = std::make_unique<StragglerMonitor>(control_->size(), options);
  }
}

void Controller::ObserveStragglers(const std::vector<RequestList>& lists, const ResponseList& out) {
  std::vector<const std::vector<uint64_t>*> bits(lists.size());
  for (size_t r = 0; r < lists.size(); ++r) bits[r] = &lists[r].ready_bits;
  straggler_->ObserveBits(bits, out.ready_bits, out.invalid_bits, std::chrono::steady_clock::now());
}

namespace {
std::string Ms(double s) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.1f ms", s * 1e3);
  return buf;
}
}  // namespace

void Controller::StragglerCycle(ResponseList* out) {
  const auto now = std::chrono::steady_clock::now();
  straggler_->NoteRank(control_->rank(), host_, wait_site_);  // its own, without a full cycle
  if (straggler_->EndCycle(now)) {
    const StragglerReport& rep = straggler_->report();
    if (rep.straggler >= 0) {
      const RankLag& s = rep.ranks[rep.straggler];
      HVD_LOG(kWarning) << "straggler: rank " << rep.straggler << " (host "
                        << (s.host.empty() ? "?" : s.host) << ") was last in "
                        << static_cast<int>(std::lround(s.last_share * 100)) << "% of the "
                        << rep.samples << " cycles (of the last " << rep.cycles
                        << ") in which a rank was " << Ms(straggler_->options().min_lag_s)
                        << " or more behind; " << Ms(s.median_s)
                        << " behind the first rank (median; 95th percentile " << Ms(s.p95_s)
                        << (rep.step_s > 0 ? "; a step takes " + Ms(rep.step_s)
                                           : std::string("; step time unknown: it is measured "
                                                         "between repeats of a cached op"))
                        << "); the other ranks wait for it at "
                        << (rep.wait_site.empty() ? "(unknown)" : rep.wait_site)
                        << " (hvd.straggler_report(); HOROVOD_STRAGGLER_* knobs)";
    } else if (named_straggler_ >= 0) {
      HVD_LOG(kInfo) << "straggler: rank " << named_straggler_ << " no longer lags";
    }
    named_straggler_ = rep.straggler;
    report_due_ = true;
  }
  const std::vector<double>& sample = straggler_->cycle_sample();
  if (!sample.empty()) {
    ++reported_samples_;
    if (timeline_ != nullptr && timeline_->active()) {
      for (size_t r = 0; r < sample.size(); ++r) {
        timeline_->Counter("STRAGGLER_LAG_MS_RANK_" + std::to_string(r), sample[r] * 1e3);
      }
    }
  }
  // About once a second while samples come in, at once when the straggler changed.
  if (now >= next_report_ && reported_samples_ > 0) report_due_ = true;
  if (out != nullptr && report_due_) {
    out->has_stragglers = true;
    out->stragglers = straggler_->report();
    report_due_ = false;
    reported_samples_ = 0;
    next_report_ = now + std::chrono::seconds(1);
  }
}

int64_t Controller::ReducedBytes(const ResponseList& out) const {
  int64_t bytes = 0;
  auto add = [&bytes](const Response& r) {
    if (!r.error.empty() || (r.type != OpType::kAllreduce && r.type != OpType::kReducescatter)) {
      return;
    }
    int64_t n = 1;
    for (int64_t d : r.shape) n *= d;
    bytes += n * static_cast<int64_t>(DataTypeSize(r.dtype));
  };
  for (size_t pos = 0; pos < cache_.capacity(); ++pos) {
    if (TestBit(out.ready_bits, pos)) add(cache_.Get(static_cast<int>(pos)));
  }
  for (const auto& r : out.responses) add(r);
  return bytes;
}

}  // namespace hvd
