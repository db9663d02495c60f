// The coordinator's matching: the ranks' requests for one name checked against each
// other and made into one response (or one error naming the disagreement), and the
// failures that end pending names (joined ranks, failed groups).
#include <algorithm>
#include <cmath>
#include <string>

#include "common/check.h"
#include "core/c10d_names.h"
#include "core/controller.h"

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
  resp.control.kind = r0.control.kind;
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
  auto allowed = [](const auto& m) {
    return m.type == OpType::kAllreduce || m.control.kind == ControlKind::kJoin;
  };
  for (size_t pos = 0; pos < cache_.capacity(); ++pos) {
    bool any = false;
    for (const auto& l : lists) any = any || TestBit(l.ready_bits, pos);
    if (any && !allowed(cache_.Get(static_cast<int>(pos)))) SetBit(&out->invalid_bits, pos);
  }
  for (auto it = table_.begin(); it != table_.end();) {
    const Request* r0 = Submitted(it->second.by_rank);
    if (r0 == nullptr || allowed(*r0)) {
      ++it;
      continue;
    }
    Response resp = ErrorForSubmitters(
        it->first, it->second.by_rank,
        "'" + it->first + "' is a " + OpName(*r0) + ", but ranks [" + joined +
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

// A receive from any source (IsAnyRecv; core/c10d_names.h) becomes the receiving side
// of the earliest pending send to its rank, of its group and tag, whose receiver has
// not submitted a recv for it: the send then completes as a send/recv does, and its
// response carries the receive's name as `alias`, under which the receiver runs it.
// The receiver waits for its receives from any source of a tag to complete before it
// posts a recv from a named rank with that tag, so that it numbers that recv after
// the messages those took (c10d_calls.cc).
void Controller::BindAnySource() {
  std::vector<std::pair<uint64_t, std::string>> anys;
  for (const auto& kv : table_) {
    const Request* r0 = Submitted(kv.second.by_rank);
    if (r0 != nullptr && IsAnyRecv(*r0)) anys.emplace_back(kv.second.order, kv.first);
  }
  std::sort(anys.begin(), anys.end());
  for (const auto& a : anys) {
    P2pName want;
    if (!ParseP2pName(a.second, &want)) continue;
    const size_t to = static_cast<size_t>(want.to);
    std::string best;
    uint64_t best_order = UINT64_MAX;
    size_t from = 0;
    for (const auto& kv : table_) {
      P2pName got;
      if (kv.second.order >= best_order || !ParseP2pName(kv.first, &got) || got.from < 0 ||
          got.group != want.group || got.to != want.to || got.tag != want.tag ||
          to >= kv.second.by_rank.size() ||
          static_cast<size_t>(got.from) >= kv.second.by_rank.size() ||
          !kv.second.by_rank[to].name.empty() ||
          kv.second.by_rank[static_cast<size_t>(got.from)].name.empty()) {
        continue;
      }
      best = kv.first;
      best_order = kv.second.order;
      from = static_cast<size_t>(got.from);
    }
    if (best.empty()) continue;
    Pending& any = table_[a.second];
    Pending& send = table_[best];
    const Request& sent = send.by_rank[from];
    Request recv = any.by_rank[to];
    recv.name = best;
    recv.root = sent.root;
    recv.participants = sent.participants;
    send.by_rank[to] = std::move(recv);
    ++send.count;
    if (send.arrived.size() > to && any.arrived.size() > to) send.arrived[to] = any.arrived[to];
    send.alias = a.second;
    if (timeline_ != nullptr) timeline_->NegotiateEnd(a.second);
    table_.erase(a.second);
  }
}

// A torch.distributed call is named by its arguments (core/c10d_names.h), so a call
// whose arguments differ between ranks has a different name on each, and no name would
// ever be ready. A slot in which every rank has a call pending holds the same call on
// every rank: different names there are a mismatch. They fail on every rank with
// Match's error, and the group goes on (the ranks' later calls, in other slots, are
// left pending). A cached repeat among them is invalidated instead: its ranks send it
// in full next cycle, and the whole slot fails then.
void Controller::FailDivergedCalls(const std::vector<RequestList>& lists, ResponseList* out) {
  last_diverge_check_ = std::chrono::steady_clock::now();
  diverge_due_ = false;
  const size_t size = lists.size();
  for (bool j : joined_) {
    if (j) return;  // a joined rank runs allreduces it never submitted
  }
  struct Slot {
    std::vector<std::vector<std::string>> names;  // per rank, pending in the slot
    std::vector<int> cached;                      // cache positions among them
  };
  std::map<std::string, Slot> slots;  // by "c10d.<group>.<slot>"
  auto slot_of = [&](const std::string& name) -> Slot* {
    const std::string key = C10dSlotOf(name);
    if (key.empty()) return nullptr;
    Slot& s = slots[key];
    s.names.resize(size);
    return &s;
  };
  for (const auto& kv : table_) {
    if (Submitters(kv.second) != nullptr) continue;  // not every rank's (send/recv)
    Slot* s = slot_of(kv.first);
    if (s == nullptr) continue;
    for (size_t r = 0; r < size; ++r) {
      if (!kv.second.by_rank[r].name.empty()) s->names[r].push_back(kv.first);
    }
  }
  const size_t words = cache_.num_words();
  for (size_t w = 0; w < words; ++w) {
    uint64_t any = 0;
    for (const auto& l : lists) any |= w < l.ready_bits.size() ? l.ready_bits[w] : 0;
    for (uint64_t partial = any & ~out->ready_bits[w] & ~out->invalid_bits[w]; partial != 0;
         partial &= partial - 1) {
      const size_t pos = w * 64 + static_cast<size_t>(__builtin_ctzll(partial));
      const std::string& name = cache_.Get(static_cast<int>(pos)).name;
      Slot* s = slot_of(name);
      if (s == nullptr) continue;
      s->cached.push_back(static_cast<int>(pos));
      for (size_t r = 0; r < size; ++r) {
        if (TestBit(lists[r].ready_bits, pos)) s->names[r].push_back(name);
      }
    }
  }
  for (auto& kv : slots) {
    Slot& s = kv.second;
    bool everyone = true, same = true;
    for (auto& names : s.names) {
      std::sort(names.begin(), names.end());
      everyone = everyone && !names.empty();
      same = same && names == s.names[0];
    }
    if (!everyone || same) continue;
    if (!s.cached.empty()) {
      for (int pos : s.cached) SetBit(&out->invalid_bits, static_cast<size_t>(pos));
      continue;
    }
    std::vector<Request> first(size);
    std::string listed;
    for (size_t r = 0; r < size; ++r) {
      first[r] = table_[s.names[r][0]].by_rank[r];
      listed += (r ? ", rank " : "rank ") + std::to_string(r) + " '" + s.names[r][0] + "'";
    }
    std::string error = Match(first, static_cast<int>(size)).error;
    if (error.empty()) {
      error = "Mismatched torch.distributed calls: " + listed +
              ". Every rank must issue a group's calls in the same order, with matching "
              "arguments.";
    }
    std::vector<std::string> names;
    for (const auto& n : s.names) names.insert(names.end(), n.begin(), n.end());
    std::sort(names.begin(), names.end());
    names.erase(std::unique(names.begin(), names.end()), names.end());
    for (const auto& name : names) {
      auto it = table_.find(name);
      out->responses.push_back(ErrorForSubmitters(name, it->second.by_rank, error));
      if (timeline_ != nullptr) timeline_->NegotiateEnd(name);
      table_.erase(it);
    }
  }
}

void Controller::WatchDivergence(std::chrono::steady_clock::time_point now) {
  constexpr double kEvery = 0.25;  // seconds: how late a mismatch of cached calls is found
  auto age = [&](std::chrono::steady_clock::time_point t) {
    return std::chrono::duration<double>(now - t).count();
  };
  if (diverge_due_ || age(last_diverge_check_) < kEvery) return;
  for (const auto& kv : partial_bits_) {
    if (age(kv.second) >= kEvery && !C10dSlotOf(cache_.Get(kv.first).name).empty()) {
      diverge_due_ = true;
      return;
    }
  }
  for (const auto& kv : table_) {
    if (age(kv.second.since) >= kEvery && !C10dSlotOf(kv.first).empty()) {
      diverge_due_ = true;
      return;
    }
  }
}

Response Controller::Match(const std::vector<Request>& reqs, int size) {
  const Request& a = reqs[0];
  Response resp;
  resp.type = a.type;
  resp.control = a.control;  // a control op's fields (a data op's: none)
  resp.name = a.name;
  resp.dtype = a.dtype;
  resp.op = a.op;
  resp.root = a.root;
  resp.prescale = a.prescale;
  resp.postscale = a.postscale;
  resp.shape = a.shape;
  resp.group_id = a.group_id;
  resp.on_gpu = a.device >= 0;
  if (resp.on_gpu) {
    std::vector<std::pair<int32_t, int32_t>> devices;
    for (const Request& q : reqs) devices.emplace_back(q.rank, q.device);
    resp.devices = DevicesKey(std::move(devices));
  }
  resp.participants = a.participants;
  auto fail = [&](const std::string& what, const std::string& detail) {
    resp.error = "Mismatched " + what + " for '" + a.name + "': " + detail +
                 ". Every rank must submit the same collective with matching arguments.";
    return resp;
  };
  for (const auto& r : reqs) {
    if (r.type != a.type || r.control.kind != a.control.kind) {
      return fail("collective operations",
                  Disagreement(reqs, [](const Request& q) { return std::string(OpName(q)); }));
    }
  }
  if (a.type == OpType::kControl) {
    for (const auto& r : reqs) {
      if (r.control.ranks != a.control.ranks) {
        return fail("process sets to add",
                    Disagreement(reqs, [](const Request& q) { return ShapeStr(q.control.ranks); }));
      }
      if (r.control.process_set != a.control.process_set) {
        return fail("process sets to remove", Disagreement(reqs, [](const Request& q) {
                      return "id " + std::to_string(q.control.process_set);
                    }));
      }
    }
    return resp;
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
    if (r.participants != a.participants) {
      return fail("participants",
                  Disagreement(reqs, [](const Request& q) { return ShapeStr(q.participants); }));
    }
    if ((r.device >= 0) != (a.device >= 0)) {
      return fail("devices", Disagreement(reqs, [](const Request& q) {
                    return std::string(q.device >= 0 ? "a CUDA tensor" : "a CPU tensor");
                  }));
    }
    if (!r.participants.empty() && r.device >= 0) {  // refused here: both sides fail
      resp.error = "send/recv of '" + a.name +
                   "': CUDA tensors are not supported yet; send and receive a CPU copy";
      return resp;
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
    case OpType::kControl:  // matched above
      break;
  }
  return resp;
}

Response Controller::MatchSubmitted(const std::vector<Request>& reqs, int size) {
  std::vector<Request> present;
  for (const auto& r : reqs) {
    if (!r.name.empty()) present.push_back(r);
  }
  return Match(present, size);
}

const std::vector<int64_t>* Controller::Submitters(const Pending& p) {
  const Request* r0 = Submitted(p.by_rank);
  if (r0 == nullptr) return nullptr;
  if (!r0->participants.empty()) return &r0->participants;
  if (r0->control.kind != ControlKind::kAddProcessSetOfMembers) return nullptr;
  return &r0->control.ranks;
}

bool Controller::AllMembersIn(const Pending& p) {
  const std::vector<int64_t>* members = Submitters(p);
  if (members == nullptr) return false;
  const Request& r0 = *Submitted(p.by_rank);
  for (const auto& q : p.by_rank) {  // they disagree on who takes part: Match says so now
    if (!q.name.empty() &&
        (q.participants != r0.participants || q.control.ranks != r0.control.ranks)) {
      return true;
    }
  }
  for (int64_t r : *members) {
    if (r < 0 || r >= static_cast<int64_t>(p.by_rank.size()) ||
        p.by_rank[static_cast<size_t>(r)].name.empty()) {
      return false;
    }
  }
  return true;
}

}  // namespace hvd
