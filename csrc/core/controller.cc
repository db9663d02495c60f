// The controller's cycle protocol (docs/design.md §3): classifying requests against the
// response cache, the full and the fast (bit-vector) cycle, the coordinator's table, and
// applying a cycle's responses. Matching is in controller_match.cc; the stall inspector,
// timeline, straggler and autotune glue in controller_observe.cc.
#include "core/controller.h"

#include <algorithm>

namespace hvd {

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
    join_pending_ = join_pending_ || r.control.kind == ControlKind::kJoin;
    Classify(std::move(r), &pending_invalid_);
  }
  responses->clear();
  *shutdown = false;
  bool any_invalid = false;
  for (uint64_t w : pending_invalid_) any_invalid = any_invalid || w != 0;
  if (fast_ok_ && steady_exchange_) {
    bool need_full = !uncached_.empty() || want_shutdown || join_pending_ || any_invalid ||
                     params_pending_ || stall_due_ || diverge_due_ || report_due_;
    bool done = false;
    fast_need_full_ = need_full;
    HVD_RETURN_IF_ERROR(FastCycle(responses, &done));
    if (done) return Status::Ok();
  }
  // A full cycle may reassign cache positions: what the steady state remembered of
  // the last exchange (WasBehind) starts over.
  fast_mine_.clear();
  fast_pending_.clear();
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
  std::vector<uint64_t> behind;    // many ranks: a bit per rank, set by those behind
  if (size > kPerRankBitsMaxRanks) {
    // Many ranks: an AND/OR allreduce, O(log n) rounds of O(capacity) bits. The
    // coordinator learns which positions are ready somewhere (OR) but not on
    // which ranks: a timeline marks cached ops ready on all ranks at once. The OR
    // also carries a bit per rank: set by a rank that was behind another this cycle
    // (the straggler monitor's signal; StragglerMonitor::ObserveAny).
    const size_t rank_words = (static_cast<size_t>(size) + 63) / 64;
    out.ready_bits = mine;
    any.assign(1 + words + rank_words, 0);
    any[0] = fast_need_full_ ? 1 : 0;
    std::copy(mine.begin(), mine.end(), any.begin() + 1);
    const int me = control_->rank();
    if (WasBehind(mine)) SetBit(&any, (1 + words) * 64 + static_cast<size_t>(me));
    HVD_RETURN_IF_ERROR(control_->AllreduceBits(&out.ready_bits, &any));
    *done = (any[0] & 1) == 0;
    behind.assign(any.begin() + 1 + words, any.end());
    any.resize(1 + words);
    any.erase(any.begin());
    NoteFastBits(mine, any, out.ready_bits);
  } else {
    // Few ranks: every rank's bits to every rank (one allgather), so the
    // coordinator's timeline shows when each rank became ready; then this rank's GPU
    // collectives' totals (SetGpuTotals), for the straggler monitor.
    std::vector<uint64_t> msg(1 + words + 2, 0);
    msg[0] = fast_need_full_ ? 1 : 0;
    std::copy(mine.begin(), mine.end(), msg.begin() + 1);
    msg[1 + words] = gpu_ops_;
    msg[2 + words] = gpu_took_ns_;
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
      if (coordinator && straggler_ && w[1 + words] > 0) {
        straggler_->ObserveGpuWaits(static_cast<int>(r), w[1 + words], w[2 + words]);
      }
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
      } else {  // many ranks: no per-rank bits; who was behind, and the first rank's time
        straggler_->ObserveAny(any, behind, out.ready_bits, out.invalid_bits,
                               std::chrono::steady_clock::now());
      }
      StragglerCycle(nullptr);
    }
    CoordinateFast(any, out);
  }
  Apply(out, responses);
  return Status::Ok();
}

bool Controller::WasBehind(const std::vector<uint64_t>& mine) const {
  for (size_t w = 0; w < mine.size() && w < fast_mine_.size() && w < fast_pending_.size(); ++w) {
    if (mine[w] & ~fast_mine_[w] & fast_pending_[w]) return true;
  }
  return false;
}

void Controller::NoteFastBits(const std::vector<uint64_t>& mine, const std::vector<uint64_t>& any,
                              const std::vector<uint64_t>& all) {
  fast_mine_ = mine;
  fast_pending_.resize(any.size());
  for (size_t w = 0; w < any.size(); ++w) fast_pending_[w] = any[w] & ~all[w];
}

void Controller::CoordinateFast(const std::vector<uint64_t>& any, const ResponseList& out) {
  AutotuneStep(out);
  TrackPartialBits(any, out.ready_bits);
  const auto now = std::chrono::steady_clock::now();
  WatchDivergence(now);
  // A stall report (or a stall shutdown) needs a full cycle to reach every rank.
  if (std::chrono::duration<double>(now - last_stall_log_).count() < stall_.check_s) return;
  auto old = [&](std::chrono::steady_clock::time_point since) {
    return std::chrono::duration<double>(now - since).count() >= stall_.check_s;
  };
  for (const auto& kv : partial_bits_) stall_due_ = stall_due_ || old(kv.second);
  for (const auto& kv : table_) stall_due_ = stall_due_ || old(kv.second.since);
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
      if (req.control.kind == ControlKind::kJoin) {
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
        if (p.count == 0) timeline_->NegotiateStart(req.name, OpName(req));
        timeline_->NegotiateRankReady(req.name, r);
      }
      ++p.count;
    }
  }
  std::map<int64_t, std::string> failed_groups;  // every rank's group id of a failed name
  out.ranks_joined = std::find(joined_.begin(), joined_.end(), true) != joined_.end();
  FailBesideJoin(lists, &failed_groups, &out);
  BindAnySource();  // after: a pair never fails beside a join (its receiver would miss it)
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
    bool complete = r0.control.kind == ControlKind::kJoin ? p.count == size
                    : Submitters(p) != nullptr            ? AllMembersIn(p)
                                                          : ready_count(p) == size;
    if (!complete || IsAnyRecv(r0)) continue;  // a receive from any source waits for a send
    if (r0.group_id != 0 && group_ready[r0.group_id] < r0.group_size) continue;
    ready.emplace_back(p.order, kv.first);
  }
  std::sort(ready.begin(), ready.end());
  for (const auto& o : ready) {
    const Pending& p = table_[o.second];
    Response resp = p.count == size ? Match(p.by_rank, size) : MatchSubmitted(p.by_rank, size);
    resp.alias = p.alias;
    if (!resp.error.empty()) {
      // An error response carries rank_rows only to name the submitters of a failed
      // group's leftover member (FailRestOfFailedGroups); every rank takes this one.
      resp.rank_rows.clear();
      for (const auto& q : p.by_rank) {
        if (q.group_id != 0) failed_groups.emplace(q.group_id, resp.error);
      }
    }
    if (resp.control.kind == ControlKind::kJoin && resp.error.empty()) {
      resp.control.last_joined = last_joined_;
      joined_.assign(size, false);
    }
    if (timeline_ != nullptr) timeline_->NegotiateEnd(resp.name);
    if (straggler_ && p.count == size && resp.error.empty()) straggler_->ObserveNamed(p.arrived);
    out.responses.push_back(std::move(resp));
    table_.erase(o.second);
  }
  FailRestOfFailedGroups(failed_groups, &out);
  FailDivergedCalls(lists, &out);
  InspectStalls(lists, &out);
  return out;
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
  ranks_joined_ = list.ranks_joined;  // the steady state's lists: never (joins need full cycles)
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
    ++cached_responses_;
  }
  negotiated_responses_ += list.responses.size();
  for (const auto& resp : list.responses) {
    if (resp.control.kind == ControlKind::kJoin) join_pending_ = false;  // every rank joined
    out->push_back(resp);
    auto sig = sent_sigs_.find(resp.name);
    std::string signature = sig == sent_sigs_.end() ? std::string() : sig->second;
    if (sig != sent_sigs_.end()) sent_sigs_.erase(sig);
    if (!resp.alias.empty()) sent_sigs_.erase(resp.alias);  // a receive from any source
    if (!resp.error.empty() || resp.group_id != 0 || resp.type == OpType::kControl ||
        !resp.participants.empty()) {  // the cache's bits are for ops of every rank
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
