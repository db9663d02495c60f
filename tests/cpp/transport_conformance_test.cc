// The transport conformance suite: every collective of the Communicator interface
// (transport/transport.h) with 1..11 ranks as threads, compared against a scalar
// reference, results bitwise identical on all ranks, run over every communicator
// the tests can build in one process: the flat TCP mesh, the mesh with shared
// memory among the ranks of one host, and with shared memory on two "hosts" (ranks
// given host keys). MPI's communicator runs the same operations through the Python
// tests (tests/test_mpi.py: the collectives under mpirun). After the suite, tests
// of the TCP mesh's own options and set-up.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <numeric>
#include <random>
#include <sstream>
#include <string>
#include <tuple>

#include "common/types.h"
#include "test_util.h"
#include "transport/tcp_transport.h"

namespace hvd {
namespace {

using hvd_test::MakeWorld;
using hvd_test::RunRanks;
using hvd_test::Watchdog;
using hvd_test::World;

// ---------------------------------------------------------------------------
// Element access through double (exact for every value the tests generate).

double Load(DataType dt, const void* p, size_t i) {
  switch (dt) {
    case DataType::kUInt8:
      return static_cast<const uint8_t*>(p)[i];
    case DataType::kInt8:
      return static_cast<const int8_t*>(p)[i];
    case DataType::kInt16:
      return static_cast<const int16_t*>(p)[i];
    case DataType::kInt32:
      return static_cast<const int32_t*>(p)[i];
    case DataType::kInt64:
      return static_cast<double>(static_cast<const int64_t*>(p)[i]);
    case DataType::kFloat16:
      return HalfToFloat(static_cast<const uint16_t*>(p)[i]);
    case DataType::kBFloat16:
      return BFloat16ToFloat(static_cast<const uint16_t*>(p)[i]);
    case DataType::kFloat32:
      return static_cast<const float*>(p)[i];
    case DataType::kFloat64:
      return static_cast<const double*>(p)[i];
    case DataType::kBool:
      return static_cast<const uint8_t*>(p)[i] ? 1 : 0;
  }
  return 0;
}

// Integer sums over more than 4 ranks may leave the type's range: they wrap, as the
// engine's integer arithmetic does. Through int64 (exact here), since converting an
// out-of-range double straight to a narrow type is undefined (UBSan:
// float-cast-overflow).
void Store(DataType dt, void* p, size_t i, double v) {
  auto w = [v] { return static_cast<int64_t>(v); };
  switch (dt) {
    case DataType::kUInt8:
      static_cast<uint8_t*>(p)[i] = static_cast<uint8_t>(w());
      break;
    case DataType::kInt8:
      static_cast<int8_t*>(p)[i] = static_cast<int8_t>(w());
      break;
    case DataType::kInt16:
      static_cast<int16_t*>(p)[i] = static_cast<int16_t>(w());
      break;
    case DataType::kInt32:
      static_cast<int32_t*>(p)[i] = static_cast<int32_t>(w());
      break;
    case DataType::kInt64:
      static_cast<int64_t*>(p)[i] = static_cast<int64_t>(v);
      break;
    case DataType::kFloat16:
      static_cast<uint16_t*>(p)[i] = FloatToHalf(static_cast<float>(v));
      break;
    case DataType::kBFloat16:
      static_cast<uint16_t*>(p)[i] = FloatToBFloat16(static_cast<float>(v));
      break;
    case DataType::kFloat32:
      static_cast<float*>(p)[i] = static_cast<float>(v);
      break;
    case DataType::kFloat64:
      static_cast<double*>(p)[i] = v;
      break;
    case DataType::kBool:
      static_cast<uint8_t*>(p)[i] = v != 0;
      break;
  }
}

uint64_t Mix(uint64_t a, uint64_t b, uint64_t c) {
  uint64_t h = a * 0x9E3779B97F4A7C15ull ^ (b + 0x632BE59BD9B4E019ull) * 0xC2B2AE3D27D4EB4Full;
  h ^= (c + 0x165667B19E3779F9ull) * 0x27D4EB2F165667C5ull;
  h ^= h >> 29;
  h *= 0xBF58476D1CE4E5B9ull;
  h ^= h >> 32;
  return h;
}

// Input values chosen so that every reduction of up to 4 ranks is exact in the
// type, whatever the order: the reference can then be compared bit for bit.
double Gen(DataType dt, ReduceOp op, int rank, size_t i, uint64_t seed) {
  uint64_t h = Mix(seed, static_cast<uint64_t>(rank), i);
  auto range = [&](int64_t lo, int64_t hi) {
    return static_cast<double>(lo + static_cast<int64_t>(h % static_cast<uint64_t>(hi - lo + 1)));
  };
  if (dt == DataType::kBool) return static_cast<double>((h >> 7) % 4 != 0);
  if (op == ReduceOp::kSum) {
    switch (dt) {
      case DataType::kUInt8:
        return range(0, 60);
      case DataType::kInt8:
        return range(-30, 30);
      case DataType::kFloat16:
      case DataType::kBFloat16:
        return range(-30, 30);
      default:
        return range(-1000, 1000);
    }
  }
  if (op == ReduceOp::kProduct) {
    static const double kSigned[] = {-2, -1, 1, 2};
    static const double kHalf[] = {-2, -1, -0.5, 0.5, 1, 2};
    static const double kUnsigned[] = {1, 2, 3};
    if (dt == DataType::kUInt8) return kUnsigned[h % 3];
    const bool floating = dt == DataType::kFloat16 || dt == DataType::kBFloat16 ||
                          dt == DataType::kFloat32 || dt == DataType::kFloat64;
    if (floating) return kHalf[h % 6];
    return kSigned[h % 4];
  }
  // Min / Max: wide values, any order gives the same answer (no -0: min(-0, +0)
  // depends on the operand order, which differs between ring segments).
  double v = 0;
  switch (dt) {
    case DataType::kUInt8:
      v = range(0, 255);
      break;
    case DataType::kInt8:
      v = range(-128, 127);
      break;
    case DataType::kInt16:
      v = range(-32768, 32767);
      break;
    case DataType::kInt32:
      v = range(-1000000000, 1000000000);
      break;
    case DataType::kInt64:
      v = range(-(1LL << 50), 1LL << 50);
      break;
    case DataType::kFloat16: {
      uint16_t b = static_cast<uint16_t>(h);
      if ((b & 0x7c00) == 0x7c00) b &= 0xbfff;  // no inf/nan
      v = HalfToFloat(b);
      break;
    }
    case DataType::kBFloat16: {
      uint16_t b = static_cast<uint16_t>(h);
      if ((b & 0x7f80) == 0x7f80) b &= 0xbfff;
      v = BFloat16ToFloat(b);
      break;
    }
    case DataType::kFloat32:
      v = range(-100000, 100000) / 8.0;
      break;
    default:
      v = range(-(1LL << 40), 1LL << 40) / 1024.0;
      break;
  }
  return v == 0 ? 0.0 : v;
}

double Combine(DataType dt, ReduceOp op, double a, double b) {
  if (dt == DataType::kBool) {
    bool is_or = op == ReduceOp::kSum || op == ReduceOp::kMax;
    return is_or ? (a != 0 || b != 0) : (a != 0 && b != 0);
  }
  switch (op) {
    case ReduceOp::kSum:
      return a + b;
    case ReduceOp::kProduct:
      return a * b;
    case ReduceOp::kMin:
      return b < a ? b : a;
    case ReduceOp::kMax:
      return a < b ? b : a;
    default:
      return 0;
  }
}

std::vector<char> MakeInput(DataType dt, ReduceOp op, int rank, size_t count, uint64_t seed) {
  std::vector<char> v(count * DataTypeSize(dt) + 1);  // +1: never a null data()
  for (size_t i = 0; i < count; ++i) Store(dt, v.data(), i, Gen(dt, op, rank, i, seed));
  return v;
}

// Reference reduction over ranks of elements [begin, begin+count).
std::vector<char> Reference(DataType dt, ReduceOp op, int size, size_t begin, size_t count,
                            uint64_t seed) {
  std::vector<char> v(count * DataTypeSize(dt) + 1);
  for (size_t i = 0; i < count; ++i) {
    double acc = Gen(dt, op, 0, begin + i, seed);
    for (int r = 1; r < size; ++r) acc = Combine(dt, op, acc, Gen(dt, op, r, begin + i, seed));
    Store(dt, v.data(), i, acc);
  }
  return v;
}

// First differing element, formatted; "" if equal.
std::string Diff(DataType dt, const char* got, const char* want, size_t count) {
  size_t es = DataTypeSize(dt);
  for (size_t i = 0; i < count; ++i) {
    if (std::memcmp(got + i * es, want + i * es, es) != 0) {
      std::ostringstream os;
      os << "element " << i << " of " << count << ": got " << Load(dt, got, i) << " want "
         << Load(dt, want, i);
      return os.str();
    }
  }
  return "";
}

uint64_t Fnv(const void* p, size_t n) {
  uint64_t h = 1469598103934665603ull;
  for (size_t i = 0; i < n; ++i)
    h = (h ^ static_cast<const unsigned char*>(p)[i]) * 1099511628211ull;
  return h;
}

const DataType kAllTypes[] = {DataType::kUInt8,    DataType::kInt8,    DataType::kInt16,
                              DataType::kInt32,    DataType::kInt64,   DataType::kFloat16,
                              DataType::kBFloat16, DataType::kFloat32, DataType::kFloat64,
                              DataType::kBool};
const ReduceOp kOps[] = {ReduceOp::kSum, ReduceOp::kMin, ReduceOp::kMax, ReduceOp::kProduct};

struct Case {
  DataType dtype;
  ReduceOp op;
  size_t count;
  std::string Name() const {
    return std::string(DataTypeName(dtype)) + "/" + ReduceOpName(op) + "/" + std::to_string(count);
  }
};

// Every rank runs `cases` in order on its transport; each checks its result
// against the reference; all ranks' results must hash identically.
void RunAllreduceCases(World& w, const std::vector<Case>& cases, uint64_t seed) {
  const int n = w.size();
  std::vector<std::vector<std::string>> errors(n);
  std::vector<std::vector<uint64_t>> hashes(n, std::vector<uint64_t>(cases.size()));
  std::vector<std::vector<char>> want(cases.size());  // computed once, shared by all ranks
  for (size_t c = 0; c < cases.size(); ++c) {
    want[c] = Reference(cases[c].dtype, cases[c].op, n, 0, cases[c].count, seed + c);
  }
  RunRanks(n, [&](int r) {
    for (size_t c = 0; c < cases.size(); ++c) {
      const Case& k = cases[c];
      std::vector<char> buf = MakeInput(k.dtype, k.op, r, k.count, seed + c);
      Status st = w.transports[r]->Allreduce(buf.data(), k.count, k.dtype, k.op);
      if (!st.ok()) {
        errors[r].push_back(k.Name() + ": " + st.message());
        return;  // the transport is unusable after an error
      }
      std::string d = Diff(k.dtype, buf.data(), want[c].data(), k.count);
      if (!d.empty()) errors[r].push_back(k.Name() + " rank " + std::to_string(r) + ": " + d);
      hashes[r][c] = Fnv(buf.data(), k.count * DataTypeSize(k.dtype));
    }
  });
  for (int r = 0; r < n; ++r) {
    for (size_t i = 0; i < errors[r].size() && i < 10; ++i) ADD_FAILURE() << errors[r][i];
  }
  for (int r = 1; r < n; ++r) {
    for (size_t c = 0; c < cases.size(); ++c) {
      EXPECT_EQ(hashes[r][c], hashes[0][c])
          << cases[c].Name() << ": rank " << r << " differs from rank 0";
    }
  }
}

// One way to build the world's communicators: the options of rank r of n.
struct Variant {
  const char* name;
  TcpOptions (*options)(int r, int n);
};

TcpOptions FlatTcp(int, int) {
  TcpOptions o = hvd_test::FastOptions();
  o.hierarchical_allreduce = o.hierarchical_allgather = 0;
  return o;
}

TcpOptions SharedMemoryOneHost(int, int) {
  TcpOptions o = hvd_test::FastOptions();
  o.hierarchical_allreduce = o.hierarchical_allgather = 1;  // every size through the segment
  o.host_key = "host0";
  return o;
}

TcpOptions SharedMemoryTwoHosts(int r, int) {
  TcpOptions o = SharedMemoryOneHost(r, 0);
  o.host_key = "host" + std::to_string(r % 2);  // interleaved: local ranks are not contiguous
  return o;
}

const Variant kVariants[] = {{"tcp", FlatTcp},
                             {"shm_one_host", SharedMemoryOneHost},
                             {"shm_two_hosts", SharedMemoryTwoHosts}};

class TransportConformance : public ::testing::TestWithParam<std::tuple<Variant, int>> {
 protected:
  void SetUp() override {
    const Variant v = std::get<0>(GetParam());
    const int n = ranks();
    Status st = MakeWorld(
        n, [&](int r) { return v.options(r, n); }, &world_);
    ASSERT_TRUE(st.ok()) << st.message();
  }
  int ranks() const { return std::get<1>(GetParam()); }
  World world_;
};

// Every dtype and op: fewer elements than ranks, odd counts, and both sides of
// the 64 KB direct/ring switch (small_allreduce_bytes) for each element size.
TEST_P(TransportConformance, AllreduceEveryTypeAndOp) {
  Watchdog wd(60, "AllreduceEveryTypeAndOp");
  const int n = ranks();
  const size_t kSmall = hvd_test::FastOptions().small_allreduce_bytes;
  std::vector<Case> cases;
  for (DataType dt : kAllTypes) {
    const size_t at_switch = kSmall / DataTypeSize(dt);  // largest direct count
    for (ReduceOp op : kOps) {
      for (size_t count :
           {size_t{1}, size_t(std::max(1, n - 1)), size_t{7}, size_t{1000}, at_switch + 1}) {
        cases.push_back({dt, op, count});
      }
    }
    cases.push_back({dt, ReduceOp::kSum, at_switch});
  }
  RunAllreduceCases(world_, cases, 1000);
}

// Large buffers on the ring: > 64 KB, counts not divisible by the number of
// ranks, and (1 MB) segments longer than one 256 KB ring chunk even on 4 ranks.
TEST_P(TransportConformance, AllreduceLarge) {
  Watchdog wd(60, "AllreduceLarge");
  const size_t kChunk = hvd_test::FastOptions().ring_chunk_bytes;
  std::vector<Case> cases;
  for (DataType dt : {DataType::kFloat32, DataType::kInt32, DataType::kFloat16}) {
    for (ReduceOp op : kOps) cases.push_back({dt, op, 100003});
  }
  cases.push_back({DataType::kFloat32, ReduceOp::kSum, 4 * kChunk / 4 + 7});
  cases.push_back({DataType::kInt32, ReduceOp::kMax, 4 * kChunk / 4 + 7});
  cases.push_back({DataType::kFloat16, ReduceOp::kSum, 4 * kChunk / 2 + 7});
  RunAllreduceCases(world_, cases, 2000);
}

// The small-buffer allreduce's exact result: a fold in rank order (direct, up to 4
// ranks) or recursive doubling (extra ranks folded into rank - p2 first, then
// op(lower, higher) at every round).
template <typename Input>
std::vector<char> SmallPathReference(int n, size_t count, DataType dt, Input input) {
  std::vector<std::vector<char>> v(n);
  for (int r = 0; r < n; ++r) v[r] = input(r, count, dt);
  auto op = [&](std::vector<char> a, const std::vector<char>& b) {
    ReduceInto(a.data(), b.data(), count, dt, ReduceOp::kSum);
    return a;
  };
  if (n <= 4) {
    for (int p = 1; p < n; ++p) v[0] = op(v[0], v[p]);
    return v[0];
  }
  int p2 = 1;
  while (p2 * 2 <= n) p2 *= 2;
  for (int r = 0; r < n - p2; ++r) v[r] = op(v[r], v[r + p2]);
  for (int mask = 1; mask < p2; mask <<= 1) {
    std::vector<std::vector<char>> next(p2);
    for (int r = 0; r < p2; ++r) next[r] = op(v[std::min(r, r ^ mask)], v[std::max(r, r ^ mask)]);
    for (int r = 0; r < p2; ++r) v[r] = next[r];
  }
  return v[0];
}

// Arbitrary floats: results depend on the reduction order, so what every transport
// must give is cross-rank identity. The flat TCP mesh's direct path (small buffers)
// reduces in a known order, checked against a reference; shared memory reduces in
// its own order.
TEST_P(TransportConformance, AllreduceRandomFloatsBitwiseIdentical) {
  Watchdog wd(60, "AllreduceRandomFloatsBitwiseIdentical");
  const int n = ranks();
  const bool known_order = std::get<0>(GetParam()).options == FlatTcp;
  std::vector<size_t> counts = {5, 3000, 70001};
  std::vector<std::vector<uint64_t>> hashes(n);
  std::vector<std::string> errors(n);
  auto input = [](int r, size_t count, DataType dt) {
    std::mt19937 rng(17 + r);
    std::uniform_real_distribution<float> dist(-1, 1);
    std::vector<char> v(count * DataTypeSize(dt) + 1);
    for (size_t i = 0; i < count; ++i) {
      float f = dist(rng) * std::ldexp(1.0f, static_cast<int>(rng() % 20) - 10);
      Store(dt, v.data(), i, f);
    }
    return v;
  };
  RunRanks(n, [&](int r) {
    for (DataType dt : {DataType::kFloat32, DataType::kFloat16, DataType::kBFloat16}) {
      for (size_t count : counts) {
        std::vector<char> buf = input(r, count, dt);
        Status st = world_.transports[r]->Allreduce(buf.data(), count, dt, ReduceOp::kSum);
        if (!st.ok()) {
          errors[r] = st.message();
          return;
        }
        hashes[r].push_back(Fnv(buf.data(), count * DataTypeSize(dt)));
        if (known_order && count * DataTypeSize(dt) <= 64 * 1024) {  // small: a known order
          std::vector<char> want = SmallPathReference(n, count, dt, input);
          std::string d = Diff(dt, buf.data(), want.data(), count);
          if (!d.empty()) errors[r] += std::string(DataTypeName(dt)) + ": " + d + "; ";
        }
      }
    }
  });
  for (int r = 0; r < n; ++r) EXPECT_EQ(errors[r], "") << "rank " << r;
  for (int r = 1; r < n; ++r) EXPECT_EQ(hashes[r], hashes[0]) << "rank " << r;
}

TEST_P(TransportConformance, AllreduceZeroCountIsANoOp) {
  const int n = ranks();
  std::vector<Status> st(n);
  RunRanks(n, [&](int r) {
    float x = 42;
    st[r] = world_.transports[r]->Allreduce(&x, 0, DataType::kFloat32, ReduceOp::kSum);
    if (st[r].ok() && x != 42) st[r] = Status::Aborted("buffer modified");
  });
  for (auto& s : st) HVD_EXPECT_OK(s);
}

std::vector<char> Block(int rank, size_t bytes, int salt) {
  std::vector<char> v(bytes + 1);
  for (size_t i = 0; i < bytes; ++i) v[i] = static_cast<char>(Mix(rank, i, salt) >> 11);
  return v;
}

TEST_P(TransportConformance, AllgathervUnequalSizes) {
  Watchdog wd(60, "AllgathervUnequalSizes");
  const int n = ranks();
  std::vector<std::vector<size_t>> patterns = {
      [&] {
        std::vector<size_t> b(n);
        for (int r = 0; r < n; ++r) b[r] = r == 1 ? 0 : 1000 * (r + 1) + r;
        return b;
      }(),
      std::vector<size_t>(n, 0),
      [&] {
        std::vector<size_t> b(n);
        const size_t s[] = {200003, 0, 70001, 5};
        for (int r = 0; r < n; ++r) b[r] = s[r % 4];
        return b;
      }(),
      [&] {
        std::vector<size_t> b(n, 0);
        b[n - 1] = 12345;
        return b;
      }(),
  };
  std::vector<std::string> errors(n);
  RunRanks(n, [&](int r) {
    for (size_t k = 0; k < patterns.size(); ++k) {
      const auto& bytes = patterns[k];
      size_t total = std::accumulate(bytes.begin(), bytes.end(), size_t{0});
      std::vector<char> send = Block(r, bytes[r], static_cast<int>(k));
      std::vector<char> recv(total + 1, '\x5a');
      Status st = world_.transports[r]->Allgatherv(send.data(), recv.data(), bytes);
      if (!st.ok()) {
        errors[r] = "pattern " + std::to_string(k) + ": " + st.message();
        return;
      }
      size_t off = 0;
      for (int p = 0; p < n; ++p) {
        std::vector<char> want = Block(p, bytes[p], static_cast<int>(k));
        if (std::memcmp(recv.data() + off, want.data(), bytes[p]) != 0) {
          errors[r] += "pattern " + std::to_string(k) + ": block from rank " + std::to_string(p) +
                       " wrong; ";
        }
        off += bytes[p];
      }
      if (recv[total] != '\x5a') errors[r] += "wrote past the end; ";
    }
  });
  for (int r = 0; r < n; ++r) EXPECT_EQ(errors[r], "") << "rank " << r;
}

TEST_P(TransportConformance, BroadcastFromEveryRoot) {
  Watchdog wd(60, "BroadcastFromEveryRoot");
  const int n = ranks();
  // 65536 = small_allreduce_bytes (direct); 65537 and 200003: scatter + ring allgather.
  const size_t sizes[] = {0, 1, 1000, 65536, 65537, 200003};
  std::vector<std::string> errors(n);
  RunRanks(n, [&](int r) {
    for (int root = 0; root < n; ++root) {
      for (size_t bytes : sizes) {
        std::vector<char> want = Block(root, bytes, 77);
        std::vector<char> buf = r == root ? want : std::vector<char>(bytes + 1, '\x33');
        Status st = world_.transports[r]->Broadcast(buf.data(), bytes, root);
        if (!st.ok()) {
          errors[r] = st.message();
          return;
        }
        if (std::memcmp(buf.data(), want.data(), bytes) != 0) {
          errors[r] += "root " + std::to_string(root) + " bytes " + std::to_string(bytes) + "; ";
        }
      }
    }
  });
  for (int r = 0; r < n; ++r) EXPECT_EQ(errors[r], "") << "rank " << r;
}

TEST_P(TransportConformance, AlltoallvUnevenSizes) {
  Watchdog wd(60, "AlltoallvUnevenSizes");
  const int n = ranks();
  // bytes rank s sends to rank d
  auto amount = [](int s, int d, size_t scale) -> size_t {
    return (((s * 3 + d * 5) % 4) * 1000 + (s + d) % 3) * scale;
  };
  std::vector<std::string> errors(n);
  RunRanks(n, [&](int r) {
    for (size_t scale : {size_t{1}, size_t{60}}) {
      std::vector<size_t> send_bytes(n), recv_bytes(n);
      for (int p = 0; p < n; ++p) {
        send_bytes[p] = amount(r, p, scale);
        recv_bytes[p] = amount(p, r, scale);
      }
      std::vector<char> send;
      for (int p = 0; p < n; ++p) {
        std::vector<char> b = Block(r * 16 + p, send_bytes[p], static_cast<int>(scale));
        send.insert(send.end(), b.begin(), b.begin() + send_bytes[p]);
      }
      size_t total = std::accumulate(recv_bytes.begin(), recv_bytes.end(), size_t{0});
      std::vector<char> recv(total + 1, '\x11');
      send.push_back(0);
      Status st = world_.transports[r]->Alltoallv(send.data(), send_bytes, recv.data(), recv_bytes);
      if (!st.ok()) {
        errors[r] = st.message();
        return;
      }
      size_t off = 0;
      for (int p = 0; p < n; ++p) {
        std::vector<char> want = Block(p * 16 + r, recv_bytes[p], static_cast<int>(scale));
        if (std::memcmp(recv.data() + off, want.data(), recv_bytes[p]) != 0) {
          errors[r] += "scale " + std::to_string(scale) + " from rank " + std::to_string(p) + "; ";
        }
        off += recv_bytes[p];
      }
      if (recv[total] != '\x11') errors[r] += "wrote past the end; ";
    }
  });
  for (int r = 0; r < n; ++r) EXPECT_EQ(errors[r], "") << "rank " << r;
}

void RunReducescatter(World& w, DataType dt, ReduceOp op, const std::vector<size_t>& counts,
                      uint64_t seed) {
  const int n = w.size();
  size_t total = std::accumulate(counts.begin(), counts.end(), size_t{0});
  std::vector<size_t> begin(n, 0);
  for (int r = 1; r < n; ++r) begin[r] = begin[r - 1] + counts[r - 1];
  std::vector<std::string> errors(n);
  std::vector<uint64_t> hashes(n);
  RunRanks(n, [&](int r) {
    std::vector<char> buf = MakeInput(dt, op, r, total, seed);
    std::vector<char> out(counts[r] * DataTypeSize(dt) + 1, '\x77');
    Status st = w.transports[r]->Reducescatter(buf.data(), counts, dt, op, out.data());
    if (!st.ok()) {
      errors[r] = st.message();
      return;
    }
    std::vector<char> want = Reference(dt, op, n, begin[r], counts[r], seed);
    errors[r] = Diff(dt, out.data(), want.data(), counts[r]);
    if (out[counts[r] * DataTypeSize(dt)] != '\x77') errors[r] += " wrote past the end";
  });
  for (int r = 0; r < n; ++r) {
    EXPECT_EQ(errors[r], "") << DataTypeName(dt) << " " << ReduceOpName(op) << " total " << total
                             << " rank " << r;
  }
}

TEST_P(TransportConformance, ReducescatterUnevenCounts) {
  Watchdog wd(60, "ReducescatterUnevenCounts");
  const int n = ranks();
  std::vector<size_t> small(n), large(n), one_owner(n, 0);
  for (int r = 0; r < n; ++r) {
    small[r] = r == 1 ? 0 : 10 + 3 * r;
    large[r] = r == 2 ? 0 : 40000 + 7 * r;  // > 64 KB in total: ring path
  }
  one_owner[0] = 30001;
  for (DataType dt : {DataType::kFloat32, DataType::kInt32, DataType::kFloat16, DataType::kFloat64,
                      DataType::kUInt8}) {
    for (ReduceOp op : kOps) {
      RunReducescatter(world_, dt, op, small, 10);
      RunReducescatter(world_, dt, op, large, 11);
    }
  }
  RunReducescatter(world_, DataType::kFloat32, ReduceOp::kSum, one_owner, 12);
  RunReducescatter(world_, DataType::kFloat32, ReduceOp::kSum, std::vector<size_t>(n, 0), 13);
}

TEST_P(TransportConformance, GatherAndBcastControlPlane) {
  Watchdog wd(30, "GatherAndBcastControlPlane");
  const int n = ranks();
  auto msg = [](int r, int round) {
    if (round == 1) return std::string();  // empty messages
    std::string s = "rank " + std::to_string(r) + " round " + std::to_string(round) + ":";
    s += std::string(round == 2 ? 200000 + r : 100 * r, static_cast<char>('a' + r));
    return s;
  };
  std::vector<std::string> errors(n);
  RunRanks(n, [&](int r) {
    for (int round = 0; round < 3; ++round) {
      std::vector<std::string> all = {"stale"};
      Status st = world_.transports[r]->Gather(msg(r, round), &all);
      if (!st.ok()) {
        errors[r] = st.message();
        return;
      }
      if (r == 0) {
        if (static_cast<int>(all.size()) != n) {
          errors[r] += "gathered " + std::to_string(all.size()) + " messages; ";
        } else {
          for (int p = 0; p < n; ++p) {
            if (all[p] != msg(p, round)) errors[r] += "message of rank " + std::to_string(p) + "; ";
          }
        }
      }
      std::string data =
          r == 0 ? "from the coordinator " + std::to_string(round) + std::string(round * 70000, 'q')
                 : "garbage that must be replaced";
      st = world_.transports[r]->Bcast(&data);
      if (!st.ok()) {
        errors[r] = st.message();
        return;
      }
      if (data !=
          "from the coordinator " + std::to_string(round) + std::string(round * 70000, 'q')) {
        errors[r] += "bcast round " + std::to_string(round) + "; ";
      }
    }
  });
  for (int r = 0; r < n; ++r) EXPECT_EQ(errors[r], "") << "rank " << r;
}

// AND and OR over ranks of bit vectors (the steady-state negotiation of many ranks).
TEST_P(TransportConformance, AllreduceBits) {
  Watchdog wd(30, "AllreduceBits");
  const int n = ranks();
  std::vector<std::string> errors(n);
  RunRanks(n, [&](int r) {
    for (size_t words : {size_t{1}, size_t{17}}) {
      std::vector<uint64_t> a(words), o(words + 1);
      for (size_t i = 0; i < words; ++i) a[i] = ~(1ull << ((r + i) % 64));  // all but bit r+i
      for (size_t i = 0; i <= words; ++i) o[i] = 1ull << ((r * 3 + i) % 64);
      Status st = world_.transports[r]->AllreduceBits(&a, &o);
      if (!st.ok()) {
        errors[r] = st.message();
        return;
      }
      for (size_t i = 0; i < words; ++i) {
        uint64_t want = ~0ull;
        for (int q = 0; q < n; ++q) want &= ~(1ull << ((q + i) % 64));
        if (a[i] != want) errors[r] += "and word " + std::to_string(i) + "; ";
      }
      for (size_t i = 0; i <= words; ++i) {
        uint64_t want = 0;
        for (int q = 0; q < n; ++q) want |= 1ull << ((q * 3 + i) % 64);
        if (o[i] != want) errors[r] += "or word " + std::to_string(i) + "; ";
      }
    }
  });
  for (int r = 0; r < n; ++r) EXPECT_EQ(errors[r], "") << "rank " << r;
}

// 5, 8 and 11 ranks take the recursive-doubling, Bruck and tree paths (with and
// without a power of two).
INSTANTIATE_TEST_SUITE_P(Transports, TransportConformance,
                         ::testing::Combine(::testing::ValuesIn(kVariants),
                                            ::testing::Values(1, 2, 3, 4, 5, 8, 11)),
                         [](const ::testing::TestParamInfo<std::tuple<Variant, int>>& i) {
                           return std::string(std::get<0>(i.param).name) + "_" +
                                  std::to_string(std::get<1>(i.param)) + "ranks";
                         });

// Tiny thresholds: ring paths with single-element chunks, segments of 0 or 1
// element, scatter-broadcast of a few bytes over more ranks than bytes.
class TcpEdgeOptions : public ::testing::TestWithParam<int> {};

TEST_P(TcpEdgeOptions, TinyThresholds) {
  Watchdog wd(60, "TinyThresholds");
  const int n = GetParam();
  hvd::TcpOptions opt = hvd_test::FastOptions();
  opt.small_allreduce_bytes = 0;
  opt.ring_chunk_bytes = 1;
  World w;
  Status st = MakeWorld(n, opt, &w);
  ASSERT_TRUE(st.ok()) << st.message();
  std::vector<Case> cases;
  for (size_t count = 1; count <= static_cast<size_t>(2 * n + 1); ++count) {
    cases.push_back({DataType::kFloat32, ReduceOp::kSum, count});
    cases.push_back({DataType::kInt64, ReduceOp::kMin, count});
    cases.push_back({DataType::kFloat16, ReduceOp::kProduct, count});
  }
  cases.push_back({DataType::kInt32, ReduceOp::kMax, 1001});
  RunAllreduceCases(w, cases, 5);

  std::vector<std::string> errors(n);
  RunRanks(n, [&](int r) {
    for (int root = 0; root < n; ++root) {
      for (size_t bytes = 1; bytes <= 9; ++bytes) {
        std::vector<char> want = Block(root, bytes, 3);
        std::vector<char> buf = r == root ? want : std::vector<char>(bytes + 1, 0);
        Status s = w.transports[r]->Broadcast(buf.data(), bytes, root);
        if (!s.ok()) {
          errors[r] = s.message();
          return;
        }
        if (std::memcmp(buf.data(), want.data(), bytes) != 0) {
          errors[r] +=
              "bcast root " + std::to_string(root) + " bytes " + std::to_string(bytes) + "; ";
        }
      }
    }
  });
  for (int r = 0; r < n; ++r) EXPECT_EQ(errors[r], "") << "rank " << r;
  std::vector<size_t> counts(n);
  for (int r = 0; r < n; ++r) counts[r] = r % 2;
  RunReducescatter(w, DataType::kFloat32, ReduceOp::kSum, counts, 6);
  for (int r = 0; r < n; ++r) counts[r] = 3 + r;
  RunReducescatter(w, DataType::kInt16, ReduceOp::kProduct, counts, 7);
}

// Moderate thresholds: many chunks per ring segment with small buffers.
TEST_P(TcpEdgeOptions, SmallChunks) {
  Watchdog wd(60, "SmallChunks");
  const int n = GetParam();
  hvd::TcpOptions opt = hvd_test::FastOptions();
  opt.small_allreduce_bytes = 1024;
  opt.ring_chunk_bytes = 4096;
  World w;
  Status st = MakeWorld(n, opt, &w);
  ASSERT_TRUE(st.ok()) << st.message();
  std::vector<Case> cases;
  for (DataType dt : {DataType::kFloat32, DataType::kFloat16, DataType::kInt32, DataType::kUInt8}) {
    for (ReduceOp op : kOps) {
      for (size_t count : {size_t{255}, size_t{300}, size_t{1001}, size_t{10007}}) {
        cases.push_back({dt, op, count});
      }
    }
  }
  RunAllreduceCases(w, cases, 9);
  std::vector<size_t> counts(n);
  for (int r = 0; r < n; ++r) counts[r] = 2000 + 999 * r;
  RunReducescatter(w, DataType::kFloat32, ReduceOp::kSum, counts, 8);
}

INSTANTIATE_TEST_SUITE_P(Ranks, TcpEdgeOptions, ::testing::Values(2, 3, 4, 6, 9),
                         [](const ::testing::TestParamInfo<int>& i) {
                           return std::to_string(i.param) + "ranks";
                         });

// IPv6: the store on ::1, the mesh listening where each rank reaches the store from
// (::1) and dialling the addresses the others published; shared memory off, so that
// the collectives' bytes cross the IPv6 sockets.
TEST(TcpTransport, MeshOverIpv6Loopback) {
  {
    Socket l;
    int port = 0;
    if (!Listen("::1", 0, &l, &port).ok()) GTEST_SKIP() << "no IPv6 loopback here";
  }
  hvd_test::Watchdog wd(60, "TcpTransport.MeshOverIpv6Loopback");
  TcpOptions o;
  o.shm_control = 0;
  o.hierarchical_allreduce = 0;
  o.hierarchical_allgather = 0;
  hvd_test::World w;
  HVD_ASSERT_OK(hvd_test::MakeWorld(
      3, [&o](int) { return o; }, &w, "v6", "::1"));
  std::string addr;
  bool found = false;
  HVD_ASSERT_OK(w.clients[0]->Fetch("v6/addr/1", 5.0, &addr, &found));
  ASSERT_TRUE(found);
  EXPECT_EQ(addr.rfind("::1:", 0), 0u) << addr;
  std::vector<Status> st(3);
  std::vector<std::vector<float>> x(3);
  hvd_test::RunRanks(3, [&](int r) {
    x[r].assign(100000, static_cast<float>(r + 1));  // ring path, not the small one
    st[r] =
        w.transports[r]->Allreduce(x[r].data(), x[r].size(), DataType::kFloat32, ReduceOp::kSum);
  });
  for (int r = 0; r < 3; ++r) {
    HVD_EXPECT_OK(st[r]);
    EXPECT_EQ(x[r].front(), 6.0f);
    EXPECT_EQ(x[r].back(), 6.0f);
  }
}

TEST(TcpTransport, SizeOneNeedsNoStore) {
  std::unique_ptr<TcpTransport> t;
  HVD_ASSERT_OK(TcpTransport::Create(nullptr, "p", 0, 1, "s", TcpOptions(), &t));
  ASSERT_TRUE(t);
  EXPECT_EQ(t->rank(), 0);
  EXPECT_EQ(t->size(), 1);
  float x[3] = {1, 2, 3};
  HVD_EXPECT_OK(t->Allreduce(x, 3, DataType::kFloat32, ReduceOp::kSum));
  EXPECT_EQ(x[2], 3);
  std::vector<std::string> all;
  HVD_EXPECT_OK(t->Gather("me", &all));
  EXPECT_EQ(all, std::vector<std::string>{"me"});
  std::string d = "keep";
  HVD_EXPECT_OK(t->Bcast(&d));
  EXPECT_EQ(d, "keep");
  float out[3] = {0, 0, 0};
  HVD_EXPECT_OK(t->Reducescatter(x, {3}, DataType::kFloat32, ReduceOp::kSum, out));
  EXPECT_EQ(out[1], 2);
  char s[4] = "abc", r[4] = {0};
  HVD_EXPECT_OK(t->Alltoallv(s, {3}, r, {3}));
  EXPECT_STREQ(r, "abc");
  char g[4] = {0};
  HVD_EXPECT_OK(t->Allgatherv(s, g, {3}));
  EXPECT_STREQ(g, "abc");
  t->Abort();  // nothing to abort, must not crash
}

// Connections are opened on first use and only between partners: after every
// collective but alltoall a rank of 32 holds O(log n) sockets, not 31.
TEST(TcpTransport, ConnectionsGrowWithLogRanks) {
  Watchdog wd(60, "ConnectionsGrowWithLogRanks");
  const int n = 32;
  World w;
  HVD_ASSERT_OK(MakeWorld(n, hvd_test::FastOptions(), &w));
  std::vector<int> after_init(n), after_all(n);
  RunRanks(n, [&](int r) {
    TcpTransport& t = *w.transports[r];
    after_init[r] = t.open_connections();
    std::vector<float> small(100, 1.0f), large(1 << 18, 1.0f);
    HVD_EXPECT_OK(t.Allreduce(small.data(), small.size(), DataType::kFloat32, ReduceOp::kSum));
    HVD_EXPECT_OK(t.Allreduce(large.data(), large.size(), DataType::kFloat32, ReduceOp::kSum));
    EXPECT_EQ(small[0], n);
    EXPECT_EQ(large[12345], n);
    std::vector<char> gathered(n * 1000);
    HVD_EXPECT_OK(t.Allgatherv(std::string(1000, 'a' + r % 26).data(), gathered.data(),
                               std::vector<size_t>(n, 1000)));
    EXPECT_EQ(gathered[31 * 1000 + 5], 'a' + 31 % 26);
    for (int root : {0, 7}) {
      std::vector<char> b(r == root ? 1 << 20 : 1 << 20, r == root ? 'x' : 'y');
      HVD_EXPECT_OK(t.Broadcast(b.data(), b.size(), root));
      EXPECT_EQ(b[b.size() - 1], 'x');
      HVD_EXPECT_OK(t.Broadcast(b.data(), 10, root));
    }
    std::vector<std::string> all;
    HVD_EXPECT_OK(t.Allgather(std::string(16, 'z'), &all));
    after_all[r] = t.open_connections();
  });
  // Tree links after init (<= 5 children + parent); then ring neighbours and the
  // partners at distance 2^k of recursive doubling, Bruck and the trees.
  for (int r = 0; r < n; ++r) {
    EXPECT_LE(after_init[r], 6) << "rank " << r;
    EXPECT_LE(after_all[r], 20) << "rank " << r;
  }
}

// Views of one mesh (process sets): disjoint and overlapping subsets run their
// collectives on shared sockets, interleaved with the whole mesh's, in the same
// order on every member; ranks are renumbered within a view; results are right.
TEST(TcpTransport, SubsetViewsShareTheMesh) {
  Watchdog wd(60, "SubsetViewsShareTheMesh");
  World w;
  HVD_ASSERT_OK(MakeWorld(4, hvd_test::FastOptions(), &w));
  const std::vector<std::vector<int>> sets = {{0, 2}, {1, 3}, {1, 2, 3}, {3}};
  RunRanks(4, [&](int r) {
    std::vector<std::unique_ptr<TcpTransport>> views;
    for (const auto& s : sets) views.push_back(w.transports[r]->SubsetView(s));
    for (size_t k = 0; k < sets.size(); ++k) {
      bool member = std::find(sets[k].begin(), sets[k].end(), r) != sets[k].end();
      ASSERT_EQ(views[k] != nullptr, member) << "set " << k;
      if (!member) continue;
      EXPECT_EQ(views[k]->size(), static_cast<int>(sets[k].size()));
      EXPECT_EQ(sets[k][views[k]->rank()], r);
      EXPECT_EQ(views[k]->global_rank(views[k]->rank()), r);
    }
    for (int round = 0; round < 3; ++round) {
      // The whole mesh first, then each set in order, as the runtime does.
      std::vector<float> all(1000, static_cast<float>(r + 1));
      HVD_EXPECT_OK(
          w.transports[r]->Allreduce(all.data(), all.size(), DataType::kFloat32, ReduceOp::kSum));
      EXPECT_EQ(all[999], 10.0f);
      for (size_t k = 0; k < sets.size(); ++k) {
        if (!views[k]) continue;
        // Large enough for the ring on the 3-rank set, small for the others.
        size_t n = k == 2 ? 300000 : 100;
        std::vector<float> x(n, static_cast<float>(r + 1));
        HVD_EXPECT_OK(views[k]->Allreduce(x.data(), n, DataType::kFloat32, ReduceOp::kSum));
        float want = 0;
        for (int m : sets[k]) want += static_cast<float>(m + 1);
        EXPECT_EQ(x[0], want) << "set " << k;
        EXPECT_EQ(x[n - 1], want) << "set " << k;
        std::string msg = views[k]->rank() == 0 ? "root" + std::to_string(k) : "";
        HVD_EXPECT_OK(views[k]->Bcast(&msg));
        EXPECT_EQ(msg, "root" + std::to_string(k));
        std::vector<std::string> gathered;
        HVD_EXPECT_OK(views[k]->Gather(std::to_string(r), &gathered));
        if (views[k]->rank() == 0) {
          ASSERT_EQ(gathered.size(), sets[k].size());
          for (size_t i = 0; i < sets[k].size(); ++i) {
            EXPECT_EQ(gathered[i], std::to_string(sets[k][i]));
          }
        }
      }
    }
  });
}

}  // namespace
}  // namespace hvd
