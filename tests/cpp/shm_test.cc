// transport/shm: shared-memory collectives among local ranks, as threads of one
// process and as forked processes. Results are compared bit for bit against a
// reduction in rank order; failures (a killed rank, Abort(), a rank that leaves or
// never comes, a wrong secret, mismatched calls) must end every call quickly.
#include "transport/shm.h"

#include <dirent.h>
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <fstream>
#include <numeric>
#include <set>
#include <sstream>

#include "common/types.h"
#include "test_util.h"

namespace hvd {
namespace {

using hvd_test::kSecret;
using hvd_test::RunRanks;
using hvd_test::SecondsSince;
using hvd_test::StatusString;
using hvd_test::Watchdog;
using Clock = std::chrono::steady_clock;

// Small slots, so that modest sizes already take several chunks.
constexpr size_t kSlot = 4096;

ShmOptions TestOptions(double timeout_s = 10) {
  ShmOptions o;
  o.slot_bytes = kSlot;
  o.timeout_s = timeout_s;
  return o;
}

// A key no other test (or concurrent test run on this host) uses.
std::string UniqueKey(const std::string& what) {
  static std::atomic<int> n{0};
  return "shm_test/" + std::to_string(::getpid()) + "/" + what + "/" + std::to_string(n++);
}

using Groups = std::vector<std::unique_ptr<ShmGroup>>;

// Groups for ranks 0..n-1, created concurrently (ranks as threads).
Groups MakeGroups(int n, const std::string& key, const ShmOptions& opt = TestOptions()) {
  Groups g(n);
  std::vector<Status> st(n);
  RunRanks(n, [&](int r) { st[r] = ShmGroup::Create(key, kSecret, r, n, opt, &g[r]); });
  for (int r = 0; r < n; ++r) {
    EXPECT_TRUE(st[r].ok()) << "rank " << r << ": " << StatusString(st[r]);
  }
  return g;
}

uint64_t Mix(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

// Rank `rank`'s input: finite values that keep every op free of undefined
// behaviour (no signed overflow) for up to 8 ranks.
std::vector<char> Input(DataType dt, ReduceOp op, int rank, size_t count, uint64_t seed) {
  std::vector<char> v(count * DataTypeSize(dt) + 1);  // +1: never a null data()
  for (size_t i = 0; i < count; ++i) {
    uint64_t h = Mix(seed * 1000003 + rank * 7919 + i);
    int64_t small = static_cast<int64_t>(h % 2001) - 1000;  // sums
    int64_t factor = static_cast<int64_t>(h % 2) ? 2 : -1;  // products
    int64_t x = op == ReduceOp::kProduct ? factor : small;
    char* p = v.data() + i * DataTypeSize(dt);
    switch (dt) {
      case DataType::kUInt8:
        *reinterpret_cast<uint8_t*>(p) = static_cast<uint8_t>(h);
        break;
      case DataType::kInt8:
        *reinterpret_cast<int8_t*>(p) = static_cast<int8_t>(h);
        break;
      case DataType::kInt16:
        *reinterpret_cast<int16_t*>(p) = static_cast<int16_t>(x);
        break;
      case DataType::kInt32:
        *reinterpret_cast<int32_t*>(p) = static_cast<int32_t>(x);
        break;
      case DataType::kInt64:
        *reinterpret_cast<int64_t*>(p) = op == ReduceOp::kProduct ? x : x * 1000003;
        break;
      case DataType::kFloat16:
        *reinterpret_cast<uint16_t*>(p) = FloatToHalf(static_cast<float>(x) / 7);
        break;
      case DataType::kBFloat16:
        *reinterpret_cast<uint16_t*>(p) = FloatToBFloat16(static_cast<float>(x) / 7);
        break;
      case DataType::kFloat32:
        *reinterpret_cast<float*>(p) = static_cast<float>(x) / 3;
        break;
      case DataType::kFloat64:
        *reinterpret_cast<double*>(p) = static_cast<double>(x) / 3;
        break;
      case DataType::kBool:
        *reinterpret_cast<uint8_t*>(p) = (h >> 9) % 4 != 0;
        break;
    }
  }
  return v;
}

// The reduction over `n` ranks, in rank order.
std::vector<char> Reference(DataType dt, ReduceOp op, int n, size_t count, uint64_t seed) {
  std::vector<char> acc = Input(dt, op, 0, count, seed);
  for (int r = 1; r < n; ++r) {
    std::vector<char> x = Input(dt, op, r, count, seed);
    ReduceInto(acc.data(), x.data(), count, dt, op);
  }
  return acc;
}

const DataType kAllTypes[] = {DataType::kUInt8,    DataType::kInt8,    DataType::kInt16,
                              DataType::kInt32,    DataType::kInt64,   DataType::kFloat16,
                              DataType::kBFloat16, DataType::kFloat32, DataType::kFloat64,
                              DataType::kBool};
const ReduceOp kOps[] = {ReduceOp::kSum, ReduceOp::kMin, ReduceOp::kMax, ReduceOp::kProduct};

// Element counts: empty, one, odd, and (for every type) more than one chunk.
std::vector<size_t> Counts(DataType dt) { return {0, 1, 3, 517, 3 * kSlot / DataTypeSize(dt) + 5}; }

uint64_t Fnv(const void* p, size_t n, uint64_t h = 1469598103934665603ull) {
  const auto* b = static_cast<const unsigned char*>(p);
  for (size_t i = 0; i < n; ++i) h = (h ^ b[i]) * 1099511628211ull;
  return h;
}

// Runs every dtype x op x count allreduce on this rank's group; returns the first
// error ("" if none) and a hash of all results in *hash.
std::string CheckAllreduces(ShmGroup* g, uint64_t* hash) {
  uint64_t seed = 0;
  for (DataType dt : kAllTypes) {
    for (ReduceOp op : kOps) {
      for (size_t count : Counts(dt)) {
        ++seed;
        std::vector<char> buf = Input(dt, op, g->rank(), count, seed);
        Status st = g->Allreduce(buf.data(), count, dt, op);
        std::string what = std::string(DataTypeName(dt)) + "/" + ReduceOpName(op) + "/" +
                           std::to_string(count) + " on rank " + std::to_string(g->rank());
        if (!st.ok()) return what + ": " + StatusString(st);
        std::vector<char> want = Reference(dt, op, g->size(), count, seed);
        if (std::memcmp(buf.data(), want.data(), count * DataTypeSize(dt)) != 0) {
          return what + ": differs from the rank-order reference";
        }
        *hash = Fnv(buf.data(), count * DataTypeSize(dt), *hash);
      }
    }
  }
  return "";
}

class ShmSizes : public ::testing::TestWithParam<int> {};

// Each step cut into parts for three threads (this rank's and two helpers).
ShmOptions ThreadedOptions() {
  ShmOptions o = TestOptions();
  o.threads = 3;
  o.min_part_bytes = 64;
  return o;
}

void CheckAllreduceEveryTypeAndOp(int n, const ShmOptions& opt) {
  auto g = MakeGroups(n, UniqueKey("allreduce"), opt);
  std::vector<std::string> err(n);
  std::vector<uint64_t> hash(n, 0);
  RunRanks(n, [&](int r) { err[r] = CheckAllreduces(g[r].get(), &hash[r]); });
  for (int r = 0; r < n; ++r) {
    EXPECT_EQ(err[r], "");
    EXPECT_EQ(hash[r], hash[0]) << "rank " << r;
  }
}

TEST_P(ShmSizes, AllreduceEveryTypeAndOp) {
  Watchdog wd(60, "ShmSizes.AllreduceEveryTypeAndOp");
  CheckAllreduceEveryTypeAndOp(GetParam(), TestOptions());
}

TEST(Shm, HelperThreadCountIsCapped) {
  Watchdog wd(60, "Shm.HelperThreadCountIsCapped");
  ShmOptions o = ThreadedOptions();
  o.threads = 100000;  // taken as 64: 63 helpers per rank, not a failure to start
  CheckAllreduceEveryTypeAndOp(2, o);
}

TEST_P(ShmSizes, AllreduceEveryTypeAndOpWithHelperThreads) {
  Watchdog wd(60, "ShmSizes.AllreduceEveryTypeAndOpWithHelperThreads");
  CheckAllreduceEveryTypeAndOp(GetParam(), ThreadedOptions());
}

void CheckReduceScatterUnevenCounts(int n, const ShmOptions& opt) {
  auto g = MakeGroups(n, UniqueKey("reducescatter"), opt);
  // Uneven, some empty, one spanning several chunks.
  std::vector<size_t> counts(n);
  for (int r = 0; r < n; ++r) counts[r] = r % 3 == 1 ? 0 : 100 * r + 7 + (r == 0 ? 3000 : 0);
  const size_t total = std::accumulate(counts.begin(), counts.end(), size_t{0});
  std::vector<std::string> err(n);
  for (DataType dt : {DataType::kFloat32, DataType::kInt64, DataType::kBFloat16}) {
    const uint64_t seed = 100 + static_cast<uint64_t>(dt);
    const std::vector<char> want = Reference(dt, ReduceOp::kSum, n, total, seed);
    const size_t es = DataTypeSize(dt);
    RunRanks(n, [&](int r) {
      std::vector<char> buf = Input(dt, ReduceOp::kSum, r, total, seed);
      const std::vector<char> before = buf;
      Status st = g[r]->ReduceScatter(buf.data(), counts, dt, ReduceOp::kSum);
      if (!st.ok()) {
        err[r] = StatusString(st);
        return;
      }
      size_t off = std::accumulate(counts.begin(), counts.begin() + r, size_t{0}) * es;
      size_t len = counts[r] * es;
      if (std::memcmp(buf.data() + off, want.data() + off, len) != 0) {
        err[r] += std::string(DataTypeName(dt)) + ": wrong segment; ";
      }
      // The rest of the buffer is left as it was.
      if (std::memcmp(buf.data(), before.data(), off) != 0 ||
          std::memcmp(buf.data() + off + len, before.data() + off + len, total * es - off - len))
        err[r] += std::string(DataTypeName(dt)) + ": other segments changed; ";
    });
  }
  for (int r = 0; r < n; ++r) EXPECT_EQ(err[r], "") << "rank " << r;
}

TEST_P(ShmSizes, ReduceScatterUnevenCounts) {
  Watchdog wd(30, "ShmSizes.ReduceScatterUnevenCounts");
  CheckReduceScatterUnevenCounts(GetParam(), TestOptions());
}

TEST_P(ShmSizes, ReduceScatterUnevenCountsWithHelperThreads) {
  Watchdog wd(30, "ShmSizes.ReduceScatterUnevenCountsWithHelperThreads");
  CheckReduceScatterUnevenCounts(GetParam(), ThreadedOptions());
}

TEST_P(ShmSizes, AllgatherUnevenBytes) {
  const int n = GetParam();
  Watchdog wd(30, "ShmSizes.AllgatherUnevenBytes");
  auto g = MakeGroups(n, UniqueKey("allgather"));
  for (int variant = 0; variant < 3; ++variant) {
    std::vector<size_t> bytes(n);
    for (int r = 0; r < n; ++r) {
      // Odd sizes; some empty; one far larger than a whole buffer (several windows).
      bytes[r] = variant == 0   ? 13 * r + 1
                 : variant == 1 ? (r % 2 ? 0 : 3 * kSlot * n + 11)
                                : (r == n - 1 ? 5 * kSlot * n + 3 : 0);
    }
    const size_t total = std::accumulate(bytes.begin(), bytes.end(), size_t{0});
    std::vector<char> want(total + 1);
    for (size_t i = 0; i < total; ++i) want[i] = static_cast<char>(Mix(i + variant));
    std::vector<std::string> err(n);
    RunRanks(n, [&](int r) {
      std::vector<char> buf(total + 1, 0x5a);
      size_t off = std::accumulate(bytes.begin(), bytes.begin() + r, size_t{0});
      std::memcpy(buf.data() + off, want.data() + off, bytes[r]);
      Status st = g[r]->Allgather(buf.data(), bytes);
      if (!st.ok())
        err[r] = StatusString(st);
      else if (std::memcmp(buf.data(), want.data(), total) != 0)
        err[r] = "wrong result";
    });
    for (int r = 0; r < n; ++r) EXPECT_EQ(err[r], "") << "variant " << variant << " rank " << r;
  }
}

TEST_P(ShmSizes, BroadcastFromEveryRoot) {
  const int n = GetParam();
  Watchdog wd(30, "ShmSizes.BroadcastFromEveryRoot");
  auto g = MakeGroups(n, UniqueKey("broadcast"));
  for (int root = 0; root < n; ++root) {
    for (size_t bytes : {size_t{0}, size_t{1}, size_t{4099}, 2 * kSlot * n + 17}) {
      std::vector<std::string> err(n);
      RunRanks(n, [&](int r) {
        std::vector<char> buf(bytes + 1);
        for (size_t i = 0; i < bytes; ++i) buf[i] = static_cast<char>(Mix(i * 31 + r));
        Status st = g[r]->Broadcast(buf.data(), bytes, root);
        if (!st.ok()) {
          err[r] = StatusString(st);
          return;
        }
        for (size_t i = 0; i < bytes; ++i) {
          if (buf[i] != static_cast<char>(Mix(i * 31 + root))) {
            err[r] = "wrong byte " + std::to_string(i) + " of " + std::to_string(bytes);
            return;
          }
        }
      });
      for (int r = 0; r < n; ++r) EXPECT_EQ(err[r], "") << "root " << root << " rank " << r;
    }
  }
  std::vector<Status> st(n);
  RunRanks(n, [&](int r) { st[r] = g[r]->Barrier(); });
  for (int r = 0; r < n; ++r) HVD_EXPECT_OK(st[r]);
}

// Control messages: every rank's own length (empty, within one slot, exactly a
// slot's payload, several slots), all-to-all, to rank 0 only and from rank 0 only,
// interleaved with allreduces that use the same buffers.
TEST_P(ShmSizes, ExchangeMessagesOfAnyLength) {
  const int n = GetParam();
  Watchdog wd(60, "ShmSizes.ExchangeMessagesOfAnyLength");
  auto g = MakeGroups(n, UniqueKey("exchange"));
  auto message = [](int r, size_t len, int it) {
    std::string m(len, '\0');
    for (size_t i = 0; i < len; ++i) m[i] = static_cast<char>(Mix(r * 131 + i + it * 7));
    return m;
  };
  std::vector<std::string> err(n);
  RunRanks(n, [&](int r) {
    const size_t base[] = {0, 1, 100, kSlot - 64, kSlot - 63, 3 * kSlot + 5};
    int it = 0;
    for (size_t b : base) {
      for (int role = 0; role < 3 && err[r].empty(); ++role, ++it) {
        // role 0: all to all; 1: everyone to rank 0; 2: rank 0 to everyone.
        const size_t len = b + (b > 0 ? r * 37 : 0);
        const std::string mine = message(r, len, it);
        const bool send = role != 2 || r == 0, receive = role != 1 || r == 0;
        std::vector<std::string> all;
        Status st = g[r]->Exchange(10 + role, send ? &mine : nullptr, receive ? &all : nullptr);
        const std::string what = "length " + std::to_string(b) + " role " + std::to_string(role);
        if (!st.ok()) {
          err[r] = what + ": " + StatusString(st);
          break;
        }
        for (int q = 0; receive && q < n; ++q) {
          const bool sent = role != 2 || q == 0;
          const std::string want = sent ? message(q, b + (b > 0 ? q * 37 : 0), it) : "";
          if (all[q] != want) err[r] = what + ": wrong message from rank " + std::to_string(q);
        }
        std::vector<float> x(kSlot, 1.0f);
        st = g[r]->Allreduce(x.data(), x.size(), DataType::kFloat32, ReduceOp::kSum);
        if (!st.ok() || x.back() != static_cast<float>(n)) err[r] = what + ": allreduce after";
      }
    }
  });
  for (int r = 0; r < n; ++r) EXPECT_EQ(err[r], "") << "rank " << r;
}

INSTANTIATE_TEST_SUITE_P(Ranks, ShmSizes, ::testing::Values(1, 2, 3, 5, 8));

// Mixed collectives back to back exercise the buffer rotation across calls.
TEST(Shm, MixedSequenceKeepsBuffersApart) {
  const int n = 4;
  Watchdog wd(30, "Shm.MixedSequenceKeepsBuffersApart");
  auto g = MakeGroups(n, UniqueKey("mixed"));
  std::vector<std::string> err(n);
  RunRanks(n, [&](int r) {
    for (int it = 0; it < 20 && err[r].empty(); ++it) {
      size_t count = (it * 977) % (4 * kSlot);
      std::vector<char> x = Input(DataType::kFloat32, ReduceOp::kSum, r, count, it);
      Status st = g[r]->Allreduce(x.data(), count, DataType::kFloat32, ReduceOp::kSum);
      if (!st.ok() || x != Reference(DataType::kFloat32, ReduceOp::kSum, n, count, it)) {
        err[r] = "allreduce " + std::to_string(it) + " " + st.message();
      }
      std::vector<char> b(it * 301 + 1, static_cast<char>(r == it % n ? it : -1));
      st = g[r]->Broadcast(b.data(), b.size(), it % n);
      if (!st.ok() || std::count(b.begin(), b.end(), static_cast<char>(it)) != b.size()) {
        err[r] = "broadcast " + std::to_string(it) + " " + st.message();
      }
    }
  });
  for (int r = 0; r < n; ++r) EXPECT_EQ(err[r], "") << "rank " << r;
}

// Two live groups in one process (different keys) run at the same time.
TEST(Shm, TwoGroupsDoNotInterfere) {
  const int n = 3;
  Watchdog wd(30, "Shm.TwoGroupsDoNotInterfere");
  auto a = MakeGroups(n, UniqueKey("a"));
  auto b = MakeGroups(n, UniqueKey("b"));
  std::vector<int> bad(2 * n, 0);
  RunRanks(2 * n, [&](int t) {
    auto& g = t < n ? a : b;
    const int r = t % n;
    const float mine = t < n ? 1.0f : 100.0f;
    for (int it = 0; it < 50; ++it) {
      std::vector<float> x(3000, mine * (r + 1));
      Status st = g[r]->Allreduce(x.data(), x.size(), DataType::kFloat32, ReduceOp::kSum);
      if (!st.ok() || x[0] != mine * 6 || x.back() != mine * 6) ++bad[t];
    }
  });
  for (int t = 0; t < 2 * n; ++t) EXPECT_EQ(bad[t], 0) << "thread " << t;
}

TEST(Shm, SameKeyTwiceIsRefused) {
  Watchdog wd(30, "Shm.SameKeyTwiceIsRefused");
  const std::string key = UniqueKey("twice");
  auto g = MakeGroups(1, key);  // size 1: no rendezvous socket, so the key is free
  std::unique_ptr<ShmGroup> first, second;
  std::vector<Status> st(2);
  std::thread hold([&] { st[0] = ShmGroup::Create(key, kSecret, 0, 2, TestOptions(0.5), &first); });
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  st[1] = ShmGroup::Create(key, kSecret, 0, 2, TestOptions(0.5), &second);
  hold.join();
  EXPECT_EQ(st[1].code(), StatusCode::kAborted);
  EXPECT_NE(st[1].message().find("is live on this host"), std::string::npos) << st[1].message();
  EXPECT_EQ(st[0].code(), StatusCode::kAborted);  // nobody joined it
  EXPECT_NE(st[0].message().find("waiting for local ranks [1]"), std::string::npos)
      << st[0].message();
}

TEST(Shm, WrongSecretIsRefused) {
  Watchdog wd(30, "Shm.WrongSecretIsRefused");
  const std::string key = UniqueKey("secret");
  Groups g(2);
  std::vector<Status> st(2);
  auto t0 = Clock::now();
  RunRanks(2, [&](int r) {
    st[r] = ShmGroup::Create(key, r == 1 ? "not-the-secret" : kSecret, r, 2, TestOptions(5), &g[r]);
  });
  EXPECT_LT(SecondsSince(t0), 2.0);  // refused at once, not at the timeout
  EXPECT_EQ(st[0].code(), StatusCode::kAborted);
  EXPECT_NE(st[0].message().find("authentication"), std::string::npos) << st[0].message();
  EXPECT_EQ(st[1].code(), StatusCode::kAborted);
  EXPECT_NE(st[1].message().find("secret"), std::string::npos) << st[1].message();
  EXPECT_EQ(g[0], nullptr);
  EXPECT_EQ(g[1], nullptr);
}

TEST(Shm, DifferentOptionsAreAMismatch) {
  Watchdog wd(30, "Shm.DifferentOptionsAreAMismatch");
  const std::string key = UniqueKey("options");
  Groups g(2);
  std::vector<Status> st(2);
  auto t0 = Clock::now();
  RunRanks(2, [&](int r) {
    ShmOptions o = TestOptions(10);
    if (r == 1) o.slot_bytes = 2 * kSlot;
    st[r] = ShmGroup::Create(key, kSecret, r, 2, o, &g[r]);
  });
  EXPECT_LT(SecondsSince(t0), 2.0);  // rank 1 tells rank 0 at once
  EXPECT_EQ(st[1].code(), StatusCode::kMismatch) << st[1].message();
  EXPECT_EQ(st[0].code(), StatusCode::kAborted) << st[0].message();
  EXPECT_NE(st[0].message().find("aborted by local rank 1"), std::string::npos) << st[0].message();
}

TEST(Shm, MismatchedCallsFailEverywhereAndGroupStaysUsable) {
  const int n = 3;
  Watchdog wd(30, "Shm.MismatchedCallsFailEverywhereAndGroupStaysUsable");
  auto g = MakeGroups(n, UniqueKey("mismatch"));
  std::vector<Status> st(n), after(n);
  RunRanks(n, [&](int r) {
    std::vector<float> x(100 + r, 1.0f);
    st[r] = g[r]->Allreduce(x.data(), 100 + (r == 2), DataType::kFloat32, ReduceOp::kSum);
    after[r] = g[r]->Allreduce(x.data(), 100, DataType::kFloat32, ReduceOp::kSum);
    if (after[r].ok() && x[99] != 3.0f) after[r] = Status::Aborted("wrong result after mismatch");
  });
  for (int r = 0; r < n; ++r) {
    EXPECT_EQ(st[r].code(), StatusCode::kMismatch) << st[r].message();
    EXPECT_NE(st[r].message().find("local rank 2: Allreduce(float32, Sum, 101"), std::string::npos)
        << st[r].message();
    HVD_EXPECT_OK(after[r]);
  }
}

TEST(Shm, ExchangeOfDifferentKindsIsAMismatch) {
  const int n = 3;
  Watchdog wd(30, "Shm.ExchangeOfDifferentKindsIsAMismatch");
  auto g = MakeGroups(n, UniqueKey("exchange-mismatch"));
  std::vector<Status> st(n), after(n);
  RunRanks(n, [&](int r) {
    std::string mine = "rank " + std::to_string(r);
    std::vector<std::string> all;
    st[r] = g[r]->Exchange(r == 1 ? 2 : 1, &mine, &all);
    after[r] = g[r]->Exchange(3, &mine, &all);
    if (after[r].ok() && all[2] != "rank 2") after[r] = Status::Aborted("wrong message after");
  });
  for (int r = 0; r < n; ++r) {
    EXPECT_EQ(st[r].code(), StatusCode::kMismatch) << st[r].message();
    EXPECT_NE(st[r].message().find("local rank 1: Exchange(control message kind 2)"),
              std::string::npos)
        << st[r].message();
    HVD_EXPECT_OK(after[r]);
  }
}

// Rank 1 completes the exchange's barrier last and aborts the group at once (as a
// rank does that reads a fatal error in the message): rank 0, still waking up,
// keeps the message its completed barrier delivered; its next call fails.
TEST(Shm, CompletedExchangeSurvivesAnAbortRightAfter) {
  Watchdog wd(30, "Shm.CompletedExchangeSurvivesAnAbortRightAfter");
  ShmOptions opt = TestOptions();
  opt.spin_us = 0;  // rank 0 sleeps in the kernel: its wake-up comes after the abort
  for (int round = 0; round < 5; ++round) {
    auto g = MakeGroups(2, UniqueKey("abort-after"), opt);
    std::vector<Status> st(2), next(2);
    std::vector<std::vector<std::string>> got(2);
    RunRanks(2, [&](int r) {
      const std::string mine = "from " + std::to_string(r);
      if (r == 1) std::this_thread::sleep_for(std::chrono::milliseconds(30));
      st[r] = g[r]->Exchange(7, &mine, &got[r]);
      if (r == 1) g[r]->Abort();
      if (r == 0) std::this_thread::sleep_for(std::chrono::milliseconds(30));
      next[r] = g[r]->Exchange(8, &mine, &got[r]);
    });
    HVD_EXPECT_OK(st[0]);
    EXPECT_EQ(got[0].size(), 2u);
    if (got[0].size() == 2) {
      EXPECT_EQ(got[0][1], "from 1");
    }
    EXPECT_EQ(next[0].code(), StatusCode::kAborted) << next[0].message();
  }
}

// Ranks 0..n-2 block in a barrier that rank n-1 never enters; `fail` ends it.
void ExpectBlockedRanksFail(int n, const std::function<void(Groups&)>& fail,
                            const std::string& expect, double limit_s, double timeout_s = 30) {
  auto g = MakeGroups(n, UniqueKey("blocked"), TestOptions(timeout_s));
  std::vector<Status> st(n - 1);
  std::vector<double> secs(n - 1);
  std::thread killer([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    fail(g);
  });
  RunRanks(n - 1, [&](int r) {
    auto t0 = Clock::now();
    std::vector<float> x(10000, 1.0f);
    st[r] = g[r]->Allreduce(x.data(), x.size(), DataType::kFloat32, ReduceOp::kSum);
    secs[r] = SecondsSince(t0);
  });
  killer.join();
  for (int r = 0; r < n - 1; ++r) {
    EXPECT_EQ(st[r].code(), StatusCode::kAborted) << "rank " << r << ": " << st[r].message();
    EXPECT_NE(st[r].message().find(expect), std::string::npos) << st[r].message();
    EXPECT_LT(secs[r], limit_s) << "rank " << r;
    // Sticky: later calls fail at once too.
    EXPECT_EQ(g[r]->Barrier().code(), StatusCode::kAborted);
  }
}

TEST(Shm, AbortFromAnotherThreadWakesEveryRank) {
  Watchdog wd(30, "Shm.AbortFromAnotherThreadWakesEveryRank");
  ExpectBlockedRanksFail(
      4, [](auto& g) { g[3]->Abort(); }, "Abort() was called on local rank 3", 2.0);
}

TEST(Shm, RankThatLeavesIsNoticedAtOnce) {
  Watchdog wd(30, "Shm.RankThatLeavesIsNoticedAtOnce");
  ExpectBlockedRanksFail(
      4, [](auto& g) { g[3].reset(); }, "local rank 3 left the shared-memory group", 2.0);
}

TEST(Shm, AbsentRankTimesOut) {
  Watchdog wd(30, "Shm.AbsentRankTimesOut");
  ExpectBlockedRanksFail(
      3, [](auto&) {}, "waiting for local ranks [2]", 3.0, /*timeout_s=*/0.7);
}

// Whether /proc/net/unix lists the group's rendezvous socket.
bool RendezvousListed(const std::string& key) {
  std::ifstream unix_sockets("/proc/net/unix");
  std::stringstream all;
  all << unix_sockets.rdbuf();
  return all.str().find(ShmGroup::RendezvousName(key)) != std::string::npos;
}

// Nothing of a group outlives it: no mapping, descriptor or socket name.
TEST(Shm, NothingLeftBehindInProcess) {
  Watchdog wd(30, "Shm.NothingLeftBehindInProcess");
  auto count_fds = [] {
    int n = 0;
    DIR* d = ::opendir("/proc/self/fd");
    while (d != nullptr && ::readdir(d) != nullptr) ++n;
    if (d != nullptr) ::closedir(d);
    return n;
  };
  auto mapped = [] {
    std::ifstream maps("/proc/self/maps");
    std::string line;
    int n = 0;
    while (std::getline(maps, line)) n += line.find("horovod_torch-shm") != std::string::npos;
    return n;
  };
  const int fds = count_fds();
  const std::string key = UniqueKey("leftovers");
  {
    auto g = MakeGroups(3, key);
    EXPECT_EQ(mapped(), 3);
  }
  EXPECT_EQ(mapped(), 0);
  EXPECT_EQ(count_fds(), fds);
  EXPECT_FALSE(RendezvousListed(key));
}

// ---------------------------------------------------------------------------
// Real processes.

struct Child {
  pid_t pid = -1;
  int fd = -1;  // read end of the child's report pipe
  std::string out;
  double exit_s = 0;  // seconds from Collect's start to the end of its report
};

// Forks n children; child r runs fn(r, report_fd) and exits. The child writes
// its report on report_fd.
std::vector<Child> Spawn(int n, const std::function<void(int, int)>& fn) {
  std::vector<Child> kids(n);
  for (int r = 0; r < n; ++r) {
    int p[2];
    EXPECT_EQ(::pipe(p), 0);
    pid_t pid = ::fork();
    if (pid == 0) {
      ::close(p[0]);
      for (int q = 0; q < r; ++q) ::close(kids[q].fd);
      ::alarm(30);  // a hung child must not outlive the test run
      fn(r, p[1]);
      ::_exit(0);
    }
    ::close(p[1]);
    kids[r].pid = pid;
    kids[r].fd = p[0];
  }
  return kids;
}

void Report(int fd, const std::string& s) {
  size_t done = 0;
  while (done < s.size()) {
    ssize_t k = ::write(fd, s.data() + done, s.size() - done);
    if (k <= 0) return;
    done += static_cast<size_t>(k);
  }
}

// Reads the children's output until each closes its pipe (or has written
// `until` bytes, when until > 0), at most timeout_s in all; kills stragglers.
// Children listed in `skip` are left alone.
void Collect(std::vector<Child>& kids, double timeout_s, size_t until = 0,
             const std::set<int>& skip = {}) {
  auto t0 = Clock::now();
  std::set<int> open;
  for (int i = 0; i < static_cast<int>(kids.size()); ++i) {
    if (skip.count(i) == 0) open.insert(i);
  }
  while (!open.empty() && SecondsSince(t0) < timeout_s) {
    std::vector<pollfd> p;
    for (int i : open) p.push_back({kids[i].fd, POLLIN, 0});
    ::poll(p.data(), p.size(), 50);
    for (const pollfd& q : p) {
      if (q.revents == 0) continue;
      int i = 0;
      while (kids[i].fd != q.fd) ++i;
      Child& k = kids[i];
      char buf[4096];
      size_t want = until > 0 ? until - k.out.size() : sizeof(buf);
      ssize_t got = ::read(k.fd, buf, std::min(sizeof(buf), want));
      if (got > 0) k.out.append(buf, static_cast<size_t>(got));
      if (got <= 0 || (until > 0 && k.out.size() >= until)) {
        open.erase(i);
        k.exit_s = SecondsSince(t0);
      }
    }
  }
  for (int i : open) {
    ADD_FAILURE() << "child " << i << " (pid " << kids[i].pid << ") did not report in time";
    ::kill(kids[i].pid, SIGKILL);
  }
}

void Reap(std::vector<Child>& kids) {
  for (Child& k : kids) {
    if (k.fd >= 0) ::close(k.fd);
    if (k.pid > 0) ::waitpid(k.pid, nullptr, 0);
    k.fd = -1;
    k.pid = -1;
  }
}

std::set<std::string> DevShm() {
  std::set<std::string> names;
  DIR* d = ::opendir("/dev/shm");
  if (d == nullptr) return names;
  while (dirent* e = ::readdir(d)) names.insert(e->d_name);
  ::closedir(d);
  return names;
}

TEST(ShmProcesses, AllreduceIsIdenticalAcrossProcesses) {
  const int n = 5;
  Watchdog wd(40, "ShmProcesses.AllreduceIsIdenticalAcrossProcesses");
  const std::string key = UniqueKey("processes");
  auto kids = Spawn(n, [&](int r, int fd) {
    std::unique_ptr<ShmGroup> g;
    Status st = ShmGroup::Create(key, kSecret, r, n, TestOptions(), &g);
    if (!st.ok()) return Report(fd, "create: " + st.message());
    uint64_t hash = 0;
    std::string err = CheckAllreduces(g.get(), &hash);
    Report(fd, err.empty() ? "ok " + std::to_string(hash) : err);
  });
  Collect(kids, 30);
  for (int r = 0; r < n; ++r) {
    EXPECT_EQ(kids[r].out.substr(0, 3), "ok ") << "rank " << r << ": " << kids[r].out;
    EXPECT_EQ(kids[r].out, kids[0].out) << "rank " << r;
  }
  Reap(kids);
}

// SIGKILL one local rank while all are in collectives: the others fail within a
// few seconds (not the 30 s timeout) with a message naming the dead rank, and
// nothing of the group is left on the host. The parent does not reap the killed
// child before the others have reported, so they must see through a zombie.
TEST(ShmProcesses, KilledRankFailsTheOthersFastAndLeavesNothing) {
  const int n = 4, victim = 2;
  Watchdog wd(40, "ShmProcesses.KilledRankFailsTheOthersFastAndLeavesNothing");
  const std::set<std::string> before = DevShm();
  const std::string key = UniqueKey("crash");
  auto kids = Spawn(n, [&](int r, int fd) {
    std::unique_ptr<ShmGroup> g;
    ShmOptions opt;
    opt.timeout_s = 30;
    Status st = ShmGroup::Create(key, kSecret, r, n, opt, &g);
    if (!st.ok()) return Report(fd, "Rcreate: " + st.message());
    std::vector<float> x(1 << 18, 1.0f);
    auto t0 = Clock::now();
    for (int it = 0; st.ok() && SecondsSince(t0) < 20; ++it) {
      st = g->Allreduce(x.data(), x.size(), DataType::kFloat32, ReduceOp::kMin);
      if (it == 0) Report(fd, "R");  // in the loop: the parent may now kill
    }
    Report(fd, std::to_string(static_cast<int>(st.code())) + "|" + st.message());
  });
  Collect(kids, 20, /*until=*/1);
  for (int r = 0; r < n; ++r) ASSERT_EQ(kids[r].out, "R") << "rank " << r;
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  ASSERT_EQ(::kill(kids[victim].pid, SIGKILL), 0);
  Collect(kids, 15, 0, {victim});
  const std::string dead = "local rank 2 (pid " + std::to_string(kids[victim].pid) + ") died";
  for (int r = 0; r < n; ++r) {
    if (r == victim) continue;
    const std::string& out = kids[r].out;
    EXPECT_EQ(out.substr(0, 3), "R3|") << "rank " << r << " (3 = kAborted): " << out;
    EXPECT_NE(out.find(dead), std::string::npos) << "rank " << r << ": " << out;
    EXPECT_LT(kids[r].exit_s, 3.0) << "rank " << r << ": " << out;
  }
  Reap(kids);
  EXPECT_EQ(DevShm(), before);
  EXPECT_FALSE(RendezvousListed(key));
}

}  // namespace
}  // namespace hvd
