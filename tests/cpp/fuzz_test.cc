// Randomized robustness tests (fuzzing without libFuzzer: plain gtest and a seeded
// PRNG) for every decoder of bytes that come off the network:
//  - the negotiation messages, Decode(RequestList) and Decode(ResponseList)
//    (wire/message.h);
//  - the rendezvous store's requests and replies (store_wire in rendezvous/store.h),
//    as pure functions and through a live store's socket (frames with random,
//    oversized or truncated length headers, random opcodes and payloads);
//  - the job-secret handshake: HandshakeReplyValid, the client's side against a fake
//    server, and the servers' side (HandshakeQueue) through the listeners of a live
//    store and a live TCP mesh.
// Inputs: encodings of random valid values (which must round-trip exactly),
// mutations of them (bit flips, byte overwrites, truncation, extension, inserted,
// removed or repeated ranges, length fields set to interesting values) and pure
// random bytes. Whatever the input, a decoder must not crash, hang, read out of
// bounds (build with SANITIZE=address to check that) or allocate much more than its
// input holds (a huge length field is refused before anything is allocated: plain
// builds count operator new); a buffer it accepts must re-encode to exactly the
// same bytes (encodings are canonical) and one it rejects yields an error.
//
// Time-bounded: HVD_FUZZ_SECONDS (default 15) is shared among the tests below by
// fixed fractions. HVD_FUZZ_SEED (default: a new random seed per run) fixes the
// inputs: iteration i of a test draws from Rng(seed, test, i) alone. Failures (and
// crashes, from a signal handler or the sanitizers' death callback) print the seed
// and the iteration; replay with HVD_FUZZ_SEED=<seed>, with enough HVD_FUZZ_SECONDS
// to reach the iteration.
//
// Bugs found are kept as fixed regression tests at the end of this file.
#include <gtest/gtest.h>

#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <map>
#include <new>
#include <random>
#include <string>
#include <thread>
#include <vector>

#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
#include <sanitizer/common_interface_defs.h>
#define HVD_FUZZ_SANITIZED 1
#endif

#include "common/handshake.h"
#include "common/net.h"
#include "common/sha256.h"
#include "rendezvous/store.h"
#include "test_util.h"
#include "transport/tcp_transport.h"
#include "wire/codec.h"
#include "wire/message.h"

// ---------------------------------------------------------------------------
// Allocation watch. Plain builds replace the global operator new (for the whole
// test binary; it only counts, on the thread that armed it) to learn the largest
// single allocation a decoder makes. Sanitizer builds keep their own allocator
// (which checks more), and skip this check.
#ifndef HVD_FUZZ_SANITIZED
namespace {
thread_local bool g_watch_allocations = false;
thread_local size_t g_largest_allocation = 0;
}  // namespace

void* operator new(size_t n) {
  if (g_watch_allocations && n > g_largest_allocation) g_largest_allocation = n;
  if (void* p = std::malloc(n == 0 ? 1 : n)) return p;
  throw std::bad_alloc();
}
void* operator new[](size_t n) { return operator new(n); }
// GCC cannot see that these pair with the operator new above.
#pragma GCC diagnostic ignored "-Wmismatched-new-delete"
void operator delete(void* p) noexcept { std::free(p); }
void operator delete[](void* p) noexcept { std::free(p); }
void operator delete(void* p, size_t) noexcept { std::free(p); }
void operator delete[](void* p, size_t) noexcept { std::free(p); }
#endif

namespace hvd {
namespace {

using hvd_test::SecondsSince;

// The largest single allocation made between construction and largest(); 0 in
// sanitizer builds (not measured).
class AllocationWatch {
 public:
#ifndef HVD_FUZZ_SANITIZED
  AllocationWatch() {
    g_largest_allocation = 0;
    g_watch_allocations = true;
  }
  ~AllocationWatch() { g_watch_allocations = false; }
  size_t largest() const { return g_largest_allocation; }
#else
  size_t largest() const { return 0; }
#endif
};

// A decoder may allocate a small constant plus a few times its input (vectors
// grow by doubling; a decoded Request is about 2.5x its smallest encoding), never
// what a length field claims.
size_t AllocationBound(size_t input) { return 4096 + 16 * input; }

// ---------------------------------------------------------------------------
// Seeds, budgets, and the case being run (printed on failure or crash).

struct FuzzConfig {
  uint64_t seed;
  double seconds;
};

const FuzzConfig& Config() {
  static const FuzzConfig config = [] {
    FuzzConfig c;
    const char* seed = std::getenv("HVD_FUZZ_SEED");
    const char* seconds = std::getenv("HVD_FUZZ_SECONDS");
    std::random_device rd;
    c.seed = seed != nullptr && *seed != '\0' ? std::strtoull(seed, nullptr, 0)
                                              : (static_cast<uint64_t>(rd()) << 32 | rd());
    c.seconds = seconds != nullptr && *seconds != '\0' ? std::atof(seconds) : 15.0;
    if (!(c.seconds >= 0)) c.seconds = 15.0;
    return c;
  }();
  return config;
}

// What a crash report says: written before each iteration, read by the handlers.
char g_case[256] = "";

void PrintCase() {
  const size_t n = std::strlen(g_case);
  if (n == 0) return;
  (void)!::write(2, "\n*** fuzz case: ", 16);
  (void)!::write(2, g_case, n);
  (void)!::write(2, "\n", 1);
}

void OnFatalSignal(int sig) {
  PrintCase();
  ::signal(sig, SIG_DFL);
  ::raise(sig);
}

// Installs the crash reporters for one test's lifetime.
class CrashReporter {
 public:
  CrashReporter() {
#ifdef HVD_FUZZ_SANITIZED
    __sanitizer_set_death_callback(PrintCase);
    const int sigs[] = {SIGABRT};  // the sanitizers report memory errors themselves
#else
    const int sigs[] = {SIGABRT, SIGSEGV, SIGBUS, SIGFPE, SIGILL};
#endif
    for (int s : sigs) {
      struct sigaction sa {};
      sa.sa_handler = OnFatalSignal;
      sigemptyset(&sa.sa_mask);
      struct sigaction old {};
      ::sigaction(s, &sa, &old);
      saved_.push_back({s, old});
    }
  }
  ~CrashReporter() {
    for (auto& s : saved_) ::sigaction(s.first, &s.second, nullptr);
#ifdef HVD_FUZZ_SANITIZED
    __sanitizer_set_death_callback(nullptr);
#endif
    g_case[0] = '\0';
  }

 private:
  std::vector<std::pair<int, struct sigaction>> saved_;
};

using Rng = std::mt19937_64;

uint64_t Mix(uint64_t x) {  // splitmix64
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// Runs body(rng, iteration) for `share` of the fuzz budget (at least one
// iteration), each iteration with its own generator; stops at the first failure.
// Returns the number of iterations.
template <typename Body>
uint64_t Fuzz(const char* name, double share, Body body) {
  const FuzzConfig& config = Config();
  CrashReporter reporter;
  uint64_t name_hash = 1469598103934665603ull;
  for (const char* p = name; *p != '\0'; ++p) name_hash = (name_hash ^ *p) * 1099511628211ull;
  const auto deadline =
      std::chrono::steady_clock::now() +
      std::chrono::microseconds(static_cast<int64_t>(config.seconds * share * 1e6));
  uint64_t i = 0;
  do {
    std::snprintf(g_case, sizeof(g_case), "%s HVD_FUZZ_SEED=%llu iteration %llu", name,
                  static_cast<unsigned long long>(config.seed), static_cast<unsigned long long>(i));
    SCOPED_TRACE(g_case);
    Rng rng(Mix(config.seed ^ Mix(name_hash ^ Mix(i))));
    body(rng, i);
    ++i;
  } while (std::chrono::steady_clock::now() < deadline && !::testing::Test::HasFailure());
  ::testing::Test::RecordProperty("iterations", std::to_string(i));  // --gtest_output=xml
  return i;
}

// ---------------------------------------------------------------------------
// Generators.

uint64_t Below(Rng& rng, uint64_t n) { return n == 0 ? 0 : rng() % n; }
bool OneIn(Rng& rng, uint64_t n) { return Below(rng, n) == 0; }

// Mostly short, sometimes a few hundred bytes.
std::string RandomBytes(Rng& rng, size_t max = 48) {
  size_t n = OneIn(rng, 16) ? Below(rng, 400) : Below(rng, max + 1);
  std::string s(n, '\0');
  for (auto& c : s) c = static_cast<char>(rng());
  return s;
}

int64_t RandomI64(Rng& rng) {
  static const int64_t kInteresting[] = {0,
                                         1,
                                         -1,
                                         2,
                                         7,
                                         64,
                                         1000,
                                         1 << 20,
                                         std::numeric_limits<int64_t>::max(),
                                         std::numeric_limits<int64_t>::min(),
                                         std::numeric_limits<int32_t>::max()};
  if (OneIn(rng, 2)) return kInteresting[Below(rng, std::size(kInteresting))];
  return static_cast<int64_t>(rng()) >> Below(rng, 64);
}

int32_t RandomI32(Rng& rng) { return static_cast<int32_t>(RandomI64(rng)); }

double RandomDouble(Rng& rng) {
  static const double kInteresting[] = {0.0,
                                        -0.0,
                                        1.0,
                                        0.5,
                                        -2.0,
                                        1e-310,
                                        1e308,
                                        std::numeric_limits<double>::infinity(),
                                        -std::numeric_limits<double>::infinity(),
                                        std::numeric_limits<double>::quiet_NaN()};
  if (OneIn(rng, 2)) return kInteresting[Below(rng, std::size(kInteresting))];
  uint64_t bits = rng();  // any bit pattern, NaN payloads included
  double d;
  std::memcpy(&d, &bits, 8);
  return d;
}

std::vector<int64_t> RandomI64s(Rng& rng) {
  std::vector<int64_t> v(Below(rng, 7));
  for (auto& x : v) x = RandomI64(rng);
  return v;
}

std::vector<uint64_t> RandomBits(Rng& rng) {
  std::vector<uint64_t> v(Below(rng, 5));
  for (auto& x : v) x = OneIn(rng, 3) ? 0 : rng();
  return v;
}

// A control op's fields on kControl ops only (the decoder refuses anything else).
ControlOp RandomControl(Rng& rng, OpType type) {
  ControlOp c;
  if (type != OpType::kControl) return c;
  c.kind = static_cast<ControlKind>(
      1 + Below(rng, static_cast<int>(ControlKind::kAddProcessSetOfMembers)));
  c.ranks = RandomI64s(rng);
  c.process_set = RandomI32(rng);
  c.last_joined = RandomI32(rng);
  return c;
}

Request RandomRequest(Rng& rng) {
  Request r;
  r.rank = RandomI32(rng);
  r.type = static_cast<OpType>(Below(rng, 1 + static_cast<int>(OpType::kControl)));
  r.name = RandomBytes(rng);
  r.dtype = static_cast<DataType>(Below(rng, 1 + static_cast<int>(DataType::kBool)));
  r.op = static_cast<ReduceOp>(Below(rng, 1 + static_cast<int>(ReduceOp::kProduct)));
  r.root = RandomI32(rng);
  r.prescale = RandomDouble(rng);
  r.postscale = RandomDouble(rng);
  r.shape = RandomI64s(rng);
  r.splits = RandomI64s(rng);
  r.group_id = RandomI64(rng);
  r.group_size = RandomI32(rng);
  r.device = RandomI32(rng);
  r.participants = RandomI64s(rng);
  r.control = RandomControl(rng, r.type);
  return r;
}

RequestList RandomRequestList(Rng& rng) {
  RequestList l;
  l.cache_capacity = static_cast<uint32_t>(RandomI64(rng));
  l.requests.resize(Below(rng, 5));
  for (auto& r : l.requests) r = RandomRequest(rng);
  l.ready_bits = RandomBits(rng);
  l.invalid_bits = RandomBits(rng);
  l.shutdown = OneIn(rng, 2);
  l.waits.resize(Below(rng, 3));
  for (auto& w : l.waits) w = RandomBytes(rng);
  return l;
}

Response RandomResponse(Rng& rng) {
  Response r;
  r.type = static_cast<OpType>(Below(rng, 1 + static_cast<int>(OpType::kControl)));
  r.name = RandomBytes(rng);
  r.error = OneIn(rng, 3) ? RandomBytes(rng) : "";
  r.dtype = static_cast<DataType>(Below(rng, 1 + static_cast<int>(DataType::kBool)));
  r.op = static_cast<ReduceOp>(Below(rng, 1 + static_cast<int>(ReduceOp::kProduct)));
  r.root = RandomI32(rng);
  r.prescale = RandomDouble(rng);
  r.postscale = RandomDouble(rng);
  r.shape = RandomI64s(rng);
  r.rank_rows = RandomI64s(rng);
  r.group_id = RandomI64(rng);
  r.on_gpu = OneIn(rng, 2);
  r.participants = RandomI64s(rng);
  r.control = RandomControl(rng, r.type);
  return r;
}

// Fields that are not encoded keep their defaults (shutdown_rank without shutdown,
// the parameters without has_params), as a decoded list has them.
ResponseList RandomResponseList(Rng& rng) {
  ResponseList l;
  l.ready_bits = RandomBits(rng);
  l.invalid_bits = RandomBits(rng);
  l.responses.resize(Below(rng, 5));
  for (auto& r : l.responses) r = RandomResponse(rng);
  l.shutdown = OneIn(rng, 3);
  if (l.shutdown) l.shutdown_rank = RandomI32(rng);
  l.fatal = OneIn(rng, 4) ? RandomBytes(rng) : "";
  l.has_params = OneIn(rng, 3);
  if (l.has_params) {
    l.fusion_threshold_bytes = RandomI64(rng);
    l.wake_delay_us = RandomDouble(rng);
    l.cache_enabled = OneIn(rng, 2);
  }
  return l;
}

// One to four random edits of `s`.
std::string Mutate(Rng& rng, std::string s) {
  static const uint64_t kInteresting[] = {
      0,          1,          2,          3,          0x7f,       0x80,
      0xff,       0x100,      0xffff,     0x10000,    0x7fffffff, 0x80000000,
      0xffffffff, 0x20000000, 1ull << 32, 1ull << 40, ~0ull,      ~0ull >> 1};
  const int edits = 1 + static_cast<int>(Below(rng, 4));
  for (int e = 0; e < edits; ++e) {
    const size_t at = Below(rng, s.size() + 1);
    switch (Below(rng, 9)) {
      case 0:  // flip a bit
        if (!s.empty()) s[at % s.size()] ^= static_cast<char>(1 << Below(rng, 8));
        break;
      case 1:  // overwrite a byte
        if (!s.empty()) s[at % s.size()] = static_cast<char>(rng());
        break;
      case 2:  // truncate
        s.resize(at);
        break;
      case 3:  // extend
        s += RandomBytes(rng, 16);
        break;
      case 4:  // insert
        s.insert(at, RandomBytes(rng, 8));
        break;
      case 5:  // remove a range
        s.erase(at, Below(rng, 16));
        break;
      case 6:  // repeat a range
        s.insert(at, s.substr(Below(rng, s.size() + 1), Below(rng, 32)));
        break;
      case 7:    // a u32 (length fields, counts) set to an interesting value
      case 8: {  // a u64 (frame headers, bitmaps)
        const size_t width = Below(rng, 9) < 7 ? 4 : 8;
        if (s.size() < width) break;
        uint64_t v = OneIn(rng, 4) ? s.size() - Below(rng, 9)
                                   : kInteresting[Below(rng, std::size(kInteresting))];
        std::memcpy(&s[Below(rng, s.size() - width + 1)], &v, width);
        break;
      }
    }
  }
  return s;
}

std::string Frame(const std::string& payload) {
  uint64_t n = payload.size();
  return std::string(reinterpret_cast<const char*>(&n), 8) + payload;
}

bool SameBits(double a, double b) { return std::memcmp(&a, &b, sizeof(double)) == 0; }

// ---------------------------------------------------------------------------
// The codec's Reader, against a model: a random sequence of reads over random bytes
// returns what sits at the model's offsets, fails (and stays failed, returning
// zeros and empties) exactly when the model runs out of bytes or meets a boolean
// byte over 1, and never allocates more than what is left of the buffer.

TEST(FuzzWire, ReaderPrimitives) {
  Fuzz("FuzzWire.ReaderPrimitives", 0.05, [&](Rng& rng, uint64_t) {
    std::string buf = RandomBytes(rng, 64);
    if (OneIn(rng, 2) && buf.size() >= 4) {  // a plausible length at the start
      const uint32_t n = static_cast<uint32_t>(Below(rng, buf.size()));
      std::memcpy(&buf[0], &n, 4);
    }
    Reader rd(buf.data(), buf.size());
    size_t pos = 0;
    bool ok = true;
    auto take = [&](size_t n, void* out) {  // the model's fixed-width read
      if (ok && buf.size() - pos >= n) {
        std::memcpy(out, buf.data() + pos, n);
        pos += n;
      } else {
        ok = false;
      }
    };
    for (int op = 0; op < 12; ++op) {
      AllocationWatch watch;
      switch (Below(rng, 8)) {
        case 0: {
          uint8_t want = 0;
          take(1, &want);
          EXPECT_EQ(rd.U8(), want);
          break;
        }
        case 1: {
          uint8_t byte = 0;
          take(1, &byte);
          if (byte > 1) ok = false;
          EXPECT_EQ(rd.Bool(), ok && byte == 1);
          break;
        }
        case 2: {
          uint32_t want = 0;
          take(4, &want);
          EXPECT_EQ(rd.U32(), want);
          break;
        }
        case 3: {
          int64_t want = 0;
          take(8, &want);
          EXPECT_EQ(rd.I64(), want);
          break;
        }
        case 4: {
          double want = 0;
          take(8, &want);
          EXPECT_TRUE(SameBits(rd.F64(), want));
          break;
        }
        case 5: {
          uint32_t n = 0;
          take(4, &n);
          std::string want;
          if (ok && buf.size() - pos >= n) {
            want = buf.substr(pos, n);
            pos += n;
          } else {
            ok = false;
          }
          EXPECT_EQ(rd.Str(), want);
          break;
        }
        default: {
          uint32_t n = 0;
          take(4, &n);
          std::vector<int64_t> want;
          if (ok && (buf.size() - pos) / 8 >= n) {
            want.resize(n);
            if (n > 0) std::memcpy(want.data(), buf.data() + pos, 8 * size_t{n});
            pos += 8 * size_t{n};
          } else {
            ok = false;
          }
          EXPECT_EQ(rd.I64s(), want);
          break;
        }
      }
      EXPECT_LE(watch.largest(), 64 + buf.size());
      ASSERT_EQ(rd.ok(), ok) << "after read " << op;
      if (ok) {
        EXPECT_EQ(rd.done(), pos == buf.size());
      }
    }
  });
}

// ---------------------------------------------------------------------------
// The negotiation messages.

void ExpectSame(const Request& a, const Request& b) {
  EXPECT_EQ(a.rank, b.rank);
  EXPECT_EQ(a.type, b.type);
  EXPECT_EQ(a.name, b.name);
  EXPECT_EQ(a.dtype, b.dtype);
  EXPECT_EQ(a.op, b.op);
  EXPECT_EQ(a.root, b.root);
  EXPECT_TRUE(SameBits(a.prescale, b.prescale));
  EXPECT_TRUE(SameBits(a.postscale, b.postscale));
  EXPECT_EQ(a.shape, b.shape);
  EXPECT_EQ(a.splits, b.splits);
  EXPECT_EQ(a.group_id, b.group_id);
  EXPECT_EQ(a.group_size, b.group_size);
  EXPECT_EQ(a.device, b.device);
  EXPECT_TRUE(a.control == b.control);
}

void ExpectSame(const RequestList& a, const RequestList& b) {
  EXPECT_EQ(a.cache_capacity, b.cache_capacity);
  EXPECT_EQ(a.ready_bits, b.ready_bits);
  EXPECT_EQ(a.invalid_bits, b.invalid_bits);
  EXPECT_EQ(a.shutdown, b.shutdown);
  EXPECT_EQ(a.waits, b.waits);
  ASSERT_EQ(a.requests.size(), b.requests.size());
  for (size_t i = 0; i < a.requests.size(); ++i) ExpectSame(a.requests[i], b.requests[i]);
}

void ExpectSame(const Response& a, const Response& b) {
  EXPECT_EQ(a.type, b.type);
  EXPECT_EQ(a.name, b.name);
  EXPECT_EQ(a.error, b.error);
  EXPECT_EQ(a.dtype, b.dtype);
  EXPECT_EQ(a.op, b.op);
  EXPECT_EQ(a.root, b.root);
  EXPECT_TRUE(SameBits(a.prescale, b.prescale));
  EXPECT_TRUE(SameBits(a.postscale, b.postscale));
  EXPECT_EQ(a.shape, b.shape);
  EXPECT_EQ(a.rank_rows, b.rank_rows);
  EXPECT_EQ(a.group_id, b.group_id);
  EXPECT_EQ(a.on_gpu, b.on_gpu);
  EXPECT_TRUE(a.control == b.control);
}

void ExpectSame(const ResponseList& a, const ResponseList& b) {
  EXPECT_EQ(a.ready_bits, b.ready_bits);
  EXPECT_EQ(a.invalid_bits, b.invalid_bits);
  EXPECT_EQ(a.shutdown, b.shutdown);
  EXPECT_EQ(a.shutdown_rank, b.shutdown_rank);
  EXPECT_EQ(a.fatal, b.fatal);
  EXPECT_EQ(a.has_params, b.has_params);
  EXPECT_EQ(a.fusion_threshold_bytes, b.fusion_threshold_bytes);
  EXPECT_TRUE(SameBits(a.wake_delay_us, b.wake_delay_us));
  EXPECT_EQ(a.cache_enabled, b.cache_enabled);
  ASSERT_EQ(a.responses.size(), b.responses.size());
  for (size_t i = 0; i < a.responses.size(); ++i) ExpectSame(a.responses[i], b.responses[i]);
}

// Decodes `bytes` (any bytes): an error is Aborted with a message; a success
// re-encodes to `bytes`; either way within the allocation bound. Returns whether
// it decoded.
template <typename List>
bool CheckDecode(const std::string& bytes, List* out) {
  Status st;
  size_t largest = 0;
  {
    AllocationWatch watch;
    st = Decode(bytes, out);
    largest = watch.largest();
  }
  EXPECT_LE(largest, AllocationBound(bytes.size())) << "decoding " << bytes.size() << " bytes";
  if (!st.ok()) {
    EXPECT_EQ(st.code(), StatusCode::kAborted);
    EXPECT_FALSE(st.message().empty());
    return false;
  }
  EXPECT_TRUE(Encode(*out) == bytes) << "a decoded list re-encodes differently";
  return true;
}

// One iteration over a list type: a round trip, a mutation of it, random bytes
// (half of them behind the right magic, which every decoder checks first).
template <typename List, typename Gen>
void FuzzListIteration(Rng& rng, Gen gen) {
  const List in = gen(rng);
  const std::string bytes = Encode(in);
  List out;
  ASSERT_TRUE(CheckDecode(bytes, &out));
  ExpectSame(in, out);

  const std::string mutant = Mutate(rng, bytes);
  List m;
  CheckDecode(mutant, &m);

  std::string noise = RandomBytes(rng, 64);
  if (OneIn(rng, 2)) noise = bytes.substr(0, 4) + noise;
  List r;
  CheckDecode(noise, &r);
}

TEST(FuzzWire, RequestLists) {
  Fuzz("FuzzWire.RequestLists", 0.2,
       [&](Rng& rng, uint64_t) { FuzzListIteration<RequestList>(rng, RandomRequestList); });
}

TEST(FuzzWire, ResponseLists) {
  Fuzz("FuzzWire.ResponseLists", 0.2,
       [&](Rng& rng, uint64_t) { FuzzListIteration<ResponseList>(rng, RandomResponseList); });
}

// ---------------------------------------------------------------------------
// The rendezvous store's protocol, as pure functions.

const uint8_t kStoreOps[] = {store_wire::kSet, store_wire::kGet, store_wire::kAdd,
                             store_wire::kLimit};

store_wire::Request RandomStoreRequest(Rng& rng) {
  store_wire::Request r;
  r.op = OneIn(rng, 20) ? static_cast<uint8_t>(rng()) : kStoreOps[Below(rng, 4)];
  r.key = RandomBytes(rng, 24);
  if (r.op == store_wire::kSet) r.value = RandomBytes(rng);
  if (r.op == store_wire::kGet) r.timeout_s = RandomDouble(rng);
  if (r.op == store_wire::kAdd) r.delta = RandomI64(rng);
  return r;
}

bool IsStoreOp(uint8_t op) {
  for (uint8_t o : kStoreOps) {
    if (o == op) return true;
  }
  return false;
}

void ExpectSame(const store_wire::Request& a, const store_wire::Request& b) {
  EXPECT_EQ(a.op, b.op);
  EXPECT_EQ(a.key, b.key);
  EXPECT_EQ(a.value, b.value);
  EXPECT_TRUE(SameBits(a.timeout_s, b.timeout_s));
  EXPECT_EQ(a.delta, b.delta);
}

// Parses any bytes as a request; checks the allocation bound and that an accepted
// request re-encodes to `bytes`.
bool CheckParseRequest(const std::string& bytes, store_wire::Request* r) {
  bool ok = false;
  size_t largest = 0;
  {
    AllocationWatch watch;
    ok = store_wire::ParseRequest(bytes, r);
    largest = watch.largest();
  }
  EXPECT_LE(largest, AllocationBound(bytes.size()));
  if (ok) {
    EXPECT_TRUE(IsStoreOp(r->op));
    EXPECT_TRUE(store_wire::EncodeRequest(*r) == bytes)
        << "a parsed request re-encodes differently";
  }
  return ok;
}

bool CheckParseReply(uint8_t op, const std::string& bytes, store_wire::Reply* r) {
  bool ok = false;
  size_t largest = 0;
  {
    AllocationWatch watch;
    ok = store_wire::ParseReply(op, bytes, r);
    largest = watch.largest();
  }
  EXPECT_LE(largest, AllocationBound(bytes.size()));
  if (ok && bytes != std::string(1, '\0')) {  // the refusal is the one other form
    EXPECT_TRUE(store_wire::EncodeReply(op, *r) == bytes)
        << "a parsed reply re-encodes differently";
  }
  return ok;
}

TEST(FuzzStore, RequestsAndReplies) {
  Fuzz("FuzzStore.RequestsAndReplies", 0.05, [&](Rng& rng, uint64_t) {
    const store_wire::Request in = RandomStoreRequest(rng);
    const std::string bytes = store_wire::EncodeRequest(in);
    store_wire::Request out;
    EXPECT_EQ(CheckParseRequest(bytes, &out), IsStoreOp(in.op));
    if (IsStoreOp(in.op)) ExpectSame(in, out);
    CheckParseRequest(Mutate(rng, bytes), &out);
    CheckParseRequest(RandomBytes(rng), &out);

    const uint8_t op = kStoreOps[Below(rng, 4)];
    store_wire::Reply reply;
    reply.ok = OneIn(rng, 2);
    if (op == store_wire::kGet) reply.value = RandomBytes(rng);
    if (op == store_wire::kAdd || op == store_wire::kLimit) reply.number = rng();
    const std::string reply_bytes = store_wire::EncodeReply(op, reply);
    store_wire::Reply got;
    ASSERT_TRUE(CheckParseReply(op, reply_bytes, &got));
    EXPECT_EQ(got.ok, reply.ok);
    EXPECT_EQ(got.value, reply.value);
    EXPECT_EQ(got.number, reply.number);
    CheckParseReply(op, Mutate(rng, reply_bytes), &got);
    CheckParseReply(op, RandomBytes(rng, 16), &got);
  });
}

// ---------------------------------------------------------------------------
// Sockets.

// Reads whatever `fd` has; true once the peer has closed (EOF or reset), false if it
// is still open after `within` seconds.
bool ClosedByPeer(int fd, double within) {
  auto t0 = std::chrono::steady_clock::now();
  char buf[4096];
  while (SecondsSince(t0) < within) {
    pollfd p{fd, POLLIN, 0};
    if (::poll(&p, 1, 20) <= 0) continue;
    ssize_t n = ::recv(fd, buf, sizeof(buf), MSG_DONTWAIT);
    if (n == 0 || (n < 0 && errno != EAGAIN && errno != EINTR)) return true;
  }
  return false;
}

// What a listener running HandshakeQueue must answer to `sent` (then our side
// shuts down writing): "Y" or "N" for a complete reply frame, nothing (it closes)
// for a frame over kMaxHandshakeFrame or an incomplete one.
enum class Verdict { kYes, kNo, kClosed };

Verdict ExpectedVerdict(const std::string& secret, const std::string& nonce,
                        const std::string& sent) {
  if (sent.size() < 8) return Verdict::kClosed;
  uint64_t len = 0;
  std::memcpy(&len, sent.data(), 8);
  if (len > kMaxHandshakeFrame || sent.size() < 8 + len) return Verdict::kClosed;
  return HandshakeReplyValid(secret, nonce, sent.substr(8, len), nullptr) ? Verdict::kYes
                                                                          : Verdict::kNo;
}

// A handshake reply for a listener: valid (with any tag), mutated, or noise.
std::string RandomHandshakeReply(Rng& rng, const std::string& secret, const std::string& nonce,
                                 const std::string& good_tag, bool allow_valid) {
  const std::string tag = OneIn(rng, 2) ? good_tag : RandomBytes(rng, 24);
  const std::string valid = Frame(HmacSha256(secret, nonce + tag) + tag);
  switch (Below(rng, 6)) {
    case 0:
      if (allow_valid) return valid;
      [[fallthrough]];
    case 1:
      return Frame(HmacSha256("not-" + secret, nonce + tag) + tag);  // a wrong secret
    case 2:
      return RandomBytes(rng, 64);
    default:
      return Mutate(rng, valid);
  }
}

// One connection to a listener that runs HandshakeQueue: sends a reply, checks
// the verdict (or the close) it gets. `counts` tallies the verdicts.
void OneHandshake(Rng& rng, int port, const std::string& secret, const std::string& good_tag,
                  bool allow_valid, int counts[3]) {
  Socket s;
  ASSERT_TRUE(Connect("127.0.0.1", port, 5, &s).ok());
  std::string nonce;
  Status st = RecvFrame(s.fd(), &nonce, 5, kMaxHandshakeFrame);
  ASSERT_TRUE(st.ok()) << st.message();
  std::string sent = RandomHandshakeReply(rng, secret, nonce, good_tag, allow_valid);
  Verdict want = ExpectedVerdict(secret, nonce, sent);
  if (want == Verdict::kYes && !allow_valid) {  // a mutation that happens to be valid
    sent = Frame("x");
    want = Verdict::kNo;
  }
  if (!sent.empty()) {
    ASSERT_TRUE(SendAll(s.fd(), sent.data(), sent.size(), 5).ok());
  }
  ::shutdown(s.fd(), SHUT_WR);
  std::string verdict;
  st = RecvFrame(s.fd(), &verdict, 5, kMaxHandshakeFrame);
  uint64_t len = 0;
  if (sent.size() >= 8) std::memcpy(&len, sent.data(), 8);
  const bool extra = sent.size() >= 8 && len <= kMaxHandshakeFrame && sent.size() > 8 + len;
  switch (want) {
    case Verdict::kYes:
      ASSERT_TRUE(st.ok()) << st.message();
      EXPECT_EQ(verdict, "Y");
      break;
    case Verdict::kNo:
      // Bytes after the frame stay unread; closing over them may reset the
      // connection before the "N" is read.
      if (!st.ok() && extra) break;
      ASSERT_TRUE(st.ok()) << st.message();
      EXPECT_EQ(verdict, "N");
      break;
    case Verdict::kClosed:
      EXPECT_FALSE(st.ok()) << "got a verdict '" << verdict << "' for an incomplete reply";
      EXPECT_EQ(st.message().find("timed out"), std::string::npos) << st.message();
      break;
  }
  ++counts[static_cast<int>(want)];
  if (want != Verdict::kNo) {
    EXPECT_TRUE(ClosedByPeer(s.fd(), 5)) << "the connection stayed open";
  }
}

// What the store must make of a request, on a model of its contents.
struct StoreModel {
  std::map<std::string, std::string> data;

  store_wire::Reply Apply(const store_wire::Request& r, uint64_t max_frame) {
    store_wire::Reply reply;
    auto it = data.find(r.key);
    switch (r.op) {
      case store_wire::kSet:
        data[r.key] = r.value;
        reply.ok = true;
        break;
      case store_wire::kGet:
        reply.ok = it != data.end();
        if (reply.ok) reply.value = it->second;
        break;
      case store_wire::kAdd: {
        int64_t v = 0, sum = 0;
        if (it != data.end()) {
          char* end = nullptr;
          errno = 0;
          v = std::strtoll(it->second.c_str(), &end, 10);
          if (it->second.empty() || *end != '\0' || errno != 0) break;
        }
        if (__builtin_add_overflow(v, r.delta, &sum)) break;
        data[r.key] = std::to_string(sum);
        reply.ok = true;
        reply.number = static_cast<uint64_t>(sum);
        break;
      }
      case store_wire::kLimit:
        reply.ok = true;
        reply.number = max_frame;
        break;
    }
    return reply;
  }
};

Status AuthenticatedConnection(int port, Socket* s) {
  HVD_RETURN_IF_ERROR(Connect("127.0.0.1", port, 5, s));
  return ClientHandshake(s->fd(), hvd_test::kSecret, "store", 5);
}

// A request for the socket fuzz: keys from a small pool (so that requests meet
// each other's keys), numeric values for Add, and Gets that never wait long for a
// missing key (the fuzz must not sleep).
store_wire::Request StoreRequestForSocket(Rng& rng) {
  static const char* const kKeys[] = {"a", "b", "counter", "", "k\x01\xff"};
  store_wire::Request r = RandomStoreRequest(rng);
  if (!OneIn(rng, 4)) r.key = kKeys[Below(rng, std::size(kKeys))];
  if (r.op == store_wire::kSet && OneIn(rng, 2)) {
    r.value = OneIn(rng, 3) ? " 12" : std::to_string(RandomI64(rng));
  }
  if (r.op == store_wire::kSet && OneIn(rng, 40)) r.value = RandomBytes(rng, 8000);
  return r;
}

// A Get that would wait (a positive timeout for a missing key) waits 1 ms at most.
void NoLongWaits(store_wire::Request* r, const StoreModel& model) {
  if (r->op == store_wire::kGet && model.data.count(r->key) == 0 && r->timeout_s > 0.001) {
    r->timeout_s = 0.001;
  }
}

TEST(FuzzStore, OverASocket) {
  hvd_test::Watchdog wd(60 + Config().seconds, "FuzzStore.OverASocket");
  StoreOptions options;
  options.max_frame = 8192;
  options.handshake_timeout_s = 1.0;
  StoreServer server("127.0.0.1", 0, hvd_test::kSecret, options);
  ASSERT_TRUE(server.status().ok());
  const uint64_t max_frame = server.max_frame();
  hvd_test::StderrCapture capture;  // oversized requests are logged, one line each
  StoreModel model;
  Socket conn;
  uint64_t n = Fuzz("FuzzStore.OverASocket", 0.2, [&](Rng& rng, uint64_t) {
    if (!conn.valid()) {
      ASSERT_TRUE(AuthenticatedConnection(server.port(), &conn).ok());
    }
    const uint64_t kind = Below(rng, 20);
    if (kind < 14) {  // a whole frame: a valid request, a mutated one, or noise
      store_wire::Request base = StoreRequestForSocket(rng);
      NoLongWaits(&base, model);
      std::string payload = store_wire::EncodeRequest(base);
      if (kind >= 8) payload = kind >= 12 ? RandomBytes(rng) : Mutate(rng, payload);
      store_wire::Request parsed;
      const bool valid = store_wire::ParseRequest(payload, &parsed);
      if (valid) {  // a mutant may have become a Get that waits
        NoLongWaits(&parsed, model);
        payload = store_wire::EncodeRequest(parsed);
      }
      if (payload.size() > max_frame) return;  // the oversized case below covers it
      ASSERT_TRUE(SendFrame(conn.fd(), payload, 5).ok());
      std::string got;
      Status st = RecvFrame(conn.fd(), &got, 5, 1 << 20);
      ASSERT_TRUE(st.ok()) << "no reply to a request of " << payload.size()
                           << " bytes: " << st.message();
      if (!valid) {
        EXPECT_EQ(got, std::string(1, '\0')) << "a malformed request was not refused";
        return;
      }
      store_wire::Reply want = model.Apply(parsed, max_frame), reply;
      ASSERT_TRUE(store_wire::ParseReply(parsed.op, got, &reply));
      EXPECT_EQ(reply.ok, want.ok) << "op " << parsed.op;
      EXPECT_EQ(reply.value, want.value);
      if (want.ok) {
        EXPECT_EQ(reply.number, want.number);
      }
    } else if (kind < 16) {  // a length header over max_frame: the server hangs up
      uint64_t len = OneIn(rng, 3) ? ~0ull : max_frame + 1 + Below(rng, 1ull << 40);
      std::string bytes(reinterpret_cast<const char*>(&len), 8);
      bytes += RandomBytes(rng);
      ASSERT_TRUE(SendAll(conn.fd(), bytes.data(), bytes.size(), 5).ok());
      EXPECT_TRUE(ClosedByPeer(conn.fd(), 5)) << "a " << len << "-byte request was not refused";
      conn.Close();
    } else if (kind < 18) {  // a truncated frame (or header), then the client leaves
      std::string payload = store_wire::EncodeRequest(StoreRequestForSocket(rng));
      std::string bytes = Frame(payload);
      bytes.resize(Below(rng, bytes.size()));
      if (!bytes.empty()) {
        ASSERT_TRUE(SendAll(conn.fd(), bytes.data(), bytes.size(), 5).ok());
      }
      conn.Close();
    } else {  // a connection that tries the handshake
      int counts[3] = {};
      OneHandshake(rng, server.port(), hvd_test::kSecret, "store", true, counts);
    }
  });
  conn.Close();
  // The store still serves, and holds what the model says.
  auto client = hvd_test::ConnectClient(server);
  ASSERT_TRUE(client);
  for (const auto& kv : model.data) {
    std::string v;
    ASSERT_TRUE(server.Get(kv.first, &v)) << kv.first;
    EXPECT_TRUE(v == kv.second) << "key '" << kv.first << "'";
  }
  HVD_EXPECT_OK(client->Set("after", "fuzz"));
  server.Stop();
  const std::string err = capture.Take();
  EXPECT_GT(n, 0u);
  EXPECT_EQ(err.find("cannot start a thread"), std::string::npos) << err;
}

// ---------------------------------------------------------------------------
// The job-secret handshake.

TEST(FuzzHandshake, ReplyValidation) {
  Fuzz("FuzzHandshake.ReplyValidation", 0.05, [&](Rng& rng, uint64_t) {
    const std::string secret = RandomBytes(rng, 40), nonce = RandomBytes(rng, 32),
                      tag = RandomBytes(rng, 64);
    const std::string good = HmacSha256(secret, nonce + tag) + tag;
    std::string got = "untouched";
    ASSERT_TRUE(HandshakeReplyValid(secret, nonce, good, &got));
    EXPECT_EQ(got, tag);
    const std::string mutant = Mutate(rng, good);
    got = "untouched";
    if (mutant != good) {
      EXPECT_FALSE(HandshakeReplyValid(secret, nonce, mutant, &got));
      EXPECT_EQ(got, "untouched");
    }
    EXPECT_FALSE(HandshakeReplyValid(secret + "x", nonce, good, nullptr));
    EXPECT_FALSE(HandshakeReplyValid(secret, nonce + "x", good, nullptr));
    const std::string noise = RandomBytes(rng, 64);
    EXPECT_EQ(
        HandshakeReplyValid(secret, nonce, noise, nullptr),
        noise.size() >= 32 && noise.substr(0, 32) == HmacSha256(secret, nonce + noise.substr(32)));
  });
}

// ClientHandshake against a fake server that sends anything: it must end (the
// fake server closes after sending) and succeed only on a nonce frame followed by
// the verdict "Y"; *rejected only for a complete verdict other than "Y".
TEST(FuzzHandshake, ClientAgainstAFakeServer) {
  Fuzz("FuzzHandshake.ClientAgainstAFakeServer", 0.05, [&](Rng& rng, uint64_t) {
    int sv[2];
    ASSERT_EQ(::socketpair(AF_UNIX, SOCK_STREAM, 0, sv), 0);
    Socket client(sv[0]), server(sv[1]);
    std::string nonce = RandomBytes(rng, 32);
    std::string verdict = OneIn(rng, 2) ? "Y" : OneIn(rng, 2) ? "N" : RandomBytes(rng, 4);
    std::string bytes = Frame(nonce) + Frame(verdict);
    if (!OneIn(rng, 3)) bytes = Mutate(rng, bytes);
    if (OneIn(rng, 8)) bytes = RandomBytes(rng, 64);
    // The outcome ClientHandshake must reach on `bytes`.
    bool want_ok = false, want_rejected = false;
    uint64_t len1 = 0, len2 = 0;
    if (bytes.size() >= 8) std::memcpy(&len1, bytes.data(), 8);
    if (bytes.size() >= 8 && len1 <= kMaxHandshakeFrame && bytes.size() >= 16 + len1) {
      std::memcpy(&len2, bytes.data() + 8 + len1, 8);
      if (len2 <= kMaxHandshakeFrame && bytes.size() >= 16 + len1 + len2) {
        want_ok = bytes.substr(16 + len1, len2) == "Y";
        want_rejected = !want_ok;
      }
    }
    ASSERT_TRUE(SendAll(server.fd(), bytes.data(), bytes.size(), 5).ok());
    ::shutdown(server.fd(), SHUT_WR);
    bool rejected = false;
    auto t0 = std::chrono::steady_clock::now();
    Status st = ClientHandshake(client.fd(), "secret", "tag", 5, &rejected);
    EXPECT_LT(SecondsSince(t0), 2.0);
    EXPECT_EQ(st.ok(), want_ok) << st.message();
    EXPECT_EQ(rejected, want_rejected);
  });
}

// The servers' side through real listeners: a store's, and rank 0 of a 2-rank TCP
// mesh while both ranks run collectives (a rank answers handshakes only then).
// Every reply gets the verdict its bytes call for; a reply with the secret but a
// hello that names no expected peer gets "Y" and is then dropped; the mesh's
// collectives stay right; rejections are logged as a few lines, not one each.
TEST(FuzzHandshake, StoreAndMeshListeners) {
  hvd_test::Watchdog wd(90 + Config().seconds, "FuzzHandshake.StoreAndMeshListeners");
  hvd_test::StderrCapture capture;
  std::string err;
  int counts[3] = {};
  {
    StoreOptions options;
    options.handshake_timeout_s = 1.0;
    StoreServer store("127.0.0.1", 0, hvd_test::kSecret, options);
    ASSERT_TRUE(store.status().ok());
    hvd_test::World w;
    Status made = hvd_test::MakeWorld(2, hvd_test::FastOptions(), &w);
    ASSERT_TRUE(made.ok()) << made.message();
    std::string addr;
    ASSERT_TRUE(w.server->Get("job/addr/0", &addr));
    const int mesh_port = std::atoi(addr.c_str() + addr.rfind(':') + 1);

    std::atomic<bool> done{false};
    std::vector<int> rounds(2);
    std::thread ranks([&] {
      hvd_test::RunRanks(
          2, [&](int r) { HVD_EXPECT_OK(hvd_test::AllreduceUntil(w, r, done, &rounds[r])); });
    });
    int valid_for_mesh = 0;
    Fuzz("FuzzHandshake.StoreAndMeshListeners", 0.2, [&](Rng& rng, uint64_t) {
      if (OneIn(rng, 2)) {
        OneHandshake(rng, store.port(), hvd_test::kSecret, "store", true, counts);
      } else {
        // Each valid reply logs a line ("unexpected connection"): a few only.
        const bool allow_valid = valid_for_mesh < 5 && OneIn(rng, 10);
        int before = counts[0];
        OneHandshake(rng, mesh_port, hvd_test::kSecret, "1", allow_valid, counts);
        valid_for_mesh += counts[0] - before;
      }
    });
    done = true;
    ranks.join();
    EXPECT_EQ(rounds[0], rounds[1]);
    auto c = hvd_test::ConnectClient(store);  // both still serve
    ASSERT_TRUE(c);
    HVD_EXPECT_OK(c->Set("k", "v"));
    hvd_test::RunRanks(2, [&](int r) {
      std::vector<float> x(1000, 1.0f);
      HVD_EXPECT_OK(
          w.transports[r]->Allreduce(x.data(), x.size(), DataType::kFloat32, ReduceOp::kSum));
      EXPECT_EQ(x[999], 2.0f);
    });
    w.transports.clear();  // logs the mesh's last count
    store.Stop();
  }
  err = capture.Take();
  EXPECT_GT(counts[1] + counts[2], 0);
  // Per listener: the first rejection at once, then one line per 10 s, and the last
  // count when it stops.
  int lines = 0;
  for (size_t at = err.find("failed the job-secret handshake"); at != std::string::npos;
       at = err.find("failed the job-secret handshake", at + 1)) {
    ++lines;
  }
  EXPECT_LE(lines, 4 + 2 * static_cast<int>(Config().seconds * 0.2 / 10)) << err;
}

// ---------------------------------------------------------------------------
// Regression tests: what the fuzzing found, fixed.

// A Set request cut short used to be applied anyway: the store read what was
// there (a partial key, no value) and stored it. It must be refused, change
// nothing, and leave the connection usable.
TEST(FuzzRegression, StoreRefusesAShortRequest) {
  StoreServer server("127.0.0.1", 0, hvd_test::kSecret);
  ASSERT_TRUE(server.status().ok());
  Socket s;
  ASSERT_TRUE(AuthenticatedConnection(server.port(), &s).ok());
  store_wire::Request set;
  set.op = store_wire::kSet;
  set.key = "key";
  set.value = "value";
  const std::string full = store_wire::EncodeRequest(set);
  for (size_t cut : {size_t{1}, size_t{3}, size_t{8}, full.size() - 1}) {
    ASSERT_TRUE(SendFrame(s.fd(), full.substr(0, cut), 5).ok());
    std::string reply;
    ASSERT_TRUE(RecvFrame(s.fd(), &reply, 5).ok());
    EXPECT_EQ(reply, std::string(1, '\0')) << cut;
  }
  ASSERT_TRUE(SendFrame(s.fd(), full + "x", 5).ok());  // trailing bytes
  std::string reply;
  ASSERT_TRUE(RecvFrame(s.fd(), &reply, 5).ok());
  EXPECT_EQ(reply, std::string(1, '\0'));
  std::string v;
  EXPECT_FALSE(server.Get("", &v));
  EXPECT_FALSE(server.Get("k", &v));
  EXPECT_FALSE(server.Get("key", &v));
  ASSERT_TRUE(SendFrame(s.fd(), full, 5).ok());
  ASSERT_TRUE(RecvFrame(s.fd(), &reply, 5).ok());
  EXPECT_EQ(reply, std::string(1, '\1'));
  EXPECT_TRUE(server.Get("key", &v));
  EXPECT_EQ(v, "value");
}

// A Get's wait comes off the wire as a double. NaN, infinities and huge or
// negative values used to be converted to an integer count of microseconds
// unchecked (undefined behaviour; UBSan's float-cast-overflow, then a signed
// overflow in the deadline). Now: NaN and negative values do not wait, anything
// over a year waits a year (here: until the key is set).
TEST(FuzzRegression, StoreGetWaitsAreClamped) {
  hvd_test::Watchdog wd(30, "FuzzRegression.StoreGetWaitsAreClamped");
  StoreServer server("127.0.0.1", 0, hvd_test::kSecret);
  ASSERT_TRUE(server.status().ok());
  Socket s;
  ASSERT_TRUE(AuthenticatedConnection(server.port(), &s).ok());
  auto get = [&](const std::string& key, double timeout_s, store_wire::Reply* reply) {
    store_wire::Request r;
    r.op = store_wire::kGet;
    r.key = key;
    r.timeout_s = timeout_s;
    ASSERT_TRUE(SendFrame(s.fd(), store_wire::EncodeRequest(r), 5).ok());
    std::string bytes;
    ASSERT_TRUE(RecvFrame(s.fd(), &bytes, 5).ok());
    ASSERT_TRUE(store_wire::ParseReply(store_wire::kGet, bytes, reply));
  };
  for (double t : {std::numeric_limits<double>::quiet_NaN(),
                   -std::numeric_limits<double>::infinity(), -1e300, -1.0, -0.0}) {
    auto t0 = std::chrono::steady_clock::now();
    store_wire::Reply reply;
    get("missing", t, &reply);
    EXPECT_FALSE(reply.ok) << t;
    EXPECT_LT(SecondsSince(t0), 1.0) << t;
  }
  for (double t : {std::numeric_limits<double>::infinity(), 1e300}) {
    const std::string key = "later-" + std::to_string(t);
    std::thread setter([&] {
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
      server.Set(key, "here");
    });
    store_wire::Reply reply;
    get(key, t, &reply);
    setter.join();
    EXPECT_TRUE(reply.ok) << t;
    EXPECT_EQ(reply.value, "here");
  }
}

// Add used to compute stored + delta in int64 unchecked (undefined behaviour on
// overflow, reachable by any client). An overflowing Add fails and changes nothing.
TEST(FuzzRegression, StoreAddOverflowFails) {
  StoreServer server("127.0.0.1", 0, hvd_test::kSecret);
  ASSERT_TRUE(server.status().ok());
  auto c = hvd_test::ConnectClient(server);
  ASSERT_TRUE(c);
  int64_t r = 0;
  HVD_ASSERT_OK(c->Add("n", std::numeric_limits<int64_t>::max(), &r));
  Status st = c->Add("n", 1, &r);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << st.message();
  EXPECT_NE(st.message().find("overflows"), std::string::npos) << st.message();
  std::string v;
  ASSERT_TRUE(server.Get("n", &v));
  EXPECT_EQ(v, std::to_string(std::numeric_limits<int64_t>::max()));
  HVD_EXPECT_OK(c->Add("n", std::numeric_limits<int64_t>::min(), &r));
  EXPECT_EQ(r, -1);
  int64_t local = 0;
  EXPECT_FALSE(server.Add("n", std::numeric_limits<int64_t>::min(), &local));
  EXPECT_TRUE(server.Add("n", 1, &local));
  EXPECT_EQ(local, 0);
}

// Booleans (shutdown, on_gpu, has_params, cache_enabled) decoded any nonzero byte
// as true, so a corrupted byte went unnoticed and decoding was not canonical. Only
// 0 and 1 are accepted now.
TEST(FuzzRegression, WireBooleansAreZeroOrOne) {
  RequestList rl;
  std::string bytes = Encode(rl);
  const size_t shutdown_at = 8;  // magic u32, cache capacity u32, then shutdown u8
  ASSERT_EQ(bytes[shutdown_at], 0);
  bytes[shutdown_at] = 2;
  RequestList out;
  EXPECT_FALSE(Decode(bytes, &out).ok());
  bytes[shutdown_at] = 1;
  ASSERT_TRUE(Decode(bytes, &out).ok());
  EXPECT_TRUE(out.shutdown);

  ResponseList sl;
  Response resp;
  sl.responses.push_back(resp);
  std::string sb = Encode(sl);
  // ... the response's last byte is on_gpu; the list's last is has_params.
  const size_t on_gpu_at = sb.size() - 2;
  ASSERT_EQ(sb[on_gpu_at], 0);
  sb[on_gpu_at] = static_cast<char>(0x80);
  ResponseList sout;
  EXPECT_FALSE(Decode(sb, &sout).ok());
  sb[on_gpu_at] = 0;
  sb.back() = 3;  // has_params
  EXPECT_FALSE(Decode(sb, &sout).ok());
}

// A reply from a "store" (anyone listening on its port may answer) used to be read
// without checks: a short reply to Get or Add gave found/ok with an empty value or
// a zero. The client now checks the reply's layout and fails on a malformed one.
TEST(FuzzRegression, StoreClientChecksReplies) {
  store_wire::Reply r;
  EXPECT_FALSE(store_wire::ParseReply(store_wire::kGet, std::string(1, '\1'), &r));
  EXPECT_FALSE(store_wire::ParseReply(store_wire::kAdd, std::string("\1\0\0", 3), &r));
  EXPECT_FALSE(store_wire::ParseReply(store_wire::kSet, std::string(1, '\2'), &r));
  EXPECT_FALSE(store_wire::ParseReply(store_wire::kSet, std::string("\1x", 2), &r));
  EXPECT_FALSE(store_wire::ParseReply(store_wire::kGet, "", &r));
  ASSERT_TRUE(store_wire::ParseReply(store_wire::kGet, std::string(1, '\0'), &r));
  EXPECT_FALSE(r.ok);
}

}  // namespace
}  // namespace hvd
