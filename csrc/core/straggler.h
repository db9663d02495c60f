// Straggler detection (coordinator of the global set only; docs/observability.md).
//
// In synchronous data parallelism every step runs at the pace of the slowest rank,
// and every rank then waits in the same collective, so the ranks' own step times
// say nothing about who is slow. The coordinator sees more: each cycle, which
// ranks have an op ready. For each op that every rank submitted, a rank's lateness
// is when the coordinator first saw it ready on that rank minus when it first saw
// it on the earliest rank (cycle timestamps: the resolution is one cycle). One
// sample per cycle in which ops completed: each rank's largest lateness over those
// ops. Of a rolling window of samples (HOROVOD_STRAGGLER_WINDOW cycles), those in
// which some rank was at least HOROVOD_STRAGGLER_MIN_LAG_MS behind count: they give,
// per rank, the median and 95th percentile lateness and the share of them in which it
// was last. A rank that is last in more than HOROVOD_STRAGGLER_SHARE of them, with a
// median lateness of at least the threshold (HOROVOD_STRAGGLER_LAG of the step time,
// at least HOROVOD_STRAGGLER_MIN_LAG_MS), stands out once a quarter of the window (at
// least 8) counts; it is named once it was also last in more than that share of as
// many more counted samples (hysteresis: lateness that moves between ranks is not).
//
// A slow GPU whose host runs ahead is not late to negotiate: its requests arrive on
// time, and then every other rank's GPU waits for it inside the collective. So each
// rank also measures, on the GPU, how long its allreduces ran from their start (their
// inputs ready) to their end (ObserveGpuWaits; allreduces, as every rank's share of
// their work is equal, and not while a rank that joined runs them with zeros, as the
// coordinator tells every rank): over the same ops, the rank whose
// collectives took the least time is the one the others waited for, and a rank's
// lateness is the longest such time of any rank minus its own. The ranks send the
// total for every prefix of their GPU ops (they run the same ops in the same order)
// in the steady-state exchange; a sample covers the ops between two totals every
// rank has sent.
//
// Where it comes from: per-rank ready bits, which the coordinator has in every full
// cycle and, up to Controller::kPerRankBitsMaxRanks ranks, in the steady-state
// exchange too; the arrival of each rank's full requests; and beyond that many ranks,
// where the steady-state exchange is an AND/OR allreduce, the OR (a position is
// pending somewhere: the first rank's time) and a mask of the ranks that set, this
// cycle, a position some rank had set before (they were behind: the last rank's time
// when the position completes). A rank in the mask is given the cycle's lateness of
// every position completing in it, a rank outside it none: exact for one late rank,
// an approximation when several are late at once (docs/observability.md).
//
// Threading: used only by the background thread. Torch-free.
#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "wire/message.h"

namespace hvd {

struct StragglerOptions {
  int window = 64;            // samples kept
  double lag_fraction = 0.1;  // threshold, as a fraction of the step time
  double min_lag_s = 0.005;   // ... and at least this
  double share = 0.5;         // a rank must be last in more than this share of samples
};

// The GPU time of a backend's collectives, each from its start (inputs ready, the ops
// before it done) to its end, summed over the first `ops` of them, all complete: what
// the straggler report compares across ranks (ObserveGpuWaits). The ops complete in
// order on each device, but not across devices: `later` holds those past a gap.
struct CollectiveTimes {
  static constexpr uint64_t kUntimed = ~0ull;  // Add()'s ns when the GPU gave no time
  uint64_t ops = 0;
  uint64_t took_ns = 0;
  std::map<uint64_t, uint64_t> later;  // by sequence
  // An op the GPU could not time ends the totals (counting it as zero would make this
  // rank look waited for): they stay where they were, and the report has host lateness.
  bool ended = false;
  void Add(uint64_t seq, uint64_t ns);
};

class StragglerMonitor {
 public:
  using Clock = std::chrono::steady_clock;

  StragglerMonitor(int size, StragglerOptions options);

  // Records what each rank sent in a full cycle: its host and its last long wait.
  void NoteRank(int rank, const std::string& host, const std::string& wait_site);
  // One cycle's per-rank ready bits (`bits[r]`: cache positions rank r has pending)
  // and the positions that complete in it (`done`: ready on every rank) or were
  // dropped (`invalid`).
  void ObserveBits(const std::vector<const std::vector<uint64_t>*>& bits,
                   const std::vector<uint64_t>& done, const std::vector<uint64_t>& invalid,
                   Clock::time_point now);
  // A cycle without per-rank bits (over Controller::kPerRankBitsMaxRanks ranks, the
  // steady state): `any`, the positions pending on some rank; `behind`, a bit per rank
  // (rank r: word r / 64) set by the ranks that were behind another on a position
  // they set this cycle; `done` and `invalid` as above.
  void ObserveAny(const std::vector<uint64_t>& any, const std::vector<uint64_t>& behind,
                  const std::vector<uint64_t>& done, const std::vector<uint64_t>& invalid,
                  Clock::time_point now);
  // A named op every rank submitted: when each rank's request arrived.
  void ObserveNamed(const std::vector<Clock::time_point>& arrived);
  // Rank r's GPU had completed its first `ops` collectives, which ran `waited_ns` in
  // total from their start to their end. Adds a sample when every rank has sent the
  // total for a number of ops past the last sample's.
  void ObserveGpuWaits(int rank, uint64_t ops, uint64_t waited_ns);
  // Ends a cycle. Every quarter of a second it re-evaluates the window; true when
  // the named straggler changed (then report() says who, and the caller logs it).
  bool EndCycle(Clock::time_point now);
  // As of the last evaluation.
  const StragglerReport& report() const { return report_; }
  const StragglerOptions& options() const { return options_; }
  // The sample this cycle added (per rank, seconds), or empty when it added none.
  const std::vector<double>& cycle_sample() const { return sample_out_; }

 private:
  void Reserve(size_t words);
  // Position `pos` newly pending somewhere: every rank's time starts at `now_ns`.
  void FirstSeen(size_t pos, int64_t now_ns);
  void AddOp(const int64_t* seen_ns, int64_t done_ns, int64_t* last_done_ns);
  void NoteStep(int64_t done_ns, int64_t* last_done_ns);
  // Word `w` of the positions that completed or were dropped: no rank has them pending
  // any more, so a repeat next cycle counts anew.
  void Forget(const std::vector<uint64_t>& done, const std::vector<uint64_t>& invalid, size_t w);
  // Whether a sample whose largest lateness is `top_lag_s` counts (some rank was at
  // least min_lag behind).
  bool Counts(float top_lag_s) const;
  void Evaluate();

  const int size_;
  const StragglerOptions options_;
  // Per cache position: when the coordinator first saw it on each rank (ns), when it
  // last completed; per rank: the positions it had pending last cycle; the positions
  // pending on some rank last cycle.
  std::vector<int64_t> seen_ns_;       // position * size + rank
  std::vector<int64_t> last_done_ns_;  // position
  std::vector<std::vector<uint64_t>> prev_bits_;
  std::vector<uint64_t> prev_any_;
  // This cycle's sample: per rank, its largest lateness (ns); any op completed?
  std::vector<int64_t> cycle_ns_;
  bool cycle_has_ = false;
  std::vector<double> sample_out_;
  // The window: `count_` samples of `size_` lags (seconds) in a ring, and the
  // intervals between repeats of an op (step time).
  std::vector<float> ring_;
  int head_ = 0;
  int count_ = 0;
  std::vector<float> steps_;
  int steps_head_ = 0;
  int steps_count_ = 0;
  std::vector<std::string> hosts_, sites_;
  // ObserveGpuWaits: per rank, its recent totals (ops -> ns); the ops of the last
  // sample and every rank's total then.
  std::vector<std::map<uint64_t, uint64_t>> gpu_totals_;
  uint64_t gpu_ops_ = 0;
  std::vector<uint64_t> gpu_waited_;
  Clock::time_point next_eval_{};
  StragglerReport report_;
  // Samples that counted, ever; the rank that stands out (-1: none), the value of
  // counted_ when it began to, and in how many counted samples since it was last
  // (Evaluate's hysteresis).
  int64_t counted_ = 0;
  int candidate_ = -1;
  int64_t candidate_since_ = 0;
  int64_t candidate_last_ = 0;
};

}  // namespace hvd
