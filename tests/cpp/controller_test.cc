// core/controller: negotiation over real TcpTransports (ranks as threads).
// A spy ControlPlane decodes what each rank sends, to check when the response
// cache replaces full requests with bits.
#include <gtest/gtest.h>

#include <algorithm>
#include <functional>
#include <map>
#include <numeric>
#include <random>
#include <set>

#include "core/c10d_names.h"
#include "core/controller.h"
#include "test_util.h"
#include "wire/message.h"

namespace hvd {
namespace {

using hvd_test::MakeWorld;
using hvd_test::RunRanks;
using hvd_test::Watchdog;
using hvd_test::World;

class SpyPlane : public ControlPlane {
 public:
  explicit SpyPlane(ControlPlane* inner) : inner_(inner) {}
  int rank() const override { return inner_->rank(); }
  int size() const override { return inner_->size(); }
  Status Gather(const std::string& mine, std::vector<std::string>* all) override {
    RequestList l;
    Status st = Decode(mine, &l);
    EXPECT_TRUE(st.ok()) << st.message();
    sent.push_back(l);
    return inner_->Gather(mine, all);
  }
  Status Bcast(std::string* data) override { return inner_->Bcast(data); }
  // The steady-state exchange (cache bits only): counted, not decoded.
  Status Allgather(const std::string& mine, std::vector<std::string>* all) override {
    ++fast_cycles;
    return inner_->Allgather(mine, all);
  }
  int fast_cycles = 0;
  std::vector<RequestList> sent;  // one per Cycle, in order

 private:
  ControlPlane* inner_;
};

struct Ranks {
  World world;
  std::vector<std::unique_ptr<SpyPlane>> spies;
  std::vector<std::unique_ptr<Controller>> ctrls;
  int size() const { return world.size(); }
};

Status MakeRanks(int n, const std::vector<size_t>& capacities, Ranks* out,
                 TcpOptions opt = hvd_test::FastOptions()) {
  HVD_RETURN_IF_ERROR(MakeWorld(n, opt, &out->world));
  for (int r = 0; r < n; ++r) {
    out->spies.push_back(std::make_unique<SpyPlane>(out->world.transports[r].get()));
    out->ctrls.push_back(std::make_unique<Controller>(out->spies[r].get(), capacities[r]));
  }
  return Status::Ok();
}

Request Req(const std::string& name, std::vector<int64_t> shape, OpType type = OpType::kAllreduce) {
  Request r;
  r.name = name;
  r.type = type;
  r.shape = std::move(shape);
  return r;
}

// schedule[rank][cycle]: requests that rank submits at the start of that cycle.
using Schedule = std::vector<std::map<int, std::vector<Request>>>;

struct RunLog {
  std::vector<std::vector<std::vector<Response>>> responses;  // [rank][cycle]
  std::vector<std::vector<bool>> shutdown;                    // [rank][cycle]
  std::vector<std::vector<bool>> joined;                      // [rank][cycle]: ranks_joined()
  std::vector<Status> status;                                 // per rank
  std::vector<size_t> first_sent;  // index of this run's first RequestList in spy->sent
};

RunLog RunCycles(Ranks& ranks, const Schedule& schedule, int cycles,
                 const std::set<std::pair<int, int>>& shutdown_at = {}) {
  const int n = ranks.size();
  RunLog log;
  log.responses.assign(n, {});
  log.shutdown.assign(n, {});
  log.joined.assign(n, {});
  log.status.assign(n, Status::Ok());
  for (int r = 0; r < n; ++r) log.first_sent.push_back(ranks.spies[r]->sent.size());
  RunRanks(n, [&](int r) {
    for (int c = 0; c < cycles; ++c) {
      std::vector<Request> fresh;
      auto it = schedule[r].find(c);
      if (it != schedule[r].end()) fresh = it->second;
      for (auto& q : fresh) q.rank = r;
      std::vector<Response> out;
      bool shutdown = false;
      Status st =
          ranks.ctrls[r]->Cycle(std::move(fresh), shutdown_at.count({r, c}) > 0, &out, &shutdown);
      if (!st.ok()) {
        log.status[r] = st;
        ranks.world.transports[r]->Abort();  // as Runtime::Loop does
        return;
      }
      log.responses[r].push_back(out);
      log.shutdown[r].push_back(shutdown);
      log.joined[r].push_back(ranks.ctrls[r]->ranks_joined());
    }
  });
  return log;
}

std::string Canonical(const std::vector<Response>& rs) {
  ResponseList l;
  l.responses = rs;
  return Encode(l);
}

std::vector<std::string> Names(const std::vector<Response>& rs) {
  std::vector<std::string> v;
  for (const auto& r : rs) v.push_back(r.name);
  return v;
}

// Every rank ran every cycle and got the same ordered responses in each.
void ExpectIdentical(const RunLog& log, int cycles) {
  const int n = static_cast<int>(log.responses.size());
  for (int r = 0; r < n; ++r) {
    ASSERT_TRUE(log.status[r].ok()) << "rank " << r << ": " << log.status[r].message();
    ASSERT_EQ(static_cast<int>(log.responses[r].size()), cycles) << "rank " << r;
  }
  for (int c = 0; c < cycles; ++c) {
    for (int r = 1; r < n; ++r) {
      EXPECT_TRUE(Canonical(log.responses[r][c]) == Canonical(log.responses[0][c]))
          << "cycle " << c << ": rank " << r << " got "
          << ::testing::PrintToString(Names(log.responses[r][c])) << ", rank 0 got "
          << ::testing::PrintToString(Names(log.responses[0][c]));
    }
  }
}

// name -> cycle it was released in (rank 0's view); fails on duplicates.
std::map<std::string, int> ReleaseCycles(const RunLog& log) {
  std::map<std::string, int> at;
  for (size_t c = 0; c < log.responses[0].size(); ++c) {
    for (const auto& resp : log.responses[0][c]) {
      EXPECT_EQ(at.count(resp.name), 0u) << resp.name << " released twice";
      at[resp.name] = static_cast<int>(c);
    }
  }
  return at;
}

const Response* Find(const RunLog& log, int rank, const std::string& name) {
  for (const auto& cyc : log.responses[rank]) {
    for (const auto& r : cyc) {
      if (r.name == name) return &r;
    }
  }
  return nullptr;
}

size_t PopCount(const std::vector<uint64_t>& bits) {
  size_t n = 0;
  for (uint64_t w : bits) n += __builtin_popcountll(w);
  return n;
}

TEST(ControllerMatch, ValidatesAndFillsResponse) {
  auto reqs = [](int n, const Request& base) {
    std::vector<Request> v(n, base);
    for (int r = 0; r < n; ++r) v[r].rank = r;
    return v;
  };
  Request base = Req("x", {4, 5});
  base.dtype = DataType::kFloat16;
  base.op = ReduceOp::kMax;
  base.prescale = 2;
  base.postscale = 0.5;
  Response ok = Controller::Match(reqs(3, base), 3);
  EXPECT_EQ(ok.error, "");
  EXPECT_EQ(ok.name, "x");
  EXPECT_EQ(ok.dtype, DataType::kFloat16);
  EXPECT_EQ(ok.op, ReduceOp::kMax);
  EXPECT_EQ(ok.prescale, 2);
  EXPECT_EQ(ok.postscale, 0.5);
  EXPECT_EQ(ok.shape, (std::vector<int64_t>{4, 5}));
  EXPECT_FALSE(ok.on_gpu);
  auto on_gpu = reqs(3, base);
  for (auto& q : on_gpu) q.device = q.rank;  // device index may differ per rank
  Response g0 = Controller::Match(on_gpu, 3);
  EXPECT_EQ(g0.error, "");
  EXPECT_TRUE(g0.on_gpu);
  EXPECT_EQ(ok.devices, 0u);
  // The devices key: the same for the same (rank, device) pairs in any arrival order,
  // another when one rank's tensor is on another of its GPUs (model parallelism).
  std::vector<Request> shuffled = {on_gpu[2], on_gpu[0], on_gpu[1]};
  EXPECT_EQ(Controller::Match(shuffled, 3).devices, g0.devices);
  auto moved = on_gpu;
  moved[1].device = 3;
  EXPECT_NE(Controller::Match(moved, 3).devices, g0.devices);
  auto swapped = on_gpu;
  std::swap(swapped[0].device, swapped[1].device);
  EXPECT_NE(Controller::Match(swapped, 3).devices, g0.devices);

  struct Mut {
    const char* what;
    std::function<void(Request&)> f;
    const char* expect;
  };
  std::vector<Mut> muts = {
      {"type", [](Request& q) { q.type = OpType::kBroadcast; }, "Mismatched collective operations"},
      {"dtype", [](Request& q) { q.dtype = DataType::kFloat32; }, "rank 1 has float32"},
      {"op", [](Request& q) { q.op = ReduceOp::kSum; }, "Mismatched reduction ops"},
      {"scale", [](Request& q) { q.prescale = 3; }, "Mismatched scale factors"},
      {"root", [](Request& q) { q.root = 1; }, "Mismatched root ranks"},
      {"group",
       [](Request& q) {
         q.group_id = 9;
         q.group_size = 2;
       },
       "Mismatched groups"},
      {"shape",
       [](Request& q) {
         q.shape = {4, 6};
       },
       "rank 0 has [4, 5], rank 1 has [4, 6]"},
      {"device", [](Request& q) { q.device = 0; }, "rank 1 has a CUDA tensor"},
  };
  for (const auto& m : muts) {
    auto v = reqs(3, base);
    m.f(v[1]);
    Response r = Controller::Match(v, 3);
    EXPECT_NE(r.error.find(m.expect), std::string::npos) << m.what << ": " << r.error;
    EXPECT_NE(r.error.find("'x'"), std::string::npos) << r.error;
  }

  // Allgather: first dimensions may differ and are reported per rank.
  Request ag = Req("g", {0, 3}, OpType::kAllgather);
  auto v = reqs(3, ag);
  v[1].shape = {5, 3};
  v[2].shape = {2, 3};
  Response g = Controller::Match(v, 3);
  EXPECT_EQ(g.error, "");
  EXPECT_EQ(g.rank_rows, (std::vector<int64_t>{0, 5, 2}));
  v[2].shape = {2, 4};
  EXPECT_NE(Controller::Match(v, 3).error.find("all but the first dimension"), std::string::npos);
  v[2].shape = {};
  EXPECT_NE(Controller::Match(v, 3).error, "");
  v = reqs(3, Req("g", {}, OpType::kAllgather));  // scalars cannot be gathered
  EXPECT_NE(Controller::Match(v, 3).error, "");

  // Alltoall: rank_rows is the size x size matrix of splits, by sender.
  Request a2a = Req("a", {3, 2}, OpType::kAlltoall);
  v = reqs(2, a2a);
  v[0].splits = {1, 2};
  v[1].shape = {4, 2};
  v[1].splits = {4, 0};
  Response a = Controller::Match(v, 2);
  EXPECT_EQ(a.error, "");
  EXPECT_EQ(a.rank_rows, (std::vector<int64_t>{1, 2, 4, 0}));

  // Barrier: shapes are irrelevant.
  Request barrier = Req("b", {}, OpType::kControl);
  barrier.control.kind = ControlKind::kBarrier;
  v = reqs(2, barrier);
  v[1].shape = {7};
  EXPECT_EQ(Controller::Match(v, 2).error, "");
}

// Control ops match on their kind and their own fields, and the response carries them.
TEST(ControllerMatch, ControlOps) {
  auto control = [](ControlKind kind) {
    Request q = Req("c", {}, OpType::kControl);
    q.control.kind = kind;
    return q;
  };
  auto reqs = [](int n, const Request& r) {
    std::vector<Request> v(n, r);
    for (int i = 0; i < n; ++i) v[i].rank = i;
    return v;
  };
  std::vector<Request> v = reqs(2, control(ControlKind::kBarrier));
  v[1].control.kind = ControlKind::kJoin;
  EXPECT_NE(Controller::Match(v, 2).error.find("rank 0 has barrier, rank 1 has join"),
            std::string::npos)
      << Controller::Match(v, 2).error;

  v = reqs(2, control(ControlKind::kAddProcessSet));
  v[0].control.ranks = {0, 1};
  v[1].control.ranks = {0, 1};
  Response add = Controller::Match(v, 2);
  EXPECT_EQ(add.error, "");
  EXPECT_EQ(add.type, OpType::kControl);
  EXPECT_TRUE(add.control == v[0].control);
  v[1].control.ranks = {1};
  Response mismatch = Controller::Match(v, 2);
  EXPECT_NE(mismatch.error.find("Mismatched process sets to add"), std::string::npos);
  // An error response is a valid message too (every rank must decode it to fail the op).
  ResponseList sent, received;
  sent.responses.push_back(mismatch);
  HVD_EXPECT_OK(Decode(Encode(sent), &received));

  v = reqs(2, control(ControlKind::kRemoveProcessSet));
  v[0].control.process_set = 3;
  v[1].control.process_set = 4;
  EXPECT_NE(Controller::Match(v, 2).error.find("rank 0 has id 3, rank 1 has id 4"),
            std::string::npos);

  // A data op and a control op of one name do not match.
  v = reqs(2, control(ControlKind::kBarrier));
  v[1].type = OpType::kAllreduce;
  v[1].control.kind = ControlKind::kNone;
  EXPECT_NE(Controller::Match(v, 2).error.find("Mismatched collective operations"),
            std::string::npos);
}

class ControllerRanks : public ::testing::TestWithParam<int> {};

// Same requests, different orders and cycles on different ranks: identical
// ordered responses everywhere, each released in the cycle its last rank
// submitted it, ordered by first arrival at the coordinator. The second round
// is served from the cache: no request text on the wire.
TEST_P(ControllerRanks, OrderingAndCache) {
  Watchdog wd(60, "ControllerRanks.OrderingAndCache");
  const int n = GetParam();
  Ranks ranks;
  Status st = MakeRanks(n, std::vector<size_t>(n, 16), &ranks);
  ASSERT_TRUE(st.ok()) << st.message();

  auto make = [](int i) {
    Request q = Req("t" + std::to_string(i), {i + 1, 2});
    if (i == 4) q.type = OpType::kAllgather;
    if (i == 5) {
      q.type = OpType::kBroadcast;
      q.root = 0;
    }
    return q;
  };
  auto make_for = [&](int rank, int i) {
    Request q = make(i);
    if (i == 4) q.shape[0] = rank + 1;  // allgather: per-rank first dimension
    return q;
  };
  // Round 1.
  Schedule s1(n);
  std::vector<std::vector<std::pair<int, int>>> plan = {
      {{0, 0}, {0, 1}, {0, 2}, {0, 3}, {0, 4}, {0, 5}},
      {{0, 5}, {0, 4}, {0, 3}, {1, 2}, {1, 1}, {1, 0}},
      {{0, 1}, {2, 3}, {2, 0}, {2, 5}, {2, 2}, {3, 4}},
      {{3, 5}, {3, 4}, {3, 3}, {3, 2}, {3, 1}, {3, 0}},
  };
  std::map<std::string, int> last_submit;
  for (int r = 0; r < n; ++r) {
    for (auto [cycle, i] : plan[r]) {
      s1[r][cycle].push_back(make_for(r, i));
      last_submit["t" + std::to_string(i)] = std::max(last_submit["t" + std::to_string(i)], cycle);
    }
  }
  const int cycles = 5;
  RunLog log1 = RunCycles(ranks, s1, cycles);
  ASSERT_NO_FATAL_FAILURE(ExpectIdentical(log1, cycles));
  auto at = ReleaseCycles(log1);
  EXPECT_EQ(at.size(), 6u);
  for (auto& kv : last_submit) EXPECT_EQ(at[kv.first], kv.second) << kv.first;
  for (int c = 0; c < cycles; ++c) {  // within a cycle: order of first arrival
    std::vector<std::string> names = Names(log1.responses[0][c]);
    EXPECT_TRUE(std::is_sorted(names.begin(), names.end())) << "cycle " << c;
  }
  const Response* ag = Find(log1, 0, "t4");
  ASSERT_NE(ag, nullptr);
  std::vector<int64_t> rows;
  for (int r = 0; r < n; ++r) rows.push_back(r + 1);
  EXPECT_EQ(ag->rank_rows, rows);
  for (int r = 0; r < n; ++r) {
    for (auto& cyc : log1.responses[r]) {
      for (auto& resp : cyc) EXPECT_EQ(resp.error, "") << resp.name;
    }
  }

  // Round 2: same requests in new orders; all are cache hits.
  Schedule s2(n);
  for (int r = 0; r < n; ++r) {
    std::vector<int> order = {0, 1, 2, 3, 4, 5};
    std::mt19937 rng(r);
    std::shuffle(order.begin(), order.end(), rng);
    for (int k = 0; k < 6; ++k) s2[r][(r == 1 && k >= 3) ? 1 : 0].push_back(make_for(r, order[k]));
  }
  std::vector<int> fast_before;
  for (int r = 0; r < n; ++r) fast_before.push_back(ranks.spies[r]->fast_cycles);
  RunLog log2 = RunCycles(ranks, s2, 3);
  ASSERT_NO_FATAL_FAILURE(ExpectIdentical(log2, 3));
  auto at2 = ReleaseCycles(log2);
  EXPECT_EQ(at2.size(), 6u);
  for (int r = 0; r < n; ++r) {
    // Every cycle of round 2 was the steady-state bit exchange: no request text, no
    // coordinator round trip.
    EXPECT_EQ(ranks.spies[r]->sent.size(), log2.first_sent[r])
        << "rank " << r << " ran a full negotiation cycle although every request was a cache hit";
    EXPECT_EQ(ranks.spies[r]->fast_cycles - fast_before[r], 3) << "rank " << r;
  }
  // Cached responses are the negotiated ones.
  for (int i = 0; i < 6; ++i) {
    std::string name = "t" + std::to_string(i);
    const Response* a = Find(log1, 0, name);
    const Response* b = Find(log2, 0, name);
    ASSERT_TRUE(a && b) << name;
    EXPECT_EQ(Canonical({*a}), Canonical({*b})) << name;
  }
}

INSTANTIATE_TEST_SUITE_P(Ranks, ControllerRanks, ::testing::Values(1, 2, 3, 4),
                         [](const ::testing::TestParamInfo<int>& i) {
                           return std::to_string(i.param) + "ranks";
                         });

TEST(Controller, MismatchAfterCachingNamesBothRanks) {
  Watchdog wd(60, "MismatchAfterCachingNamesBothRanks");
  Ranks ranks;
  Status st = MakeRanks(2, {16, 16}, &ranks);
  ASSERT_TRUE(st.ok()) << st.message();
  Schedule s1 = {{{0, {Req("a", {2}), Req("b", {4})}}}, {{0, {Req("b", {4}), Req("a", {2})}}}};
  RunLog l1 = RunCycles(ranks, s1, 1);
  ASSERT_NO_FATAL_FAILURE(ExpectIdentical(l1, 1));
  EXPECT_EQ(Names(l1.responses[0][0]), (std::vector<std::string>{"a", "b"}));

  // Rank 1 changes the shape of a cached tensor.
  Schedule s2 = {{{0, {Req("a", {2})}}}, {{0, {Req("a", {3})}}}};
  RunLog l2 = RunCycles(ranks, s2, 3);
  ASSERT_NO_FATAL_FAILURE(ExpectIdentical(l2, 3));
  auto at = ReleaseCycles(l2);
  ASSERT_EQ(at.count("a"), 1u);
  for (int r = 0; r < 2; ++r) {
    const Response* a = Find(l2, r, "a");
    ASSERT_NE(a, nullptr);
    EXPECT_NE(a->error.find("Mismatched tensor shapes"), std::string::npos) << a->error;
    EXPECT_NE(a->error.find("rank 0 has [2]"), std::string::npos) << a->error;
    EXPECT_NE(a->error.find("rank 1 has [3]"), std::string::npos) << a->error;
  }
  // Rank 0 announced a cache hit, rank 1 invalidated the position and sent its
  // request in full.
  const RequestList& r0 = ranks.spies[0]->sent[l2.first_sent[0]];
  const RequestList& r1 = ranks.spies[1]->sent[l2.first_sent[1]];
  EXPECT_EQ(PopCount(r0.ready_bits), 1u);
  EXPECT_TRUE(r0.requests.empty());
  EXPECT_EQ(PopCount(r1.invalid_bits), 1u);
  ASSERT_EQ(r1.requests.size(), 1u);
  EXPECT_EQ(r1.requests[0].shape, std::vector<int64_t>{3});

  // Afterwards both agree on the new shape: negotiated in full, then cached again.
  Schedule s3 = {{{0, {Req("a", {3}), Req("b", {4})}}}, {{0, {Req("a", {3}), Req("b", {4})}}}};
  RunLog l3 = RunCycles(ranks, s3, 1);
  ASSERT_NO_FATAL_FAILURE(ExpectIdentical(l3, 1));
  ASSERT_EQ(l3.responses[0][0].size(), 2u);
  for (auto& resp : l3.responses[0][0]) EXPECT_EQ(resp.error, "") << resp.name;
  EXPECT_EQ(ranks.spies[0]->sent.back().requests.size(), 1u) << "'a' in full, 'b' from cache";
  RunLog l4 = RunCycles(ranks, s3, 1);
  ASSERT_NO_FATAL_FAILURE(ExpectIdentical(l4, 1));
  EXPECT_EQ(l4.responses[0][0].size(), 2u);
  for (int r = 0; r < 2; ++r) {  // both from the cache: the steady-state exchange only
    EXPECT_EQ(ranks.spies[r]->sent.size(), l4.first_sent[r]) << "rank " << r;
  }
}

TEST(C10dNames, SlotOfAName) {
  EXPECT_EQ(C10dName("0", 9, "allreduce.Float[4].Sum"), "c10d.0.1.allreduce.Float[4].Sum");
  EXPECT_EQ(C10dSlotOf("c10d.0.1.allreduce.Float[4].Sum"), "c10d.0.1");
  EXPECT_EQ(C10dSlotOf("c10d.a1b2.3.barrier#7"), "c10d.a1b2.3");
  EXPECT_EQ(C10dSlotOf("c10d.0.p2p.0.1.0.3"), "");  // send/recv: no slot
  EXPECT_EQ(C10dSlotOf("c10d.5.new_group"), "");
  EXPECT_EQ(C10dSlotOf("c10d.0.12"), "");
  EXPECT_EQ(C10dSlotOf("c10d..1.x"), "");
  EXPECT_EQ(C10dSlotOf("allreduce.3"), "");
}

Request C10dReq(uint64_t n, std::vector<int64_t> shape) {
  return Req(C10dName("0", n, "allreduce.Float[" + std::to_string(shape[0]) + "].Sum"), shape);
}

// torch.distributed calls named by their arguments: a call whose shape differs between
// ranks has a different name on each. It fails on every rank once every rank has a
// call pending in its slot, never before, and the calls after it run.
TEST(Controller, DivergedC10dCallsFailOnceEveryRankHasCalled) {
  Watchdog wd(60, "DivergedC10dCallsFailOnceEveryRankHasCalled");
  Ranks ranks;
  Status st = MakeRanks(3, {16, 16, 16}, &ranks);
  ASSERT_TRUE(st.ok()) << st.message();
  const Request a = C10dReq(1, {4}), b = C10dReq(1, {5}), c = C10dReq(2, {8});
  Schedule s = {{{0, {a, c}}}, {{0, {b, c}}}, {{1, {a}}, {2, {c}}}};
  RunLog log = RunCycles(ranks, s, 4);
  ASSERT_NO_FATAL_FAILURE(ExpectIdentical(log, 4));
  EXPECT_TRUE(log.responses[0][0].empty()) << "failed before rank 2 called";
  auto at = ReleaseCycles(log);
  EXPECT_EQ(at[a.name], 1);
  EXPECT_EQ(at[b.name], 1);
  EXPECT_EQ(at[c.name], 2);
  for (int r = 0; r < 3; ++r) {
    for (const auto& name : {a.name, b.name}) {
      const Response* resp = Find(log, r, name);
      ASSERT_NE(resp, nullptr);
      EXPECT_NE(resp->error.find("Mismatched tensor shapes"), std::string::npos) << resp->error;
      EXPECT_NE(resp->error.find("rank 1 has [5]"), std::string::npos) << resp->error;
    }
    // Each error is for the ranks that submitted that name only.
    EXPECT_EQ(Find(log, r, a.name)->rank_rows, (std::vector<int64_t>{0, 2}));
    EXPECT_EQ(Find(log, r, b.name)->rank_rows, (std::vector<int64_t>{1}));
    EXPECT_EQ(Find(log, r, c.name)->error, "");
  }
}

// The same, when both names are repeats that the cache serves: only bits cross the
// wire, so the coordinator asks for a full cycle once they have waited a while.
TEST(Controller, DivergedCachedC10dCallsFailWithinASecond) {
  Watchdog wd(60, "DivergedCachedC10dCallsFailWithinASecond");
  Ranks ranks;
  Status st = MakeRanks(2, {16, 16}, &ranks);
  ASSERT_TRUE(st.ok()) << st.message();
  const Request a = C10dReq(1, {4}), b = C10dReq(1, {5});
  for (const Request& q : {a, b}) {
    RunLog warm = RunCycles(ranks, {{{0, {q}}}, {{0, {q}}}}, 1);
    ASSERT_NO_FATAL_FAILURE(ExpectIdentical(warm, 1));
    ASSERT_EQ(Names(warm.responses[0][0]), std::vector<std::string>{q.name});
  }
  const size_t full_before = ranks.spies[0]->sent.size();
  RunLog first = RunCycles(ranks, {{{0, {a}}}, {{0, {b}}}}, 1);
  ASSERT_NO_FATAL_FAILURE(ExpectIdentical(first, 1));
  EXPECT_EQ(ranks.spies[0]->sent.size(), full_before) << "both names are cache hits";
  const auto start = std::chrono::steady_clock::now();
  std::vector<Response> got;
  while (got.size() < 2 && std::chrono::steady_clock::now() - start < std::chrono::seconds(5)) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    RunLog l = RunCycles(ranks, {{}, {}}, 1);
    ASSERT_NO_FATAL_FAILURE(ExpectIdentical(l, 1));
    got.insert(got.end(), l.responses[0][0].begin(), l.responses[0][0].end());
  }
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(1));
  std::sort(got.begin(), got.end(),
            [](const Response& x, const Response& y) { return x.name < y.name; });
  ASSERT_EQ(Names(got), (std::vector<std::string>{a.name, b.name}));
  for (const auto& resp : got) {
    EXPECT_NE(resp.error.find("rank 0 has [4], rank 1 has [5]"), std::string::npos) << resp.error;
  }
}

Request P2pReq(int64_t from, int64_t to, int64_t tag, uint64_t k, int64_t receiver_of_any = -1) {
  P2pName n;
  n.group = "0";
  n.from = from;
  n.to = to;
  n.tag = tag;
  Request r = Req(P2pCallName("0", n, k), {4}, OpType::kBroadcast);
  if (from < 0) {  // a receive from any source
    r.root = -1;
    r.participants = {receiver_of_any};
  } else {
    r.root = static_cast<int32_t>(from);
    r.participants = {std::min(from, to), std::max(from, to)};
  }
  return r;
}

TEST(C10dNames, PointToPointNames) {
  P2pName n;
  ASSERT_TRUE(ParseP2pName("c10d.7.p2p.2.0.-3.5", &n));
  EXPECT_EQ(n.group, "7");
  EXPECT_EQ(n.from, 2);
  EXPECT_EQ(n.to, 0);
  EXPECT_EQ(n.tag, -3);
  ASSERT_TRUE(ParseP2pName(P2pCallName("0", {"0", -1, 1, 4}, 2), &n));
  EXPECT_EQ(P2pCallName("0", {"0", -1, 1, 4}, 2), "c10d.0.p2pany.1.4.2");
  EXPECT_EQ(n.from, -1);
  EXPECT_EQ(n.to, 1);
  EXPECT_EQ(n.tag, 4);
  EXPECT_FALSE(ParseP2pName("c10d.0.p2p.1.x.0.0", &n));
  EXPECT_FALSE(ParseP2pName("c10d.0.1.allreduce.Float[4].Sum", &n));
  EXPECT_FALSE(ParseP2pName("c10d.0.p2pany.1.4", &n));
}

// Receives from any source take the pending sends to their rank with their tag in
// the order the sends arrived (not their names' order), never one that a named recv
// has taken, even in the cycle both arrive, or one of another tag; the response
// carries the receive's name for the receiver.
TEST(Controller, ReceivesFromAnySourceTakeSendsInArrivalOrder) {
  Watchdog wd(60, "ReceivesFromAnySourceTakeSendsInArrivalOrder");
  Ranks ranks;
  Status st = MakeRanks(3, {16, 16, 16}, &ranks);
  ASSERT_TRUE(st.ok()) << st.message();
  const Request any0 = P2pReq(-1, 0, 5, 0, 0), any1 = P2pReq(-1, 0, 5, 1, 0),
                any2 = P2pReq(-1, 0, 5, 2, 0);
  const Request from2 = P2pReq(2, 0, 5, 0), named = P2pReq(2, 0, 5, 1), later2 = P2pReq(2, 0, 5, 2),
                from1 = P2pReq(1, 0, 5, 0), other_tag = P2pReq(1, 0, 6, 0);
  Schedule s = {{{0, {named, any0}}, {3, {any1}}, {4, {any2}}},
                {{2, {other_tag, from1}}},
                {{0, {from2, named}}, {1, {later2}}}};
  RunLog log = RunCycles(ranks, s, 5);
  ASSERT_NO_FATAL_FAILURE(ExpectIdentical(log, 5));
  auto at = ReleaseCycles(log);
  EXPECT_EQ(at[named.name], 0);
  EXPECT_EQ(at[from2.name], 0);
  EXPECT_EQ(at[later2.name], 3) << "arrived before from1, named after it";
  EXPECT_EQ(at[from1.name], 4);
  EXPECT_EQ(at.count(other_tag.name), 0u) << "a send of another tag was taken";
  EXPECT_EQ(at.count(any0.name), 0u);  // run under the sends' names
  for (int r = 0; r < 3; ++r) {
    const std::vector<std::pair<Request, std::string>> expect = {
        {named, ""}, {from2, any0.name}, {later2, any1.name}, {from1, any2.name}};
    for (const auto& e : expect) {
      const Response* resp = Find(log, r, e.first.name);
      ASSERT_NE(resp, nullptr) << e.first.name;
      EXPECT_EQ(resp->alias, e.second) << e.first.name;
      EXPECT_EQ(resp->root, e.first.root) << e.first.name;
      EXPECT_EQ(resp->error, "") << e.first.name;
    }
  }
}

TEST(Controller, GroupReleasedOnlyWhenCompleteEverywhere) {
  Watchdog wd(60, "GroupReleasedOnlyWhenCompleteEverywhere");
  Ranks ranks;
  Status st = MakeRanks(3, {16, 16, 16}, &ranks);
  ASSERT_TRUE(st.ok()) << st.message();
  for (int round = 0; round < 2; ++round) {
    auto g = [&](int i) {
      Request q = Req("g" + std::to_string(i), {i + 1});
      q.group_id = 7 + round;
      q.group_size = 3;
      return q;
    };
    Request u = Req("u", {1});  // ungrouped: cached after round 0
    Schedule s = {
        {{0, {g(0), g(1), g(2), u}}},
        {{0, {g(0), u}}, {1, {g(1)}}, {2, {g(2)}}},
        {{0, {g(2), g(1), g(0), u}}},
    };
    RunLog log = RunCycles(ranks, s, 4);
    ASSERT_NO_FATAL_FAILURE(ExpectIdentical(log, 4));
    EXPECT_EQ(Names(log.responses[0][0]), std::vector<std::string>{u.name}) << "round " << round;
    EXPECT_TRUE(log.responses[0][1].empty()) << "group released before g2 was ready on rank 1";
    EXPECT_EQ(Names(log.responses[0][2]), (std::vector<std::string>{"g0", "g1", "g2"}));
    EXPECT_TRUE(log.responses[0][3].empty());
    for (auto& resp : log.responses[0][2]) {
      EXPECT_EQ(resp.group_id, 7 + round);
      EXPECT_EQ(resp.error, "");
    }
    if (round == 1) {  // grouped requests are never served from the cache; "u" is
      const RequestList& first = ranks.spies[0]->sent[log.first_sent[0]];
      EXPECT_EQ(first.requests.size(), 3u);
      EXPECT_EQ(PopCount(first.ready_bits), 1u);
    }
  }
}

// A small cache with more live names than slots: eviction and re-sending keep
// every rank's cache in step.
TEST(Controller, SmallCacheEvictionStaysConsistent) {
  Watchdog wd(60, "SmallCacheEvictionStaysConsistent");
  for (size_t capacity : {size_t{0}, size_t{1}, size_t{2}}) {
    Ranks ranks;
    Status st = MakeRanks(3, {capacity, capacity, capacity}, &ranks);
    ASSERT_TRUE(st.ok()) << st.message();
    std::mt19937 rng(static_cast<unsigned>(capacity));
    for (int round = 0; round < 5; ++round) {
      Schedule s(3);
      for (int r = 0; r < 3; ++r) {
        std::vector<int> order = {0, 1, 2, 3, 4};
        std::shuffle(order.begin(), order.end(), rng);
        for (int i : order) {
          s[r][static_cast<int>(rng() % 3)].push_back(Req("n" + std::to_string(i), {i + 1}));
        }
      }
      RunLog log = RunCycles(ranks, s, 5);
      ASSERT_NO_FATAL_FAILURE(ExpectIdentical(log, 5)) << "capacity " << capacity;
      auto at = ReleaseCycles(log);
      EXPECT_EQ(at.size(), 5u) << "capacity " << capacity << " round " << round;
      for (auto& cyc : log.responses[0]) {
        for (auto& resp : cyc) EXPECT_EQ(resp.error, "");
      }
    }
  }
}

// Randomized: several rounds of the same names, random per-rank timing and
// order, occasional shape mismatches on one rank, a small cache.
TEST(Controller, RandomizedRoundsStayConsistent) {
  Watchdog wd(60, "RandomizedRoundsStayConsistent");
  const int n = 3, names = 8;
  Ranks ranks;
  Status st = MakeRanks(n, {4, 4, 4}, &ranks);
  ASSERT_TRUE(st.ok()) << st.message();
  std::mt19937 rng(2024);
  for (int round = 0; round < 12; ++round) {
    Schedule s(n);
    std::set<std::string> mismatched;
    for (int i = 0; i < names; ++i) {
      if (rng() % 8 == 0) mismatched.insert("x" + std::to_string(i));
    }
    for (int r = 0; r < n; ++r) {
      std::vector<int> order(names);
      std::iota(order.begin(), order.end(), 0);
      std::shuffle(order.begin(), order.end(), rng);
      for (int i : order) {
        std::string name = "x" + std::to_string(i);
        int64_t dim = (r == 1 && mismatched.count(name)) ? 100 + i : i + 1;
        Request q = Req(name, {dim});
        if (i == 7) q.type = OpType::kControl;  // a barrier: never cached
        if (i == 7) q.control.kind = ControlKind::kBarrier;
        if (i == 7) q.shape = {};
        s[r][static_cast<int>(rng() % 3)].push_back(q);
      }
    }
    if (mismatched.count("x7")) mismatched.erase("x7");  // barrier shapes are not compared
    const int cycles = 6;
    RunLog log = RunCycles(ranks, s, cycles);
    ASSERT_NO_FATAL_FAILURE(ExpectIdentical(log, cycles)) << "round " << round;
    auto at = ReleaseCycles(log);
    EXPECT_EQ(static_cast<int>(at.size()), names) << "round " << round;
    for (auto& cyc : log.responses[0]) {
      for (auto& resp : cyc) {
        EXPECT_EQ(resp.error.empty(), mismatched.count(resp.name) == 0)
            << "round " << round << " " << resp.name << ": " << resp.error;
      }
    }
  }
}

// Autotune on rank 0 with one-cycle samples: the setting (fusion threshold, wake
// delay, response cache on/off) changes almost every cycle while ranks submit the
// same names at random times. Every rank must see the same responses and the same
// setting, and every name must be released exactly once per round.
TEST(Controller, AutotuneSwitchesStayConsistent) {
  Watchdog wd(60, "AutotuneSwitchesStayConsistent");
  const int n = 3, names = 6;
  Ranks ranks;
  Status st = MakeRanks(n, {8, 8, 8}, &ranks);
  ASSERT_TRUE(st.ok()) << st.message();
  AutotuneOptions opt;
  opt.warmup_samples = 0;
  opt.steps_per_sample = 1;
  opt.max_samples = 20;
  ranks.ctrls[0]->EnableAutotune(std::make_unique<Autotuner>(opt, TunedParams{}));
  std::mt19937 rng(7);
  std::set<bool> cache_states;
  for (int round = 0; round < 25; ++round) {
    Schedule s(n);
    for (int r = 0; r < n; ++r) {
      for (int i = 0; i < names; ++i) {
        s[r][static_cast<int>(rng() % 4)].push_back(Req("t" + std::to_string(i), {i + 1}));
      }
    }
    const int cycles = 6;
    RunLog log = RunCycles(ranks, s, cycles);
    ASSERT_NO_FATAL_FAILURE(ExpectIdentical(log, cycles)) << "round " << round;
    EXPECT_EQ(static_cast<int>(ReleaseCycles(log).size()), names) << "round " << round;
    for (int r = 1; r < n; ++r) {
      EXPECT_TRUE(ranks.ctrls[r]->params() == ranks.ctrls[0]->params()) << "round " << round;
    }
    cache_states.insert(ranks.ctrls[0]->params().cache_enabled);
  }
  EXPECT_EQ(cache_states.size(), 2u) << "the search never toggled the response cache";
  EXPECT_TRUE(ranks.ctrls[0]->autotune_done());
}

TEST(Controller, ShutdownRequestReachesEveryRank) {
  Watchdog wd(30, "ShutdownRequestReachesEveryRank");
  Ranks ranks;
  Status st = MakeRanks(3, {8, 8, 8}, &ranks);
  ASSERT_TRUE(st.ok()) << st.message();
  RunLog log = RunCycles(ranks, Schedule(3), 3, {{1, 1}});
  ASSERT_NO_FATAL_FAILURE(ExpectIdentical(log, 3));
  for (int r = 0; r < 3; ++r) {
    EXPECT_EQ(log.shutdown[r], (std::vector<bool>{false, true, false})) << "rank " << r;
  }
}

// While a rank has joined (it runs the others' allreduces with zeros), every rank is
// told so with each cycle's ops, so that their GPU times are not compared; from the
// cycle after the last rank joined, no more.
TEST(Controller, EveryRankIsToldWhileARankHasJoined) {
  Watchdog wd(30, "EveryRankIsToldWhileARankHasJoined");
  Ranks ranks;
  Status st = MakeRanks(2, {8, 8}, &ranks);
  ASSERT_TRUE(st.ok()) << st.message();
  Request join = Req("join", {}, OpType::kControl);
  join.control.kind = ControlKind::kJoin;
  Schedule s = {
      {{0, {join}}, {3, {Req("c", {1})}}},
      {{0, {Req("a", {1})}}, {1, {Req("b", {1})}}, {2, {join}}, {3, {Req("c", {1})}}},
  };
  RunLog log = RunCycles(ranks, s, 5);
  ASSERT_NO_FATAL_FAILURE(ExpectIdentical(log, 5));
  EXPECT_EQ(Names(log.responses[0][0]), std::vector<std::string>{"a"});
  EXPECT_EQ(Names(log.responses[0][1]), std::vector<std::string>{"b"});
  EXPECT_EQ(Names(log.responses[0][2]), std::vector<std::string>{"join"});
  EXPECT_EQ(Names(log.responses[0][3]), std::vector<std::string>{"c"});
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(log.joined[r], (std::vector<bool>{true, true, true, false, false})) << "rank " << r;
  }
}

// Capacities that need different bit-vector lengths are detected and reported.
TEST(Controller, CacheCapacityDisagreementIsReported) {
  Watchdog wd(30, "CacheCapacityDisagreementIsReported");
  Ranks ranks;
  TcpOptions opt = hvd_test::FastOptions();
  opt.io_timeout_s = 30;  // rank 1 must learn through rank 0's abort, not a timeout
  Status st = MakeRanks(2, {16, 100}, &ranks, opt);
  ASSERT_TRUE(st.ok()) << st.message();
  auto t0 = std::chrono::steady_clock::now();
  RunLog log = RunCycles(ranks, Schedule(2), 1);
  EXPECT_LT(hvd_test::SecondsSince(t0), 5.0);
  EXPECT_FALSE(log.status[0].ok());
  EXPECT_NE(log.status[0].message().find("HOROVOD_CACHE_CAPACITY"), std::string::npos)
      << log.status[0].message();
  EXPECT_FALSE(log.status[1].ok()) << "rank 1 must not be left waiting";
}

// Capacities that fit the same number of 64-bit words (here 2 and 3) would make
// the caches evict differently, so one bit position would mean different tensors
// on different ranks. Every RequestList carries the exact capacity, so the
// coordinator reports the disagreement in the first cycle.
TEST(Controller, CacheCapacityDisagreementWithinOneWord) {
  Watchdog wd(30, "CacheCapacityDisagreementWithinOneWord");
  Ranks ranks;
  Status st = MakeRanks(2, {2, 3}, &ranks);
  ASSERT_TRUE(st.ok()) << st.message();
  Schedule fill = {{{0, {Req("A", {1})}}}, {{0, {Req("A", {1})}}}};
  RunLog log = RunCycles(ranks, fill, 1);
  EXPECT_FALSE(log.status[0].ok());
  EXPECT_NE(log.status[0].message().find("HOROVOD_CACHE_CAPACITY"), std::string::npos)
      << log.status[0].message();
}

}  // namespace
}  // namespace hvd
