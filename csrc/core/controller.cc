#include "core/controller.h"

#include <algorithm>
#include <cmath>
#include <cstdio>

#include "common/check.h"
#include "common/logging.h"

namespace hvd {
namespace {

// Plain string building (no iostreams: the extension may meet a different
// libstdc++ in the host process, and its locale facets then crash integer output).
std::string ShapeStr(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

// Builds "rank 0 has X, rank 1 has Y".
template <typename F>
std::string Disagreement(const std::vector<Request>& reqs, F field) {
  std::string s;
  for (size_t r = 0; r < reqs.size(); ++r) {
    s += (r ? ", rank " : "rank ") + std::to_string(reqs[r].rank) + " has " + field(reqs[r]);
  }
  return s;
}

}  // namespace

Controller::Controller(ControlPlane* control, size_t cache_capacity, StallOptions stall)
    : control_(control), cache_(cache_capacity), stall_(stall) {}

void Controller::Classify(Request req, std::vector<uint64_t>* invalid) {
  std::string sig = req.Signature();
  bool same = false;
  int pos = req.group_id == 0 && params_.cache_enabled ? cache_.Lookup(req.name, sig, &same) : -1;
  if (pos >= 0 && same) {
    cached_pending_[pos] = std::move(req);
    return;
  }
  if (pos >= 0) SetBit(invalid, pos);
  sent_sigs_[req.name] = sig;
  uncached_.push_back(std::move(req));
}

Status Controller::Cycle(std::vector<Request> fresh, bool want_shutdown,
                         std::vector<Response>* responses, bool* shutdown) {
  const size_t words = cache_.num_words();
  if (pending_invalid_.size() != words) pending_invalid_.assign(words, 0);
  for (auto& r : fresh) {
    join_pending_ = join_pending_ || r.type == OpType::kJoin;
    Classify(std::move(r), &pending_invalid_);
  }
  responses->clear();
  *shutdown = false;
  bool any_invalid = false;
  for (uint64_t w : pending_invalid_) any_invalid = any_invalid || w != 0;
  if (fast_ok_ && steady_exchange_) {
    bool need_full = !uncached_.empty() || want_shutdown || join_pending_ || any_invalid ||
                     params_pending_ || stall_due_ || report_due_;
    bool done = false;
    fast_need_full_ = need_full;
    HVD_RETURN_IF_ERROR(FastCycle(responses, &done));
    if (done) return Status::Ok();
  }
  RequestList mine;
  mine.invalid_bits.swap(pending_invalid_);
  pending_invalid_.assign(words, 0);
  mine.ready_bits.assign(words, 0);
  for (auto& kv : cached_pending_) SetBit(&mine.ready_bits, kv.first);
  mine.requests.swap(uncached_);
  mine.shutdown = want_shutdown;
  mine.cache_capacity = static_cast<uint32_t>(cache_.capacity());
  mine.waits = waits_;
  mine.host = host_;
  mine.wait_site = wait_site_;

  std::vector<std::string> gathered;
  HVD_RETURN_IF_ERROR(control_->Gather(Encode(mine), &gathered));
  std::string reply;
  if (control_->rank() == 0) {
    std::vector<RequestList> lists(gathered.size());
    for (size_t r = 0; r < gathered.size(); ++r)
      HVD_RETURN_IF_ERROR(Decode(gathered[r], &lists[r]));
    bool ok = true;
    std::string error;
    ResponseList out = Coordinate(lists, &ok, &error);
    if (!ok) return Status::Aborted(error);
    if (timeline_ != nullptr && timeline_->active()) TraceCachedBits(lists, out);
    if (straggler_) {
      for (size_t r = 0; r < lists.size(); ++r) {
        straggler_->NoteRank(static_cast<int>(r), lists[r].host, lists[r].wait_site);
      }
      ObserveStragglers(lists, out);
      StragglerCycle(&out);
    }
    AutotuneStep(out);
    if (params_pending_) {
      out.has_params = true;
      out.fusion_threshold_bytes = pending_params_.fusion_threshold_bytes;
      out.wake_delay_us = pending_params_.wake_delay_us;
      out.cache_enabled = pending_params_.cache_enabled;
      params_pending_ = false;
    }
    stall_due_ = false;
    reply = Encode(out);
  }
  HVD_RETURN_IF_ERROR(control_->Bcast(&reply));
  ResponseList list;
  HVD_RETURN_IF_ERROR(Decode(reply, &list));
  if (!list.fatal.empty()) return Status::Aborted(list.fatal);
  if (list.has_stragglers) {
    stragglers_ = std::move(list.stragglers);
    ++stragglers_version_;
  }
  responses->clear();
  Apply(list, responses);
  *shutdown = list.shutdown;
  if (list.shutdown) shutdown_rank_ = list.shutdown_rank;
  fast_ok_ = true;  // capacities were checked: the steady-state exchange is safe now
  return Status::Ok();
}

Status Controller::FastCycle(std::vector<Response>* responses, bool* done) {
  const size_t words = cache_.num_words();
  std::vector<uint64_t> mine(words, 0);
  for (auto& kv : cached_pending_) mine[kv.first / 64] |= 1ull << (kv.first % 64);
  const int size = control_->size();
  const bool coordinator = control_->rank() == 0;
  ResponseList out;
  out.invalid_bits.assign(words, 0);
  std::vector<uint64_t> any;       // OR over ranks (coordinator: for the stall inspector)
  std::vector<RequestList> lists;  // per rank (coordinator, per-rank exchange only)
  if (size > kPerRankBitsMaxRanks) {
    // Many ranks: an AND/OR allreduce, O(log n) rounds of O(capacity) bits. The
    // coordinator learns which positions are ready somewhere (OR) but not on
    // which ranks: a timeline marks cached ops ready on all ranks at once.
    out.ready_bits = mine;
    any.assign(1 + words, 0);
    any[0] = fast_need_full_ ? 1 : 0;
    std::copy(mine.begin(), mine.end(), any.begin() + 1);
    HVD_RETURN_IF_ERROR(control_->AllreduceBits(&out.ready_bits, &any));
    *done = (any[0] & 1) == 0;
    any.erase(any.begin());
  } else {
    // Few ranks: every rank's bits to every rank (one allgather), so the
    // coordinator's timeline shows when each rank became ready.
    std::vector<uint64_t> msg(1 + words, 0);
    msg[0] = fast_need_full_ ? 1 : 0;
    std::copy(mine.begin(), mine.end(), msg.begin() + 1);
    std::vector<std::string> all;
    HVD_RETURN_IF_ERROR(control_->Allgather(
        std::string(reinterpret_cast<const char*>(msg.data()), msg.size() * 8), &all));
    out.ready_bits.assign(words, ~0ull);
    any.assign(words, 0);
    if (coordinator) lists.resize(all.size());
    bool need_full = false;
    for (size_t r = 0; r < all.size(); ++r) {
      if (all[r].size() != msg.size() * 8) {
        return Status::Aborted("rank " + std::to_string(r) + " sent a malformed cache exchange");
      }
      const uint64_t* w = reinterpret_cast<const uint64_t*>(all[r].data());
      need_full = need_full || (w[0] & 1);
      if (coordinator) lists[r].ready_bits.assign(w + 1, w + 1 + words);
      for (size_t i = 0; i < words; ++i) {
        out.ready_bits[i] &= w[1 + i];
        any[i] |= w[1 + i];
      }
    }
    *done = !need_full;  // the same decision on every rank: they all saw the same bits
  }
  if (!*done) return Status::Ok();
  if (coordinator) {
    const bool per_rank = !lists.empty();  // before the timeline fills in a stand-in
    if (timeline_ != nullptr && timeline_->active()) {
      if (lists.empty()) {
        RequestList everyone;
        everyone.ready_bits = out.ready_bits;
        lists.assign(size, everyone);
      }
      TraceCachedBits(lists, out);
    }
    if (straggler_) {
      if (per_rank) {
        ObserveStragglers(lists, out);
      } else {  // many ranks: no per-rank bits, but what completed is known
        straggler_->ObserveDone(out.ready_bits, out.invalid_bits, std::chrono::steady_clock::now());
      }
      StragglerCycle(nullptr);
    }
    CoordinateFast(any, out);
  }
  Apply(out, responses);
  return Status::Ok();
}

void Controller::CoordinateFast(const std::vector<uint64_t>& any, const ResponseList& out) {
  AutotuneStep(out);
  TrackPartialBits(any, out.ready_bits);
  // A stall report (or a stall shutdown) needs a full cycle to reach every rank.
  const auto now = std::chrono::steady_clock::now();
  if (std::chrono::duration<double>(now - last_stall_log_).count() < stall_.check_s) return;
  auto old = [&](std::chrono::steady_clock::time_point since) {
    return std::chrono::duration<double>(now - since).count() >= stall_.check_s;
  };
  for (const auto& kv : partial_bits_) stall_due_ = stall_due_ || old(kv.second);
  for (const auto& kv : table_) stall_due_ = stall_due_ || old(kv.second.since);
}

void Controller::AutotuneStep(const ResponseList& out) {
  TunedParams next;
  if (tuner_ && tuner_->Step(ReducedBytes(out), std::chrono::steady_clock::now(), &next)) {
    params_pending_ = true;
    pending_params_ = next;
  }
}

ResponseList Controller::Coordinate(const std::vector<RequestList>& lists, bool* ok,
                                    std::string* error) {
  const int size = static_cast<int>(lists.size());
  // One time for the whole cycle: requests that arrived with it arrived together (a
  // time read per request would make later ranks look later, to the straggler monitor).
  const auto now = std::chrono::steady_clock::now();
  ResponseList out;
  out.ready_bits.assign(cache_.num_words(), ~0ull);
  out.invalid_bits.assign(cache_.num_words(), 0);
  for (const auto& l : lists) {
    if (l.cache_capacity != cache_.capacity() || l.ready_bits.size() != cache_.num_words() ||
        l.invalid_bits.size() != cache_.num_words()) {
      *ok = false;
      *error = "ranks disagree on HOROVOD_CACHE_CAPACITY; set it the same on every rank";
      return out;
    }
    for (size_t w = 0; w < cache_.num_words(); ++w) out.invalid_bits[w] |= l.invalid_bits[w];
    if (l.shutdown && !out.shutdown) out.shutdown_rank = static_cast<int32_t>(&l - &lists[0]);
    out.shutdown = out.shutdown || l.shutdown;
  }
  if (joined_.size() != static_cast<size_t>(size)) joined_.assign(size, false);

  // Full requests: record, and find names every rank has now submitted.
  for (int r = 0; r < size; ++r) {
    for (const auto& req : lists[r].requests) {
      if (req.rank != r || ((req.type == OpType::kAlltoall ||
                             (req.type == OpType::kReducescatter && !req.splits.empty())) &&
                            static_cast<int>(req.splits.size()) != size)) {
        *ok = false;
        *error = "rank " + std::to_string(r) + " sent a malformed request for '" + req.name +
                 "' (a different build or a corrupted connection)";
        return out;
      }
      if (req.type == OpType::kJoin) {
        joined_[r] = true;
        last_joined_ = r;
      }
      Pending& p = table_[req.name];
      if (p.by_rank.empty()) {
        p.by_rank.resize(size);
        p.order = next_order_++;
      }
      if (!p.by_rank[req.rank].name.empty()) continue;  // duplicate: checked at submission
      p.by_rank[req.rank] = req;
      if (p.count == 0) p.since = now;
      if (straggler_) {
        p.arrived.resize(size);
        p.arrived[req.rank] = now;
      }
      if (timeline_ != nullptr) {
        if (p.count == 0) timeline_->NegotiateStart(req.name, OpTypeName(req.type));
        timeline_->NegotiateRankReady(req.name, r);
      }
      ++p.count;
    }
  }
  std::map<int64_t, std::string> failed_groups;  // every rank's group id of a failed name
  FailBesideJoin(lists, &failed_groups, &out);
  // Cached repeats: ready when every rank that has not joined has it pending (none,
  // when every rank has joined).
  bool any_active = false;
  for (int r = 0; r < size; ++r) {
    if (joined_[r]) continue;
    any_active = true;
    for (size_t w = 0; w < cache_.num_words(); ++w) out.ready_bits[w] &= lists[r].ready_bits[w];
  }
  if (!any_active) out.ready_bits.assign(cache_.num_words(), 0);
  for (size_t w = 0; w < cache_.num_words(); ++w) out.ready_bits[w] &= ~out.invalid_bits[w];

  // A name is ready when every rank submitted it; a joined rank counts as having
  // submitted every name but the join itself, which needs all ranks.
  auto ready_count = [&](const Pending& p) {
    int n = p.count;
    for (int r = 0; r < size; ++r) n += (joined_[r] && p.by_rank[r].name.empty()) ? 1 : 0;
    return n;
  };
  auto rep = [](const Pending& p) -> const Request& {
    for (const auto& q : p.by_rank) {
      if (!q.name.empty()) return q;
    }
    return p.by_rank[0];
  };
  // A grouped request runs only with its whole group: hold members until every
  // member is complete.
  std::map<int64_t, int> group_ready;
  for (const auto& kv : table_) {
    if (ready_count(kv.second) == size && rep(kv.second).group_id != 0) {
      ++group_ready[rep(kv.second).group_id];
    }
  }
  std::vector<std::pair<uint64_t, std::string>> ready;
  for (const auto& kv : table_) {
    const Pending& p = kv.second;
    const Request& r0 = rep(p);
    bool complete = r0.type == OpType::kJoin ? p.count == size : ready_count(p) == size;
    if (!complete) continue;
    if (r0.group_id != 0 && group_ready[r0.group_id] < r0.group_size) continue;
    ready.emplace_back(p.order, kv.first);
  }
  std::sort(ready.begin(), ready.end());
  for (const auto& o : ready) {
    const Pending& p = table_[o.second];
    Response resp = p.count == size ? Match(p.by_rank, size) : MatchJoined(p.by_rank, size);
    if (!resp.error.empty()) {
      // An error response carries rank_rows only to name the submitters of a failed
      // group's leftover member (FailRestOfFailedGroups); every rank takes this one.
      resp.rank_rows.clear();
      for (const auto& q : p.by_rank) {
        if (q.group_id != 0) failed_groups.emplace(q.group_id, resp.error);
      }
    }
    if (resp.type == OpType::kJoin && resp.error.empty()) {
      resp.root = last_joined_;
      joined_.assign(size, false);
    }
    if (timeline_ != nullptr) timeline_->NegotiateEnd(resp.name);
    if (straggler_ && p.count == size && resp.error.empty()) straggler_->ObserveNamed(p.arrived);
    out.responses.push_back(std::move(resp));
    table_.erase(o.second);
  }
  FailRestOfFailedGroups(failed_groups, &out);
  InspectStalls(lists, &out);
  return out;
}

// The request of a rank that submitted a pending name (the highest), or nullptr.
static const Request* Submitted(const std::vector<Request>& by_rank) {
  const Request* r0 = nullptr;
  for (const auto& q : by_rank) {
    if (!q.name.empty()) r0 = &q;
  }
  return r0;
}

// An error response for a pending name that only the ranks that submitted it take
// (they are listed in rank_rows; the others ignore it, also if they have since
// submitted an op of that name).
static Response ErrorForSubmitters(const std::string& name, const std::vector<Request>& by_rank,
                                   const std::string& error) {
  const Request& r0 = *Submitted(by_rank);
  Response resp;
  resp.type = r0.type;
  resp.name = name;
  resp.group_id = r0.group_id;
  resp.error = error;
  for (size_t r = 0; r < by_rank.size(); ++r) {
    if (!by_rank[r].name.empty()) resp.rank_rows.push_back(static_cast<int64_t>(r));
  }
  return resp;
}

// While a rank has joined, only allreduces run (it contributes zeros): any other op
// fails at once on the ranks that submitted it. Waiting for the rest to submit it
// would hang when their unnamed ops are numbered apart (a rank that joined earlier
// skipped one, as in Horovod's test_horovod_join_allgather at 4 ranks). A cached
// repeat of such an op is invalidated instead, so that its ranks send it in full
// next cycle and it fails here (before, it ran on the joined rank without a tensor:
// a segfault).
void Controller::FailBesideJoin(const std::vector<RequestList>& lists,
                                std::map<int64_t, std::string>* failed_groups, ResponseList* out) {
  const int size = static_cast<int>(joined_.size());
  std::string joined;
  for (int r = 0; r < size; ++r) {
    if (joined_[r]) joined += (joined.empty() ? "" : ", ") + std::to_string(r);
  }
  if (joined.empty()) return;
  auto allowed = [](OpType t) { return t == OpType::kAllreduce || t == OpType::kJoin; };
  for (size_t pos = 0; pos < cache_.capacity(); ++pos) {
    bool any = false;
    for (const auto& l : lists) any = any || TestBit(l.ready_bits, pos);
    if (any && !allowed(cache_.Get(static_cast<int>(pos)).type)) SetBit(&out->invalid_bits, pos);
  }
  for (auto it = table_.begin(); it != table_.end();) {
    const Request* r0 = Submitted(it->second.by_rank);
    if (r0 == nullptr || allowed(r0->type)) {
      ++it;
      continue;
    }
    Response resp = ErrorForSubmitters(
        it->first, it->second.by_rank,
        "'" + it->first + "' is a " + OpTypeName(r0->type) + ", but ranks [" + joined +
            "] called hvd.join(); only allreduce can run while ranks have joined");
    for (const auto& q : it->second.by_rank) {
      if (!q.name.empty() && q.group_id != 0) failed_groups->emplace(q.group_id, resp.error);
    }
    if (timeline_ != nullptr) timeline_->NegotiateEnd(resp.name);
    out->responses.push_back(std::move(resp));
    it = table_.erase(it);
  }
}

// A group that failed to match fails whole: members that some ranks submitted and
// others never will (the ranks' groups differ in size) would otherwise stay pending
// forever; each fails on the ranks that submitted it.
void Controller::FailRestOfFailedGroups(const std::map<int64_t, std::string>& failed,
                                        ResponseList* out) {
  if (failed.empty()) return;
  for (auto it = table_.begin(); it != table_.end();) {
    const Request* r0 = Submitted(it->second.by_rank);
    auto f = r0 == nullptr ? failed.end() : failed.find(r0->group_id);
    if (r0 == nullptr || r0->group_id == 0 || f == failed.end()) {
      ++it;
      continue;
    }
    out->responses.push_back(ErrorForSubmitters(it->first, it->second.by_rank, f->second));
    it = table_.erase(it);
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
  auto describe = [&](const std::string& name, double waited, auto has) {
    std::string ready, missing;
    for (int r = 0; r < size; ++r) {
      std::string& dst = has(r) ? ready : missing;
      dst += (dst.empty() ? "" : ", ") + std::to_string(r);
    }
    report += "\n  '" + name + "': submitted by ranks [" + ready + "], missing on ranks [" +
              missing + "] for " + std::to_string(static_cast<int>(waited)) + " s";
    fatal = fatal || (stall_.shutdown_s > 0 && waited >= stall_.shutdown_s);
  };
  for (const auto& kv : table_) {
    double waited = std::chrono::duration<double>(now - kv.second.since).count();
    if (waited < stall_.check_s) continue;
    describe(kv.first, waited, [&](int r) { return !kv.second.by_rank[r].name.empty(); });
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

Response Controller::Match(const std::vector<Request>& reqs, int size) {
  const Request& a = reqs[0];
  Response resp;
  resp.type = a.type;
  resp.name = a.name;
  resp.dtype = a.dtype;
  resp.op = a.op;
  resp.root = a.root;
  resp.prescale = a.prescale;
  resp.postscale = a.postscale;
  resp.shape = a.shape;
  resp.group_id = a.group_id;
  resp.on_gpu = a.device >= 0;
  auto fail = [&](const std::string& what, const std::string& detail) {
    resp.error = "Mismatched " + what + " for '" + a.name + "': " + detail +
                 ". Every rank must submit the same collective with matching arguments.";
    return resp;
  };
  for (const auto& r : reqs) {
    if (r.type != a.type) {
      return fail("collective operations", Disagreement(reqs, [](const Request& q) {
                    return std::string(OpTypeName(q.type));
                  }));
    }
  }
  for (const auto& r : reqs) {
    if (!std::isfinite(r.prescale) || !std::isfinite(r.postscale)) {
      resp.error = "The scale factors of '" + a.name + "' must be finite numbers: " +
                   Disagreement(reqs,
                                [](const Request& q) {
                                  return "prescale " + std::to_string(q.prescale) +
                                         " / postscale " + std::to_string(q.postscale);
                                }) +
                   ".";
      return resp;
    }
  }
  for (const auto& r : reqs) {
    if ((r.device >= 0) != (a.device >= 0)) {
      return fail("devices", Disagreement(reqs, [](const Request& q) {
                    return std::string(q.device >= 0 ? "a CUDA tensor" : "a CPU tensor");
                  }));
    }
    if (r.dtype != a.dtype) {
      return fail("data types", Disagreement(reqs, [](const Request& q) {
                    return std::string(DataTypeName(q.dtype));
                  }));
    }
    if (r.op != a.op) {
      return fail("reduction ops", Disagreement(reqs, [](const Request& q) {
                    return std::string(ReduceOpName(q.op));
                  }));
    }
    if (r.prescale != a.prescale || r.postscale != a.postscale) {
      return fail("scale factors", Disagreement(reqs, [](const Request& q) {
                    return "prescale " + std::to_string(q.prescale) + " / postscale " +
                           std::to_string(q.postscale);
                  }));
    }
    if (r.root != a.root && a.type == OpType::kRemoveProcessSet) {
      return fail("process sets to remove", Disagreement(reqs, [](const Request& q) {
                    return "id " + std::to_string(q.root);
                  }));
    }
    if (r.root != a.root) {
      return fail("root ranks",
                  Disagreement(reqs, [](const Request& q) { return std::to_string(q.root); }));
    }
    if (a.type == OpType::kBroadcast && (a.root < 0 || a.root >= size)) {
      resp.error = "broadcast of '" + a.name + "': root_rank " + std::to_string(a.root) +
                   " is out of range [0, " + std::to_string(size) + ") on every rank";
      return resp;
    }
    if (r.group_id != a.group_id || r.group_size != a.group_size) {
      return fail("groups", Disagreement(reqs, [](const Request& q) {
                    return "group of " + std::to_string(q.group_size);
                  }));
    }
  }
  auto shapes = [](const Request& q) { return ShapeStr(q.shape); };
  switch (a.type) {
    case OpType::kAllreduce:
    case OpType::kBroadcast:
    case OpType::kReducescatter:
      for (const auto& r : reqs) {
        if (r.shape != a.shape) return fail("tensor shapes", Disagreement(reqs, shapes));
      }
      if (a.type == OpType::kReducescatter) {
        for (const auto& r : reqs) {
          if (r.splits != a.splits) {
            return fail("splits", Disagreement(reqs, [](const Request& q) {
                          return q.splits.empty() ? std::string("none") : ShapeStr(q.splits);
                        }));
          }
        }
        resp.rank_rows = a.splits;
      }
      break;
    case OpType::kAllgather:
    case OpType::kAlltoall:
      for (const auto& r : reqs) {
        if (r.shape.size() != a.shape.size() || r.shape.empty() ||
            !std::equal(r.shape.begin() + 1, r.shape.end(), a.shape.begin() + 1)) {
          return fail("tensor shapes (all but the first dimension must match)",
                      Disagreement(reqs, shapes));
        }
      }
      for (const auto& r : reqs) {
        if (a.type == OpType::kAllgather) {
          resp.rank_rows.push_back(r.shape[0]);
        } else {
          HVD_CHECK(static_cast<int>(r.splits.size()) == size);
          resp.rank_rows.insert(resp.rank_rows.end(), r.splits.begin(), r.splits.end());
        }
      }
      break;
    case OpType::kAddProcessSet:
      for (const auto& r : reqs) {
        if (r.splits != a.splits) {
          return fail("process sets to add",
                      Disagreement(reqs, [](const Request& q) { return ShapeStr(q.splits); }));
        }
      }
      resp.rank_rows = a.splits;
      break;
    case OpType::kBarrier:
    case OpType::kJoin:
    case OpType::kRemoveProcessSet:
      break;
  }
  return resp;
}

Response Controller::MatchJoined(const std::vector<Request>& reqs, int size) {
  std::vector<Request> present;
  for (const auto& r : reqs) {
    if (!r.name.empty()) present.push_back(r);
  }
  return Match(present, size);  // an allreduce: any other op failed in FailBesideJoin
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
        timeline_->NegotiateStart(cached.name, OpTypeName(cached.type));
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
                        << "; a step takes " << Ms(rep.step_s)
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

void Controller::Requeue(int pos) {
  auto it = cached_pending_.find(pos);
  if (it == cached_pending_.end()) return;
  sent_sigs_[it->second.name] = it->second.Signature();
  uncached_.push_back(std::move(it->second));
  cached_pending_.erase(it);
}

// A new setting takes effect on every rank after this cycle's responses. Turning
// the cache on or off empties it, and pending repeats are re-sent in full: every
// rank then classifies its next requests against the same (empty) cache, so no
// name is sent as a bit by one rank and in full by another.
void Controller::ApplyParams(const ResponseList& list) {
  if (!list.has_params) return;
  bool cache_changed = list.cache_enabled != params_.cache_enabled;
  params_.fusion_threshold_bytes = list.fusion_threshold_bytes;
  params_.wake_delay_us = list.wake_delay_us;
  params_.cache_enabled = list.cache_enabled;
  if (!cache_changed) return;
  for (size_t pos = 0; pos < cache_.capacity(); ++pos) {
    Requeue(static_cast<int>(pos));
    cache_.Erase(static_cast<int>(pos));
  }
  traced_bits_.clear();
}

void Controller::Apply(const ResponseList& list, std::vector<Response>* out) {
  auto requeue = [this](int pos) { Requeue(pos); };
  for (size_t pos = 0; pos < cache_.capacity(); ++pos) {
    if (TestBit(list.invalid_bits, pos)) {
      requeue(static_cast<int>(pos));
      cache_.Erase(static_cast<int>(pos));
    }
  }
  for (size_t pos = 0; pos < cache_.capacity(); ++pos) {
    if (!TestBit(list.ready_bits, pos)) continue;
    int p = static_cast<int>(pos);
    // Absent on a rank that joined: it runs the op with zeros.
    out->push_back(cache_.Get(p));
    cache_.Touch(p);
    cached_pending_.erase(p);
  }
  for (const auto& resp : list.responses) {
    if (resp.type == OpType::kJoin) join_pending_ = false;  // every rank has joined
    out->push_back(resp);
    auto sig = sent_sigs_.find(resp.name);
    std::string signature = sig == sent_sigs_.end() ? std::string() : sig->second;
    if (sig != sent_sigs_.end()) sent_sigs_.erase(sig);
    if (!resp.error.empty() || resp.group_id != 0 || resp.type == OpType::kBarrier ||
        resp.type == OpType::kJoin || resp.type == OpType::kAddProcessSet ||
        resp.type == OpType::kRemoveProcessSet) {
      continue;
    }
    if (!params_.cache_enabled) continue;
    int evicted = -1;
    cache_.Put(resp, signature, &evicted);
    if (evicted >= 0) requeue(evicted);
  }
  ApplyParams(list);
}

}  // namespace hvd
