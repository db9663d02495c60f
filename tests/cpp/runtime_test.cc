// The Runtime's own tests (core/runtime.h): N runtimes as threads of one process,
// each with its background loop, over the TCP mesh through a rendezvous store, as
// hvd.init() makes them but without Python. They drive Submit() and the handles
// directly: results, fusion, the errors that fail one op and leave the engine
// running, the checks made before an op is queued, process sets, join, a lost
// peer and shutdown with ops in flight.
//
// This file is the one C++ test that needs ATen (entries carry at::Tensor), so it
// builds into its own binary, linked against the libtorch of the Python whose torch
// builds the extension (tests/cpp/Makefile: `make runtime`).
#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "core/runtime.h"
#include "test_util.h"
#include "transport/tcp_transport.h"

namespace hvd {
namespace {

using hvd_test::kSecret;
using hvd_test::RunRanks;
using hvd_test::StatusString;
using hvd_test::Watchdog;

constexpr auto kWait = std::chrono::seconds(30);

Config TestConfig() {
  Config c;
  c.start_timeout_s = 10;
  c.stall_check_disable = 1;
  c.thread_affinity = "";
  return c;
}

// `n` runtimes started through one store, as init() on n processes would.
struct Job {
  std::unique_ptr<StoreServer> server;
  std::vector<std::unique_ptr<Runtime>> rt;

  Status Start(int n, const Config& config = TestConfig(), const std::string& prefix = "g0") {
    server = std::make_unique<StoreServer>("127.0.0.1", 0, kSecret);
    if (!server->status().ok()) return server->status();
    rt.clear();
    rt.resize(n);
    std::vector<Status> st(n);
    RunRanks(n, [&](int r) {
      WorldInfo w;
      w.rank = r;
      w.size = n;
      w.local_rank = r;
      w.local_size = n;
      w.store_host = "127.0.0.1";
      w.store_port = server->port();
      w.secret = kSecret;
      w.prefix = prefix;
      st[r] = Runtime::Create(w, config, nullptr, &rt[r]);
    });
    for (int r = 0; r < n; ++r) {
      if (!st[r].ok()) return Status::Aborted("rank " + std::to_string(r) + ": " + st[r].message());
    }
    return Status::Ok();
  }
  // Negotiated shutdown on every rank at once.
  void Stop() {
    RunRanks(static_cast<int>(rt.size()), [&](int r) { rt[r].reset(); });
  }
  ~Job() { Stop(); }
};

Submission Op(OpType type, const std::string& name, at::Tensor input,
              ReduceOp op = ReduceOp::kSum) {
  Submission s;
  s.request.type = type;
  s.request.name = name;
  s.request.op = op;
  s.input = std::move(input);
  return s;
}

// A control op on the global set.
Submission Control(ControlKind kind, const std::string& name) {
  ControlOp c;
  c.kind = kind;
  return ControlSubmission(c, name, 0);
}

// A send from `from` to `to` (a broadcast in which only they take part), in place.
Submission PointToPoint(const std::string& name, at::Tensor t, int from, int to) {
  Submission s = Op(OpType::kBroadcast, name, t);
  s.output = t;
  s.request.root = from;
  s.request.participants = {std::min(from, to), std::max(from, to)};
  return s;
}

Submission Allreduce(const std::string& name, at::Tensor t, ReduceOp op = ReduceOp::kSum) {
  Submission s = Op(OpType::kAllreduce, name, t, op);
  s.output = t;  // in place, as the optimizer's allreduce_
  return s;
}

// Submits and waits; the op's status (the submission's if it was refused).
Status RunOps(Runtime& rt, std::vector<Submission> subs,
              std::vector<std::shared_ptr<HandleState>>* out = nullptr) {
  std::vector<std::shared_ptr<HandleState>> handles;
  HVD_RETURN_IF_ERROR(rt.Submit(std::move(subs), &handles));
  Status first;
  for (auto& h : handles) {
    if (!h->Wait(0, kWait)) return Status::Aborted("op '" + h->name() + "' did not complete");
    if (first.ok() && !h->status().ok()) first = h->status();
  }
  if (out != nullptr) *out = handles;
  return first;
}

Status RunOne(Runtime& rt, Submission s, std::shared_ptr<HandleState>* out = nullptr) {
  std::vector<Submission> subs;
  subs.push_back(std::move(s));
  std::vector<std::shared_ptr<HandleState>> handles;
  Status st = RunOps(rt, std::move(subs), &handles);
  if (out != nullptr && !handles.empty()) *out = handles[0];
  return st;
}

bool Contains(const std::string& s, const std::string& part) {
  return s.find(part) != std::string::npos;
}

TEST(RuntimeTest, AllreduceSumAndAverageOnThreeRanks) {
  Watchdog dog(60, "AllreduceSumAndAverageOnThreeRanks");
  Job job;
  HVD_ASSERT_OK(job.Start(3));
  RunRanks(3, [&](int r) {
    at::Tensor a = at::full({5}, static_cast<double>(r + 1), at::kFloat);
    HVD_EXPECT_OK(RunOne(*job.rt[r], Allreduce("sum", a)));
    EXPECT_TRUE(at::equal(a, at::full({5}, 6.0, at::kFloat))) << a;
    at::Tensor b = at::full({2, 3}, static_cast<double>(r + 1), at::kDouble);
    HVD_EXPECT_OK(RunOne(*job.rt[r], Allreduce("avg", b, ReduceOp::kAverage)));
    EXPECT_TRUE(at::equal(b, at::full({2, 3}, 2.0, at::kDouble))) << b;
    // Not in place: the result goes to the output, the input is left alone.
    at::Tensor c = at::full({4}, static_cast<double>(r), at::kLong);
    Submission max = Op(OpType::kAllreduce, "max", c, ReduceOp::kMax);
    max.output = at::empty_like(c);
    std::shared_ptr<HandleState> h;
    HVD_EXPECT_OK(RunOne(*job.rt[r], max, &h));
    ASSERT_TRUE(h);
    EXPECT_TRUE(at::equal(h->output(), at::full({4}, 2, at::kLong))) << h->output();
    EXPECT_TRUE(at::equal(max.output, at::full({4}, 2, at::kLong)));
    EXPECT_TRUE(at::equal(c, at::full({4}, r, at::kLong)));
  });
}

// The other collectives, each with what sets it apart: allgather of different
// first dimensions, broadcast from the last rank, alltoall with splits, an uneven
// reduce-scatter with both scale factors.
TEST(RuntimeTest, AllgatherBroadcastAlltoallReducescatter) {
  Watchdog dog(60, "AllgatherBroadcastAlltoallReducescatter");
  Job job;
  HVD_ASSERT_OK(job.Start(3));
  RunRanks(3, [&](int r) {
    Runtime& rt = *job.rt[r];
    std::shared_ptr<HandleState> h;

    HVD_EXPECT_OK(RunOne(rt, Op(OpType::kAllgather, "gather", at::full({r + 1, 2}, r)), &h));
    at::Tensor want = at::cat({at::full({1, 2}, 0), at::full({2, 2}, 1), at::full({3, 2}, 2)});
    EXPECT_TRUE(at::equal(h->output(), want)) << h->output();

    at::Tensor b = at::full({4}, static_cast<double>(10 * r), at::kInt);
    Submission bcast = Op(OpType::kBroadcast, "bcast", b);
    bcast.output = b;
    bcast.request.root = 2;
    HVD_EXPECT_OK(RunOne(rt, bcast));
    EXPECT_TRUE(at::equal(b, at::full({4}, 20, at::kInt))) << b;

    // Row p of rank r's input goes to rank p; it holds 10 * r + p.
    at::Tensor send = at::arange(3, at::kFloat) + 10.0 * r;
    Submission a2a = Op(OpType::kAlltoall, "a2a", send);
    a2a.request.splits = {1, 1, 1};
    HVD_EXPECT_OK(RunOne(rt, a2a, &h));
    EXPECT_TRUE(at::equal(h->output(), at::arange(3, at::kFloat) * 10.0 + r)) << h->output();
    EXPECT_TRUE(at::equal(h->splits(), at::ones({3}, at::kInt))) << h->splits();

    // 5 rows over 3 ranks: 2, 2, 1. Average of r + 1 is 2; times 2, then 0.5.
    Submission rs = Op(OpType::kReducescatter, "rs", at::full({5, 3}, r + 1.0), ReduceOp::kAverage);
    rs.request.prescale = 2.0;
    rs.request.postscale = 0.5;
    HVD_EXPECT_OK(RunOne(rt, rs, &h));
    EXPECT_TRUE(at::equal(h->output(), at::full({r < 2 ? 2 : 1, 3}, 2.0))) << h->output();

    // Empty parts: 2 rows over 3 ranks leaves rank 2 none; rank 1 gathers no rows;
    // rank 0 sends nothing to rank 2.
    HVD_EXPECT_OK(RunOne(rt, Op(OpType::kReducescatter, "rs0", at::full({2, 3}, 1.0)), &h));
    EXPECT_TRUE(at::equal(h->output(), at::full({r < 2 ? 1 : 0, 3}, 3.0))) << h->output();
    HVD_EXPECT_OK(
        RunOne(rt, Op(OpType::kAllgather, "gather0", at::full({r == 1 ? 0 : 1, 2}, r)), &h));
    EXPECT_TRUE(at::equal(h->output(), at::cat({at::full({1, 2}, 0), at::full({1, 2}, 2)})))
        << h->output();
    Submission a2a0 = Op(OpType::kAlltoall, "a2a0", at::full({2}, r, at::kLong));
    a2a0.request.splits = r == 0 ? std::vector<int64_t>{1, 1, 0} : std::vector<int64_t>{1, 0, 1};
    HVD_EXPECT_OK(RunOne(rt, a2a0, &h));
    // rank 0 gets a row from everyone; rank 1 from rank 0; rank 2 from ranks 1 and 2
    at::Tensor want0 = r == 0   ? at::tensor({0, 1, 2}, at::kLong)
                       : r == 1 ? at::tensor({0}, at::kLong)
                                : at::tensor({1, 2}, at::kLong);
    EXPECT_TRUE(at::equal(h->output(), want0)) << "rank " << r << ": " << h->output();

    // Splits that do not add up are refused on the calling rank.
    std::vector<std::shared_ptr<HandleState>> none;
    Submission bad = Op(OpType::kAlltoall, "bad", at::ones({3}));
    bad.request.splits = {1, 1, 2};
    Status st = rt.Submit({bad}, &none);
    EXPECT_TRUE(Contains(st.message(), "splits sum to 4")) << st.message();
  });
}

// Reduce-scatters with splits (and one without) negotiated together and fused into
// one collective: each rank gets its rows of each; splits that differ between
// ranks fail that op on every rank.
TEST(RuntimeTest, FusedReducescattersWithSplits) {
  Watchdog dog(60, "FusedReducescattersWithSplits");
  Job job;
  HVD_ASSERT_OK(job.Start(3));
  RunRanks(3, [&](int r) {
    Submission a = Op(OpType::kReducescatter, "s.a", at::full({4, 2}, r + 1.0));
    Submission b = Op(OpType::kReducescatter, "s.b", at::arange(3, at::kFloat) * (r + 1.0));
    b.request.splits = {0, 3, 0};
    Submission c = Op(OpType::kReducescatter, "s.c", at::arange(6, at::kFloat) + r);
    c.request.splits = {1, 0, 5};
    std::vector<Submission> group = {a, b, c};
    for (auto& s : group) {
      s.request.group_id = 7;
      s.request.group_size = 3;
    }
    std::vector<std::shared_ptr<HandleState>> h;
    HVD_ASSERT_OK(RunOps(*job.rt[r], group, &h));
    EXPECT_TRUE(at::equal(h[0]->output(), at::full({r == 0 ? 2 : 1, 2}, 6.0))) << h[0]->output();
    at::Tensor b_sum = at::arange(3, at::kFloat) * 6.0;
    EXPECT_TRUE(at::equal(h[1]->output(), r == 1 ? b_sum : b_sum.narrow(0, 0, 0)))
        << h[1]->output();
    at::Tensor c_sum = at::arange(6, at::kFloat) * 3.0 + 3.0;
    at::Tensor c_want = r == 0   ? c_sum.narrow(0, 0, 1)
                        : r == 1 ? c_sum.narrow(0, 1, 0)
                                 : c_sum.narrow(0, 1, 5);
    EXPECT_TRUE(at::equal(h[2]->output(), c_want)) << "rank " << r << ": " << h[2]->output();

    Submission d = Op(OpType::kReducescatter, "s.d", at::ones({3}));
    d.request.splits = r == 2 ? std::vector<int64_t>{0, 0, 3} : std::vector<int64_t>{3, 0, 0};
    Status st = RunOne(*job.rt[r], d);
    EXPECT_TRUE(Contains(st.message(), "s.d") && Contains(st.message(), "splits")) << st.message();
    at::Tensor after = at::ones({2});
    HVD_EXPECT_OK(RunOne(*job.rt[r], Allreduce("after", after)));
  });
}

// A group is negotiated as one, but a member that does not match fails alone, on
// every rank; the group's other member runs.
TEST(RuntimeTest, GroupMemberMismatchFailsThatMemberOnly) {
  Watchdog dog(60, "GroupMemberMismatchFailsThatMemberOnly");
  Job job;
  HVD_ASSERT_OK(job.Start(3));
  RunRanks(3, [&](int r) {
    at::Tensor a = at::ones({3});
    at::Tensor b = at::ones({r == 1 ? 4 : 3});
    std::vector<Submission> group = {Allreduce("g.a", a), Allreduce("g.b", b)};
    for (auto& s : group) {
      s.request.group_id = 42;
      s.request.group_size = 2;
    }
    std::vector<std::shared_ptr<HandleState>> h;
    HVD_ASSERT_OK(job.rt[r]->Submit(group, &h));
    ASSERT_EQ(h.size(), 2u);
    for (auto& x : h) ASSERT_TRUE(x->Wait(0, kWait)) << x->name();
    HVD_EXPECT_OK(h[0]->status());
    EXPECT_TRUE(at::equal(a, at::full({3}, 3.0)));
    EXPECT_FALSE(h[1]->status().ok());
    EXPECT_TRUE(Contains(h[1]->status().message(), "g.b")) << h[1]->status().message();
  });
}

// Many ops submitted in a different order on every rank, some fused into one
// batch and some not (a 1 KB fusion threshold): every result exact.
TEST(RuntimeTest, ManyOpsInAnyOrderFusedOrNotAreExact) {
  Watchdog dog(90, "ManyOpsInAnyOrderFusedOrNotAreExact");
  Config config = TestConfig();
  config.fusion_threshold_bytes = 1024;
  Job job;
  HVD_ASSERT_OK(job.Start(3, config));
  constexpr int kOps = 60;
  RunRanks(3, [&](int r) {
    std::vector<int> order(kOps);
    std::iota(order.begin(), order.end(), 0);
    std::shuffle(order.begin(), order.end(), std::mt19937(r + 7));
    std::vector<at::Tensor> ts(kOps);
    std::vector<std::shared_ptr<HandleState>> all;
    for (int i : order) {
      // 1 to 600 floats: below and above the threshold
      ts[i] = at::arange(1 + (i * 37) % 600, at::kFloat) * static_cast<double>(r + 1);
      // One submission per op (not a group), so each cycle takes what has come.
      std::vector<std::shared_ptr<HandleState>> h;
      HVD_EXPECT_OK(job.rt[r]->Submit({Allreduce("t" + std::to_string(i), ts[i])}, &h));
      all.insert(all.end(), h.begin(), h.end());
    }
    for (auto& h : all) {
      ASSERT_TRUE(h->Wait(0, kWait)) << h->name();
      HVD_EXPECT_OK(h->status());
    }
    for (int i = 0; i < kOps; ++i) {
      at::Tensor want = at::arange(1 + (i * 37) % 600, at::kFloat) * 6.0;
      EXPECT_TRUE(at::equal(ts[i], want)) << "op " << i << " on rank " << r;
    }
  });
}

// A mismatch between ranks fails that op, with the same message, on every rank;
// the engine goes on and runs the next op.
TEST(RuntimeTest, MismatchFailsTheOpOnEveryRankAndTheEngineGoesOn) {
  Watchdog dog(60, "MismatchFailsTheOpOnEveryRankAndTheEngineGoesOn");
  Job job;
  HVD_ASSERT_OK(job.Start(3));
  std::vector<std::string> errors(3);
  RunRanks(3, [&](int r) {
    at::Tensor bad = at::ones({2 + (r == 1 ? 1 : 0)}, at::kFloat);
    Status st = RunOne(*job.rt[r], Allreduce("bad", bad));
    EXPECT_FALSE(st.ok());
    errors[r] = st.message();
    at::Tensor dtype = r == 2 ? at::ones({2}, at::kDouble) : at::ones({2}, at::kFloat);
    EXPECT_FALSE(RunOne(*job.rt[r], Allreduce("dtype", dtype)).ok());
    EXPECT_FALSE(job.rt[r]->stopped());
    at::Tensor good = at::ones({3}, at::kFloat);
    HVD_EXPECT_OK(RunOne(*job.rt[r], Allreduce("good", good)));
    EXPECT_TRUE(at::equal(good, at::full({3}, 3.0, at::kFloat)));
  });
  EXPECT_TRUE(Contains(errors[0], "bad")) << errors[0];
  EXPECT_TRUE(Contains(errors[0], "shape")) << errors[0];
  EXPECT_EQ(errors[0], errors[1]);
  EXPECT_EQ(errors[0], errors[2]);
}

// The checks made before an op is queued: refused on the calling rank alone, with
// nothing sent, so the other ranks never see the op.
TEST(RuntimeTest, LocalChecksRefuseBeforeQueuing) {
  Watchdog dog(60, "LocalChecksRefuseBeforeQueuing");
  Job job;
  HVD_ASSERT_OK(job.Start(2));
  RunRanks(2, [&](int r) {
    Runtime& rt = *job.rt[r];
    std::vector<std::shared_ptr<HandleState>> h;
    if (r == 0) {
      Submission unknown = Allreduce("x", at::ones({2}));
      unknown.process_set_id = 7;
      Status st = rt.Submit({unknown}, &h);
      EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
      EXPECT_TRUE(Contains(st.message(), "process set 7 is not registered")) << st.message();

      st = rt.Submit({Allreduce("x", at::ones({2}, at::kComplexFloat))}, &h);
      EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
      EXPECT_TRUE(Contains(st.message(), "is not supported")) << st.message();

      // An allreduce writes into its output, which must be there and fit: refused
      // here, not failed in the background thread (which stopped the engine).
      Submission no_output = Op(OpType::kAllreduce, "x", at::ones({2}));
      st = rt.Submit({no_output}, &h);
      EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
      EXPECT_TRUE(Contains(st.message(), "needs an output tensor")) << st.message();
      Submission small = Op(OpType::kBroadcast, "x", at::ones({4}));
      small.output = at::empty({2});
      st = rt.Submit({small}, &h);
      EXPECT_TRUE(Contains(st.message(), "needs an output tensor")) << st.message();

      // A group is all or nothing: a repeated name refuses both ops.
      st = rt.Submit({Allreduce("twice", at::ones({2})), Allreduce("twice", at::ones({2}))}, &h);
      EXPECT_FALSE(st.ok());
      EXPECT_TRUE(h.empty());

      Submission remove_global = Control(ControlKind::kRemoveProcessSet, "rm");
      remove_global.request.control.process_set = 0;
      st = rt.Submit({remove_global}, &h);
      EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);

      // Out-of-range op types and control kinds (a bad call of the bindings) are refused
      // here: on the wire the coordinator's decoder would stop the job.
      Submission bad_kind = Control(static_cast<ControlKind>(9), "bad_kind");
      st = rt.Submit({bad_kind}, &h);
      EXPECT_TRUE(Contains(st.message(), "is not a control op")) << st.message();
      Submission no_kind = Control(ControlKind::kNone, "no_kind");
      st = rt.Submit({no_kind}, &h);
      EXPECT_TRUE(Contains(st.message(), "is not a control op")) << st.message();
      Submission bad_type = Allreduce("bad_type", at::ones({2}));
      bad_type.request.type = static_cast<OpType>(7);
      st = rt.Submit({bad_type}, &h);
      EXPECT_TRUE(Contains(st.message(), "is not an op")) << st.message();
    }
    // A name stays taken while its handle is held, also after the op completed.
    at::Tensor t = at::ones({2});
    std::vector<std::shared_ptr<HandleState>> held;
    HVD_EXPECT_OK(RunOps(rt, {Allreduce("held", t)}, &held));
    Status again = rt.Submit({Allreduce("held", at::ones({2}))}, &h);
    EXPECT_FALSE(again.ok());
    EXPECT_TRUE(Contains(again.message(), "held")) << again.message();
    held.clear();
    // Nothing refused above reached the other rank: the next op pairs up.
    at::Tensor u = at::full({2}, static_cast<double>(r + 1));
    HVD_EXPECT_OK(RunOne(rt, Allreduce("after", u)));
    EXPECT_TRUE(at::equal(u, at::full({2}, 3.0)));
  });
}

// send/recv: a broadcast in which two ranks take part. It is ready once both
// submitted it, runs on them only (rank 1 never submits it and goes on with its own
// ops), and sends from the root to the other. Transfers cross in both directions at
// once; a non-participant cannot submit one.
TEST(RuntimeTest, PointToPointRunsOnItsTwoRanksOnly) {
  Watchdog dog(60, "PointToPointRunsOnItsTwoRanksOnly");
  Job job;
  HVD_ASSERT_OK(job.Start(3));
  RunRanks(3, [&](int r) {
    Runtime& rt = *job.rt[r];
    if (r == 1) {
      std::vector<std::shared_ptr<HandleState>> none;
      Status st = rt.Submit({PointToPoint("not_mine", at::ones({2}), 0, 2)}, &none);
      EXPECT_FALSE(st.ok());
    } else {
      // Both directions at once: 0 -> 2 and 2 -> 0.
      at::Tensor out = at::full({4}, static_cast<double>(r + 1));
      at::Tensor in = at::zeros({4});
      HVD_ASSERT_OK(RunOps(rt, {PointToPoint(r == 0 ? "a" : "b", out, r, 2 - r),
                                PointToPoint(r == 0 ? "b" : "a", in, 2 - r, r)}));
      EXPECT_TRUE(at::equal(in, at::full({4}, static_cast<double>(3 - r))));   // the other's
      EXPECT_TRUE(at::equal(out, at::full({4}, static_cast<double>(r + 1))));  // unchanged
    }
    at::Tensor t = at::ones({2});
    HVD_EXPECT_OK(RunOne(rt, Allreduce("after", t)));
    EXPECT_TRUE(at::equal(t, at::full({2}, 3.0)));
  });
}

// A send between ranks 0 and 1 that falls between two allreduces in one response list:
// rank 2 skips it, and still batches the allreduces as ranks 0 and 1 do (one fusion
// plan of the whole list), or the ranks would disagree on the counts they reduce.
TEST(RuntimeTest, SkippedPointToPointLeavesTheFusionPlanAlike) {
  Watchdog dog(60, "SkippedPointToPointLeavesTheFusionPlanAlike");
  Job job;
  HVD_ASSERT_OK(job.Start(3));
  RunRanks(3, [&](int r) {
    Runtime& rt = *job.rt[r];
    // Large enough for the segmented algorithms, whose segments would differ.
    at::Tensor a = at::full({300001}, static_cast<double>(r + 1));
    at::Tensor b = at::full({500003}, static_cast<double>(10 * (r + 1)));
    // Rank 0 comes first (the coordinator orders x1, p, x2), then rank 2, then rank 1,
    // whose one submission makes all three ready in one cycle.
    std::this_thread::sleep_for(std::chrono::milliseconds(r == 0 ? 0 : r == 2 ? 100 : 300));
    std::vector<Submission> subs{Allreduce("x1", a)};
    at::Tensor t = r == 0 ? at::full({3}, 42.0) : at::zeros({3});
    if (r < 2) subs.push_back(PointToPoint("p", t, 0, 1));
    subs.push_back(Allreduce("x2", b));
    HVD_ASSERT_OK(RunOps(rt, subs));
    EXPECT_TRUE(at::equal(a, at::full({300001}, 6.0)));
    EXPECT_TRUE(at::equal(b, at::full({500003}, 60.0)));
    EXPECT_TRUE(at::equal(t, at::full({3}, r < 2 ? 42.0 : 0.0)));
  });
}

// torch.distributed's new_group: only a set's members submit its registration (the
// backend exists on them only); every rank applies it, so the ids stay equal, and a
// set of the same ranks is shared. A non-member cannot submit it.
TEST(RuntimeTest, ProcessSetOfMembersIsRegisteredEverywhere) {
  Watchdog dog(60, "ProcessSetOfMembersIsRegisteredEverywhere");
  Job job;
  HVD_ASSERT_OK(job.Start(3));
  RunRanks(3, [&](int r) {
    Runtime& rt = *job.rt[r];
    auto of_members = [](const std::string& name, std::vector<int64_t> ranks) {
      Submission s = Control(ControlKind::kAddProcessSetOfMembers, name);
      s.request.control.ranks = std::move(ranks);
      return s;
    };
    if (r == 1) {
      std::vector<std::shared_ptr<HandleState>> none;
      Status st = rt.Submit({of_members("not_mine", {0, 2})}, &none);
      EXPECT_TRUE(Contains(st.message(), "only members submit it")) << st.message();
      // Rank 1 waits in an op of the global set meanwhile: the set is added beside it.
      at::Tensor t = at::ones({2});
      HVD_EXPECT_OK(RunOne(rt, Allreduce("meanwhile", t)));
    } else {
      std::shared_ptr<HandleState> h;
      HVD_ASSERT_OK(RunOne(rt, of_members("ends", {0, 2}), &h));
      EXPECT_EQ(h->output().item<int>(), 1);
      at::Tensor t = at::full({3}, static_cast<double>(r + 1));
      Submission in_set = Allreduce("in_set", t);
      in_set.process_set_id = 1;
      HVD_EXPECT_OK(RunOne(rt, in_set));
      EXPECT_TRUE(at::equal(t, at::full({3}, 4.0)));  // ranks 0 and 2: 1 + 3
      // A second group of the same ranks shares the set.
      HVD_ASSERT_OK(RunOne(rt, of_members("ends_again", {0, 2}), &h));
      EXPECT_EQ(h->output().item<int>(), 1);
      at::Tensor u = at::ones({2});
      HVD_EXPECT_OK(RunOne(rt, Allreduce("meanwhile", u)));
    }
    EXPECT_EQ(rt.process_sets().at(1), (std::vector<int>{0, 2}));  // on rank 1 too
    EXPECT_EQ(rt.process_sets().size(), 2u);
    // Members that disagree on the ranks fail at once, not when rank 1 never comes.
    if (r != 1) {
      std::shared_ptr<HandleState> h;
      Status st = RunOne(rt,
                         of_members("disagree", r == 0 ? std::vector<int64_t>{0, 2}
                                                       : std::vector<int64_t>{0, 1, 2}),
                         &h);
      EXPECT_TRUE(Contains(st.message(), "Mismatched process sets to add")) << st.message();
    }
  });
}

TEST(RuntimeTest, ProcessSetAddRunRemove) {
  Watchdog dog(60, "ProcessSetAddRunRemove");
  Job job;
  HVD_ASSERT_OK(job.Start(3));
  RunRanks(3, [&](int r) {
    Runtime& rt = *job.rt[r];
    Submission add = Control(ControlKind::kAddProcessSet, "add");
    add.request.control.ranks = {0, 2};
    std::shared_ptr<HandleState> h;
    HVD_ASSERT_OK(RunOne(rt, add, &h));
    const int id = h->output().item<int>();
    EXPECT_GT(id, 0);
    EXPECT_EQ(rt.process_sets().at(id), (std::vector<int>{0, 2}));

    at::Tensor t = at::full({3}, static_cast<double>(r + 1));
    Submission in_set = Allreduce("in_set", t);
    in_set.process_set_id = id;
    if (r == 1) {
      std::vector<std::shared_ptr<HandleState>> none;
      Status st = rt.Submit({in_set}, &none);
      EXPECT_TRUE(Contains(st.message(), "is not in process set")) << st.message();
    } else {
      HVD_EXPECT_OK(RunOne(rt, in_set));
      EXPECT_TRUE(at::equal(t, at::full({3}, 4.0)));  // ranks 0 and 2: 1 + 3
    }
    Submission remove = Control(ControlKind::kRemoveProcessSet, "remove");
    remove.request.control.process_set = id;
    HVD_EXPECT_OK(RunOne(rt, remove));
    EXPECT_EQ(rt.process_sets().count(id), 0u);
  });
}

// A rank that has joined contributes zeros to the others' allreduces until every
// rank joined; join returns the last rank to join.
TEST(RuntimeTest, JoinedRankContributesZeros) {
  Watchdog dog(60, "JoinedRankContributesZeros");
  Job job;
  HVD_ASSERT_OK(job.Start(3));
  std::atomic<bool> rank0_joined{false};
  RunRanks(3, [&](int r) {
    Runtime& rt = *job.rt[r];
    std::vector<std::shared_ptr<HandleState>> h;
    if (r == 1) {
      HVD_EXPECT_OK(RunOps(rt, {Control(ControlKind::kJoin, "join")}, &h));
    } else {
      for (int i = 0; i < 3; ++i) {
        at::Tensor t = at::full({4}, static_cast<double>(r + 1));
        HVD_EXPECT_OK(RunOne(rt, Allreduce("step" + std::to_string(i), t)));
        EXPECT_TRUE(at::equal(t, at::full({4}, 4.0))) << t;  // 1 + 0 + 3
      }
      if (r == 0) {
        HVD_EXPECT_OK(rt.Submit({Control(ControlKind::kJoin, "join")}, &h));
        rank0_joined = true;
      } else {  // rank 2 joins last, well after rank 0's join was sent
        while (!rank0_joined) std::this_thread::sleep_for(std::chrono::milliseconds(1));
        std::this_thread::sleep_for(std::chrono::milliseconds(200));
        HVD_EXPECT_OK(rt.Submit({Control(ControlKind::kJoin, "join")}, &h));
      }
      ASSERT_EQ(h.size(), 1u);
      ASSERT_TRUE(h[0]->Wait(0, kWait));
      HVD_EXPECT_OK(h[0]->status());
    }
    ASSERT_EQ(h.size(), 1u);
    ASSERT_TRUE(h[0]->output().defined());
    EXPECT_EQ(h[0]->output().item<int>(), 2);
  });
}

// A peer whose connections drop (its process died, as far as the others can tell)
// fails the ops in flight on every other rank, with an error and within the I/O
// timeout, instead of leaving them waiting; the engine then reports itself stopped.
TEST(RuntimeTest, LostPeerFailsOpsInFlightInsteadOfHanging) {
  Watchdog dog(60, "LostPeerFailsOpsInFlightInsteadOfHanging");
  hvd_test::World world;
  TcpOptions options = hvd_test::FastOptions();
  HVD_ASSERT_OK(hvd_test::MakeWorld(3, options, &world));
  std::vector<TcpTransport*> raw(3);
  std::vector<std::unique_ptr<Runtime>> rt(3);
  std::vector<Status> st(3);
  RunRanks(3, [&](int r) {
    raw[r] = world.transports[r].get();
    WorldInfo w;
    w.rank = r;
    w.size = 3;
    st[r] = Runtime::Create(w, TestConfig(), std::move(world.transports[r]), &rt[r]);
  });
  for (int r = 0; r < 3; ++r) HVD_ASSERT_OK(st[r]);
  RunRanks(3, [&](int r) {
    at::Tensor t = at::ones({8});
    HVD_EXPECT_OK(RunOne(*rt[r], Allreduce("before", t)));
  });
  raw[2]->Abort();  // rank 2's sockets close
  auto start = std::chrono::steady_clock::now();
  RunRanks(2, [&](int r) {
    at::Tensor t = at::ones({8});
    Status s = RunOne(*rt[r], Allreduce("after", t));
    EXPECT_FALSE(s.ok());
    EXPECT_NE(s.message(), "") << "rank " << r;
    EXPECT_TRUE(rt[r]->stopped());
    std::vector<std::shared_ptr<HandleState>> h;
    EXPECT_FALSE(rt[r]->Submit({Allreduce("later", at::ones({1}))}, &h).ok());
  });
  EXPECT_LT(hvd_test::SecondsSince(start), 20.0);
  RunRanks(3, [&](int r) { rt[r].reset(); });
}

// Shutdown with an op that only one rank submitted: the op fails with an error
// (it can never run) and shutdown completes on every rank.
TEST(RuntimeTest, ShutdownFailsAnOpOnlyOneRankSubmitted) {
  Watchdog dog(60, "ShutdownFailsAnOpOnlyOneRankSubmitted");
  Job job;
  HVD_ASSERT_OK(job.Start(2));
  std::vector<std::shared_ptr<HandleState>> h;
  HVD_ASSERT_OK(job.rt[0]->Submit({Allreduce("alone", at::ones({2}))}, &h));
  ASSERT_EQ(h.size(), 1u);
  // A callback waiting for the op (the torch.distributed backend's) runs once, with
  // the op's error to read; one registered afterwards runs at once.
  std::atomic<int> calls{0};
  std::atomic<bool> failed{false};
  h[0]->OnComplete([&calls, &failed, raw = h[0].get()] {
    ++calls;
    failed = !raw->status().ok();
  });
  job.Stop();
  ASSERT_TRUE(h[0]->Wait(0, kWait));
  EXPECT_FALSE(h[0]->status().ok());
  EXPECT_EQ(calls.load(), 1);
  EXPECT_TRUE(failed.load());
  h[0]->OnComplete([&calls] { ++calls; });
  EXPECT_EQ(calls.load(), 2);
}

// OnComplete before the op completes runs on the completing thread, after the state
// is readable; Complete twice runs nothing twice.
TEST(HandleStateTest, OnCompleteRunsOnceAfterTheResultIsSet) {
  HandleState h;
  int before = 0;
  h.OnComplete([&] {
    ++before;
    EXPECT_TRUE(h.done());
    EXPECT_TRUE(h.output().defined());
  });
  EXPECT_EQ(before, 0);
  h.Complete(Status::Ok(), at::ones({2}));
  EXPECT_EQ(before, 1);
  h.Complete(Status::Ok());
  EXPECT_EQ(before, 1);
}

// A GPU event for HandleState's stream bookkeeping, with no GPU: which stream is
// "current" is a flag, and the calls are counted.
class FakeEvent : public GpuEvent {
 public:
  explicit FakeEvent(bool on_current) : on_current_(on_current) {}
  bool Ready() override { return true; }
  void BlockCurrentStream(const at::Tensor&, bool wait) override { waits += wait ? 1 : 0; }
  bool OnCurrentStream() override { return on_current_; }
  void MarkUsedOnStream(const at::Tensor& t) override { marked.push_back(t); }
  void RunAfter(const std::function<void()>& fn) override { fn(); }
  int waits = 0;
  std::vector<at::Tensor> marked;

 private:
  bool on_current_;
};

// A GPU op's output (its input, in place) is left to the allocator's own stream only
// once the stream that made the input waited for the op; a handle that goes without
// that wait tells the allocator that the op's stream used the output, once.
TEST(HandleStateTest, OutputIsMarkedUsedOnTheOpsStreamUnlessItsMakerWaited) {
  const at::Tensor out = at::ones({4});
  auto done = std::make_shared<FakeEvent>(false);
  {  // waited from the stream that made the input: nothing to mark
    HandleState h;
    h.Complete(Status::Ok(), out, {}, done, std::make_shared<FakeEvent>(true));
    h.BlockCurrentStream(true);
  }
  EXPECT_EQ(done->waits, 1);
  EXPECT_TRUE(done->marked.empty());
  {  // waited from another stream
    HandleState h;
    h.Complete(Status::Ok(), out, {}, done, std::make_shared<FakeEvent>(false));
    h.BlockCurrentStream(false);
  }
  EXPECT_EQ(done->waits, 1);
  ASSERT_EQ(done->marked.size(), 1u);
  EXPECT_TRUE(done->marked[0].is_same(out));
  {  // never waited (dropped by an elastic reset, say)
    HandleState h;
    h.Complete(Status::Ok(), out, {}, done, std::make_shared<FakeEvent>(true));
  }
  EXPECT_EQ(done->marked.size(), 2u);
  {  // the backend guarded the memory itself (no maker's event): nothing to mark
    HandleState h;
    h.Complete(Status::Ok(), out, {}, done);
  }
  EXPECT_EQ(done->marked.size(), 2u);
}

}  // namespace
}  // namespace hvd
