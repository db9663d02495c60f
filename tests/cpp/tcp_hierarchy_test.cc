// transport/tcp_hierarchy: the TCP transport with shared memory among the ranks
// of a "host" (threads given a host key), on one host and across several, with
// hosts of equal and unequal size, at every size and at auto thresholds.
#include <gtest/gtest.h>

#include <cstring>
#include <random>

#include "common/types.h"
#include "test_util.h"
#include "transport/tcp_transport.h"

namespace hvd {
namespace {

using hvd_test::MakeWorld;
using hvd_test::RunRanks;
using hvd_test::Watchdog;
using hvd_test::World;

struct Layout {
  const char* name;
  std::vector<int> host;  // host of each rank
  int knob;               // hierarchical_allreduce and _allgather
};

class TcpHierarchy : public ::testing::TestWithParam<Layout> {};

uint64_t Fnv(const void* p, size_t n) {
  uint64_t h = 1469598103934665603ull;
  for (size_t i = 0; i < n; ++i)
    h = (h ^ static_cast<const unsigned char*>(p)[i]) * 1099511628211ull;
  return h;
}

TEST_P(TcpHierarchy, CollectivesAreExactAndIdentical) {
  Watchdog wd(90, std::string("TcpHierarchy ") + GetParam().name);
  const Layout& layout = GetParam();
  const int n = static_cast<int>(layout.host.size());
  World w;
  HVD_ASSERT_OK(MakeWorld(
      n,
      [&](int r) {
        TcpOptions o = hvd_test::FastOptions();
        o.hierarchical_allreduce = o.hierarchical_allgather = layout.knob;
        o.host_key = "host" + std::to_string(layout.host[r]);
        return o;
      },
      &w));
  for (int r = 0; r < n; ++r) {
    std::vector<int> want;
    for (int q = 0; q < n; ++q) {
      if (layout.host[q] == layout.host[r]) want.push_back(q);
    }
    if (want.size() < 2) want.clear();
    EXPECT_EQ(w.transports[r]->local_ranks(), want) << "rank " << r;
  }
  std::vector<std::string> errors(n);
  std::vector<std::vector<uint64_t>> hashes(n);
  RunRanks(n, [&](int r) {
    TcpTransport& t = *w.transports[r];
    auto fail = [&](const std::string& what) { errors[r] += what + "; "; };
    for (size_t count : {size_t{7}, size_t{1000}, size_t{300001}}) {
      // Integer-valued floats: exact in any order.
      std::vector<float> x(count);
      for (size_t i = 0; i < count; ++i) x[i] = static_cast<float>((i % 97) * (r + 1));
      Status st = t.Allreduce(x.data(), count, DataType::kFloat32, ReduceOp::kSum);
      if (!st.ok()) return fail(st.message());
      const float tri = static_cast<float>(n * (n + 1) / 2);
      for (size_t i = 0; i < count; i += 997) {
        if (x[i] != static_cast<float>(i % 97) * tri) fail("sum at " + std::to_string(i));
      }
      std::vector<int32_t> m(count);
      for (size_t i = 0; i < count; ++i) m[i] = static_cast<int32_t>((i * 31 + r * 7) % 101);
      st = t.Allreduce(m.data(), count, DataType::kInt32, ReduceOp::kMax);
      if (!st.ok()) return fail(st.message());
      for (size_t i = 0; i < count; i += 991) {
        int32_t want = 0;
        for (int q = 0; q < n; ++q) want = std::max<int32_t>(want, (i * 31 + q * 7) % 101);
        if (m[i] != want) fail("max at " + std::to_string(i));
      }
      // Arbitrary floats: the same bits on every rank.
      std::mt19937 rng(r + 5);
      std::uniform_real_distribution<float> dist(-1, 1);
      for (auto& v : x) v = dist(rng);
      st = t.Allreduce(x.data(), count, DataType::kFloat32, ReduceOp::kSum);
      if (!st.ok()) return fail(st.message());
      hashes[r].push_back(Fnv(x.data(), count * 4));
    }
    // Reducescatter with uneven counts.
    std::vector<size_t> counts(n);
    size_t total = 0;
    for (int q = 0; q < n; ++q) total += counts[q] = 40000 + 1001 * q;
    std::vector<float> rs(total, static_cast<float>(r + 1)), out(counts[r]);
    Status st = t.Reducescatter(rs.data(), counts, DataType::kFloat32, ReduceOp::kSum, out.data());
    if (!st.ok()) return fail(st.message());
    if (out.front() != n * (n + 1) / 2.0f || out.back() != n * (n + 1) / 2.0f)
      fail("reducescatter");
    // Allgather with uneven blocks.
    std::vector<size_t> bytes(n);
    total = 0;
    for (int q = 0; q < n; ++q) total += bytes[q] = 70000 + 13 * q;
    std::vector<char> mine(bytes[r], static_cast<char>('a' + r)), all(total);
    st = t.Allgatherv(mine.data(), all.data(), bytes);
    if (!st.ok()) return fail(st.message());
    size_t off = 0;
    for (int q = 0; q < n; ++q) {
      if (all[off] != 'a' + q || all[off + bytes[q] - 1] != 'a' + q) fail("allgather block");
      off += bytes[q];
    }
    // Small blocks, some empty (the "always" layouts take the hierarchy here too).
    total = 0;
    for (int q = 0; q < n; ++q) total += bytes[q] = q % 3 == 1 ? 0 : 5 + q;
    std::vector<char> small(bytes[r]), small_all(total + 1, '?');
    for (size_t i = 0; i < small.size(); ++i) small[i] = static_cast<char>(r * 16 + i);
    st = t.Allgatherv(small.data(), small_all.data(), bytes);
    if (!st.ok()) return fail(st.message());
    off = 0;
    for (int q = 0; q < n; ++q) {
      for (size_t i = 0; i < bytes[q]; ++i) {
        if (small_all[off + i] != static_cast<char>(q * 16 + i)) fail("small allgather block");
      }
      off += bytes[q];
    }
    if (small_all[total] != '?') fail("small allgather wrote past its end");
    // The control plane (through the segment on one host), messages of every
    // rank's own length, one larger than a segment slot.
    for (size_t len : {size_t{0}, size_t{50}, size_t{300000}}) {
      std::string msg(len + r, static_cast<char>('A' + r)), bcast = r == 0 ? msg : "";
      std::vector<std::string> got;
      st = t.Gather(msg, &got);
      if (!st.ok()) return fail(st.message());
      for (int q = 0; r == 0 && q < n; ++q) {
        if (got[q] != std::string(len + q, static_cast<char>('A' + q))) fail("gather");
      }
      st = t.Bcast(&bcast);
      if (!st.ok()) return fail(st.message());
      if (bcast != std::string(len, 'A')) fail("bcast " + std::to_string(len));
      std::string same(len, static_cast<char>('a' + r));
      st = t.Allgather(same, &got);
      if (!st.ok()) return fail(st.message());
      for (int q = 0; q < n; ++q) {
        if (got.size() != static_cast<size_t>(n) ||
            got[q] != std::string(len, static_cast<char>('a' + q))) {
          fail("allgather control " + std::to_string(len));
          break;
        }
      }
    }
    std::vector<uint64_t> and_bits{~0ull, 1ull << r}, or_bits{1ull << r};
    st = t.AllreduceBits(&and_bits, &or_bits);
    if (!st.ok()) return fail(st.message());
    if (and_bits[0] != ~0ull || and_bits[1] != (n == 1 ? 1u : 0u) ||
        or_bits[0] != (1ull << n) - 1) {
      fail("allreduce bits");
    }
    // Broadcast, small and large, from a rank that is not 0.
    for (size_t len : {size_t{100}, size_t{1} << 20}) {
      std::vector<char> b(len, r == 1 ? 'R' : 'x');
      st = t.Broadcast(b.data(), len, 1);
      if (!st.ok()) return fail(st.message());
      if (b.front() != 'R' || b.back() != 'R') fail("broadcast " + std::to_string(len));
    }
  });
  for (int r = 0; r < n; ++r) EXPECT_EQ(errors[r], "") << "rank " << r;
  for (int r = 1; r < n; ++r) EXPECT_EQ(hashes[r], hashes[0]) << "rank " << r;
}

INSTANTIATE_TEST_SUITE_P(
    Layouts, TcpHierarchy,
    ::testing::Values(Layout{"OneHostAuto", {0, 0, 0, 0}, -1},
                      Layout{"OneHostAlways", {0, 0, 0, 0, 0}, 1},
                      Layout{"TwoHostsInterleavedAuto", {0, 1, 0, 1, 0, 1}, -1},
                      Layout{"TwoHostsAlways", {0, 0, 0, 1, 1, 1}, 1},
                      Layout{"UnevenHostsAuto", {0, 0, 0, 1, 1}, -1},
                      Layout{"SingletonHostsAlways", {0, 1, 2}, 1}),
    [](const ::testing::TestParamInfo<Layout>& i) { return std::string(i.param.name); });

// The path each collective takes, as the timeline names it (PathName): "SHM" on
// one host above the auto threshold or with the knob at 1, "SHM_TCP" for the
// hierarchical allreduce and allgather across hosts, "TCP" below the threshold,
// with the knobs at 0, for alltoall, and for broadcast and reducescatter across
// hosts. The collectives branch on the same predicate (PathOf).
TEST(TcpHierarchyPath, PathNameIsThePathTaken) {
  Watchdog wd(60, "PathNameIsThePathTaken");
  struct Case {
    std::vector<int> host;
    int knob;
    std::vector<const char*> want;  // allreduce, allgather, broadcast, reducescatter,
                                    // alltoall (1 MiB each), allreduce of 1 KiB, control
  };
  const std::vector<Case> cases = {
      {{0, 0, 0}, -1, {"SHM", "SHM", "SHM", "SHM", "TCP", "TCP", "SHM"}},
      {{0, 0}, 1, {"SHM", "SHM", "SHM", "SHM", "TCP", "SHM", "SHM"}},
      {{0, 0, 0}, 0, {"TCP", "TCP", "TCP", "TCP", "TCP", "TCP", "TCP"}},
      {{0, 1, 0, 1}, -1, {"SHM_TCP", "SHM_TCP", "TCP", "TCP", "TCP", "TCP", "TCP"}},
      {{0, 0, 1}, 1, {"TCP", "TCP", "TCP", "TCP", "TCP", "TCP", "TCP"}},  // uneven hosts
  };
  const size_t big = size_t{1} << 20, small = 1024;
  for (size_t c = 0; c < cases.size(); ++c) {
    const Case& k = cases[c];
    const int n = static_cast<int>(k.host.size());
    World w;
    HVD_ASSERT_OK(MakeWorld(
        n,
        [&](int r) {
          TcpOptions o = hvd_test::FastOptions();
          o.hierarchical_allreduce = o.hierarchical_allgather = k.knob;
          o.host_key = "host" + std::to_string(k.host[r]);
          return o;
        },
        &w, "path" + std::to_string(c)));
    for (int r = 0; r < n; ++r) {
      const TcpTransport& t = *w.transports[r];
      const std::vector<std::string> got = {
          t.PathName(OpType::kAllreduce, big), t.PathName(OpType::kAllgather, big),
          t.PathName(OpType::kBroadcast, big), t.PathName(OpType::kReducescatter, big),
          t.PathName(OpType::kAlltoall, big),  t.PathName(OpType::kAllreduce, small),
          t.PathName(OpType::kControl, 0)};
      EXPECT_EQ(got, std::vector<std::string>(k.want.begin(), k.want.end()))
          << "case " << c << ", rank " << r;
    }
    // The allreduce of 1 MiB, on the path named above, gives the sum.
    std::vector<std::string> errors(n);
    RunRanks(n, [&](int r) {
      std::vector<float> x(big / 4, static_cast<float>(r + 1));
      Status st =
          w.transports[r]->Allreduce(x.data(), x.size(), DataType::kFloat32, ReduceOp::kSum);
      if (!st.ok() || x.back() != n * (n + 1) / 2.0f) errors[r] = "allreduce " + st.message();
    });
    for (int r = 0; r < n; ++r) EXPECT_EQ(errors[r], "") << "case " << c << ", rank " << r;
  }
}

// On one host the control plane goes through the segment, which compares the
// ranks' calls: a rank making another control call than its peers (over TCP the
// bytes would just be misread) fails every rank with kMismatch, and the next
// matching call works.
TEST(TcpHierarchyControl, OneHostMismatchedControlCallsFailEveryRank) {
  Watchdog wd(60, "OneHostMismatchedControlCallsFailEveryRank");
  const int n = 4;
  World w;
  HVD_ASSERT_OK(MakeWorld(
      n,
      [&](int r) {
        TcpOptions o = hvd_test::FastOptions();
        o.hierarchical_allreduce = 1;
        o.host_key = "one";
        return o;
      },
      &w));
  std::vector<Status> st(n), after(n);
  RunRanks(n, [&](int r) {
    TcpTransport& t = *w.transports[r];
    std::vector<std::string> all;
    st[r] = r == 2 ? t.Allgather("abcd", &all) : t.Gather("abcd", &all);
    after[r] = t.Allgather(std::string(3, static_cast<char>('a' + r)), &all);
    if (after[r].ok() && all[3] != "ddd") after[r] = Status::Aborted("wrong allgather after");
  });
  for (int r = 0; r < n; ++r) {
    EXPECT_EQ(st[r].code(), StatusCode::kMismatch) << "rank " << r << ": " << st[r].message();
    EXPECT_NE(st[r].message().find("local rank 2: Exchange"), std::string::npos) << st[r].message();
    HVD_EXPECT_OK(after[r]);
  }
}

// A rank of a host that dies (its transport aborted): the other ranks of that
// host fail through the shared segment, the other host over TCP, within seconds.
TEST(TcpHierarchyFailure, DeadLocalRankFailsEveryone) {
  Watchdog wd(60, "DeadLocalRankFailsEveryone");
  const int n = 6;
  World w;
  HVD_ASSERT_OK(MakeWorld(
      n,
      [&](int r) {
        TcpOptions o = hvd_test::FastOptions();
        o.io_timeout_s = 30;
        o.hierarchical_allreduce = 1;
        o.host_key = r < 3 ? "a" : "b";
        return o;
      },
      &w));
  w.transports[4]->Abort();
  std::vector<Status> st(n);
  std::vector<double> took(n);
  RunRanks(n, [&](int r) {
    if (r == 4) return;
    std::vector<float> x(500000, 1.0f);
    auto t0 = std::chrono::steady_clock::now();
    st[r] = w.transports[r]->Allreduce(x.data(), x.size(), DataType::kFloat32, ReduceOp::kSum);
    took[r] = hvd_test::SecondsSince(t0);
    if (!st[r].ok()) w.transports[r]->Abort();
  });
  for (int r = 0; r < n; ++r) {
    if (r == 4) continue;
    EXPECT_FALSE(st[r].ok()) << "rank " << r;
    EXPECT_LT(took[r], 10.0) << "rank " << r << ": " << st[r].message();
  }
}

}  // namespace
}  // namespace hvd
