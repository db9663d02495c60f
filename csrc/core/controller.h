// The controller runs one negotiation cycle per call, for one process set.
//
// Steady state (after the first full cycle): one exchange of bit vectors (each
// rank's pending cache hits, plus a "needs a full cycle" flag), no coordinator hop.
// Up to kPerRankBitsMaxRanks ranks it is an allgather (ControlPlane::Allgather), so
// the coordinator sees which rank is ready when (timeline); beyond, an AND/OR
// allreduce (ControlPlane::AllreduceBits: O(log n) rounds of O(capacity) bits). A full cycle runs
// instead whenever any rank sets the flag: it has a request the cache cannot serve, a stale cache
// entry, a pending join or shutdown, or (coordinator) an autotune setting or a stall report to
// send. A full cycle:
//   1. sort this rank's new requests into cache hits (a bit) and misses (full text);
//   2. gather every rank's RequestList at the coordinator (rank 0);
//   3. the coordinator ANDs ready bits, ORs invalid bits, matches full requests by
//      name until every rank has submitted one, validates that they agree, and
//      orders the ready responses (grouped ones only when the whole group is ready);
//   4. every rank receives the same ResponseList and turns it into the same ordered
//      list of responses to execute, updating its cache identically.
//
// Threading: used only by the background thread. Torch-free.
#pragma once

#include <chrono>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "core/autotune.h"
#include "core/response_cache.h"
#include "core/straggler.h"
#include "core/timeline.h"
#include "transport/transport.h"
#include "wire/message.h"

namespace hvd {

// The stall inspector (coordinator only): a name some ranks submitted and others
// have not for check_s seconds is logged with the missing ranks; after shutdown_s
// (if > 0) the job fails with that message on every rank instead of hanging.
struct StallOptions {
  double check_s = 60;
  double shutdown_s = 0;
};

class Controller {
 public:
  static constexpr int kPerRankBitsMaxRanks = 64;

  Controller(ControlPlane* control, size_t cache_capacity, StallOptions stall = {});

  // One cycle. `fresh`: requests submitted since the last cycle. On return
  // *responses holds what to execute now, in order (identical on every rank).
  // *shutdown is true when any rank asked to shut down.
  Status Cycle(std::vector<Request> fresh, bool want_shutdown, std::vector<Response>* responses,
               bool* shutdown);

  // The coordinator writes negotiation spans to `timeline` (borrowed; may be
  // null or inactive).
  void SetTimeline(Timeline* timeline) { timeline_ = timeline; }
  // Where this rank's threads have waited a while ("name\tfile:line"): sent with the
  // next full cycle, for the coordinator's stall report.
  void SetWaits(std::vector<std::string> waits) { waits_ = std::move(waits); }
  // Straggler detection (core/straggler.h): the coordinator of the global set
  // measures; every rank sends its host and the Python caller of its last long wait.
  void EnableStragglerMonitor(const StragglerOptions& options);
  void SetHost(std::string host) { host_ = std::move(host); }
  void SetWaitSite(std::string site) { wait_site_ = std::move(site); }
  // This rank's GPU collectives, complete and timed (GpuBackend::CollectiveTotals):
  // sent in the steady-state exchange (up to kPerRankBitsMaxRanks ranks).
  void SetGpuTotals(uint64_t ops, uint64_t took_ns) {
    gpu_ops_ = ops;
    gpu_took_ns_ = took_ns;
  }
  // Whether the last cycle's ops ran beside a rank that has joined (it contributes
  // zeros), as the coordinator said: the same on every rank.
  bool ranks_joined() const { return ranks_joined_; }
  // The coordinator's latest report as every rank received it; the version counts
  // reports received (0: none yet).
  const StragglerReport& stragglers() const { return stragglers_; }
  uint64_t stragglers_version() const { return stragglers_version_; }
  // The setting every rank uses now; changes only through a ResponseList.
  const TunedParams& params() const { return params_; }
  void SetInitialParams(const TunedParams& p) { params_ = p; }
  // Coordinator only: tune params_ during the first cycles that reduce data.
  void EnableAutotune(std::unique_ptr<Autotuner> tuner) { tuner_ = std::move(tuner); }
  // false: every cycle is a full gather/broadcast cycle (HOROVOD_STEADY_STATE_EXCHANGE=0).
  void SetSteadyExchange(bool on) { steady_exchange_ = on; }
  bool autotune_done() const { return tuner_ == nullptr || tuner_->done(); }
  // After a cycle that reported shutdown: the lowest rank that asked for it.
  int shutdown_rank() const { return shutdown_rank_; }
  // Adds the responses this rank took since the last call: served by the response
  // cache, and negotiated in full (errors included).
  void DrainCounts(uint64_t* cached, uint64_t* negotiated) {
    *cached += cached_responses_;
    *negotiated += negotiated_responses_;
    cached_responses_ = negotiated_responses_ = 0;
  }

  // Coordinator's validation of one name's requests (one per rank, by rank).
  // Exposed for tests.
  static Response Match(const std::vector<Request>& reqs, int size);
  // Match of the requests present when some ranks submit none (their entries are
  // empty): an allreduce beside joined ranks, or an add_process_set_of_members, which
  // only the set's members submit.
  static Response MatchSubmitted(const std::vector<Request>& reqs, int size);

 private:
  void Classify(Request req, std::vector<uint64_t>* invalid);
  // The steady-state exchange; *done is false when some rank needs a full cycle.
  Status FastCycle(std::vector<Response>* responses, bool* done);
  // Coordinator, after a steady-state exchange: timeline, stall watch, autotune.
  // `any`: OR over ranks of the ready bits.
  void CoordinateFast(const std::vector<uint64_t>& any, const ResponseList& out);
  // Over kPerRankBitsMaxRanks ranks: whether this rank set, since the last exchange, a
  // position another rank had pending already (it was behind); NoteFastBits keeps what
  // that needs of an exchange (`all`: the positions pending everywhere).
  bool WasBehind(const std::vector<uint64_t>& mine) const;
  void NoteFastBits(const std::vector<uint64_t>& mine, const std::vector<uint64_t>& any,
                    const std::vector<uint64_t>& all);
  // Stall inspector bookkeeping: which cache positions are set on some ranks only.
  // `any` / `all`: OR / AND over ranks of the ready bits.
  void TrackPartialBits(const std::vector<uint64_t>& any, const std::vector<uint64_t>& all);
  void AutotuneStep(const ResponseList& out);
  ResponseList Coordinate(const std::vector<RequestList>& lists, bool* ok, std::string* error);
  void Apply(const ResponseList& list, std::vector<Response>* out);
  void ApplyParams(const ResponseList& list);
  void Requeue(int pos);
  // Coordinator: timeline spans for cached repeats, and the autotune input.
  void TraceCachedBits(const std::vector<RequestList>& lists, const ResponseList& out);
  int64_t ReducedBytes(const ResponseList& out) const;
  // Coordinator: feeds one cycle's per-rank ready bits to the straggler monitor.
  void ObserveStragglers(const std::vector<RequestList>& lists, const ResponseList& out);
  // Coordinator, at the end of every cycle: closes the monitor's cycle, logs a change
  // of straggler, writes the timeline's lag counters, and attaches the report to
  // `out` (a full cycle's reply; null in the steady state) when one is due.
  void StragglerCycle(ResponseList* out);

  ControlPlane* control_;  // borrowed
  ResponseCache cache_;
  std::vector<Request> uncached_;                 // to send in full next cycle
  std::map<int, Request> cached_pending_;         // cache position -> my request
  std::map<std::string, std::string> sent_sigs_;  // names sent in full -> my signature

  // Coordinator state: requests received so far, by name.
  struct Pending {
    std::vector<Request> by_rank;
    int count = 0;
    uint64_t order = 0;  // arrival order, for a stable response order
    std::chrono::steady_clock::time_point since;
    std::vector<std::chrono::steady_clock::time_point> arrived;  // per rank (straggler monitor)
    std::string alias;  // a send paired with a receive from any source: the receiver's name
  };
  // The ranks that submit a pending name: null for every rank; an op's participants
  // (send/recv), an add_process_set_of_members' ranks. AllMembersIn: such a name is
  // ready once each of them submitted it, or at once when the ranks that did disagree
  // on who takes part (Match then fails it on them instead of waiting for a rank that
  // will never submit it).
  static const std::vector<int64_t>* Submitters(const Pending& p);
  static bool AllMembersIn(const Pending& p);
  std::map<std::string, Pending> table_;
  uint64_t next_order_ = 0;
  // hvd.join(): ranks that have joined count as ready for every allreduce (they
  // contribute zeros) until every rank has joined.
  std::vector<bool> joined_;
  int last_joined_ = -1;

  // Stall inspector state: cache positions some ranks have pending, since when.
  // Coordinator, while ranks have joined: fails every op but allreduce and join (see
  // the .cc), adding failed groups to *failed_groups.
  void FailBesideJoin(const std::vector<RequestList>& lists,
                      std::map<int64_t, std::string>* failed_groups, ResponseList* out);
  // failed: group id (of any rank's request of a failed name) -> its error.
  void FailRestOfFailedGroups(const std::map<int64_t, std::string>& failed, ResponseList* out);
  // Coordinator, before matching: pairs each receive from any source with the earliest
  // pending send to its rank with its tag that no recv has taken.
  void BindAnySource();
  // Coordinator, after matching: torch.distributed calls that differ between ranks
  // (core/c10d_names.h) fail on every rank with the mismatch error.
  void FailDivergedCalls(const std::vector<RequestList>& lists, ResponseList* out);
  // Coordinator, in the steady state: asks for a full cycle, where FailDivergedCalls
  // looks, when a torch.distributed call has waited for other ranks a while.
  void WatchDivergence(std::chrono::steady_clock::time_point now);
  void InspectStalls(const std::vector<RequestList>& lists, ResponseList* out);
  std::vector<std::string> waits_;
  StallOptions stall_;
  int shutdown_rank_ = -1;
  std::map<int, std::chrono::steady_clock::time_point> partial_bits_;
  std::chrono::steady_clock::time_point last_stall_log_{};

  bool steady_exchange_ = true;
  uint64_t gpu_ops_ = 0, gpu_took_ns_ = 0;  // SetGpuTotals
  bool ranks_joined_ = false;               // ranks_joined()
  bool fast_ok_ = false;                    // a full cycle succeeded: capacities agree
  bool join_pending_ = false;              // this rank asked to join and the join has not completed
  std::vector<uint64_t> pending_invalid_;  // stale cache positions found since last cycle
  bool params_pending_ = false;            // coordinator: autotune setting to send in a full cycle
  TunedParams pending_params_;
  bool stall_due_ = false;    // coordinator: a stall report is due (needs a full cycle)
  bool diverge_due_ = false;  // coordinator: FailDivergedCalls should look (WatchDivergence)
  std::chrono::steady_clock::time_point last_diverge_check_{};
  bool fast_need_full_ = false;  // this cycle: this rank needs a full cycle
  // Over kPerRankBitsMaxRanks ranks, of the last steady-state exchange: this rank's
  // pending positions, and those pending somewhere but not everywhere.
  std::vector<uint64_t> fast_mine_, fast_pending_;

  std::unique_ptr<StragglerMonitor> straggler_;  // coordinator of the global set
  std::string host_, wait_site_;
  bool report_due_ = false;  // coordinator: a straggler report to send (needs a full cycle)
  uint64_t reported_samples_ = 0;
  std::chrono::steady_clock::time_point next_report_{};
  int named_straggler_ = -1;  // the straggler the log last named
  StragglerReport stragglers_;
  uint64_t stragglers_version_ = 0;

  uint64_t cached_responses_ = 0, negotiated_responses_ = 0;
  Timeline* timeline_ = nullptr;
  std::map<int, std::vector<bool>> traced_bits_;  // cache position -> ranks seen ready
  TunedParams params_;
  std::unique_ptr<Autotuner> tuner_;
};

}  // namespace hvd
