// common/{sha256,net,config}: digest vectors, framed socket I/O with deadlines,
// the job-secret handshake, knob parsing.
#include <gtest/gtest.h>

#include <netdb.h>

#include <cstdlib>

#include "common/config.h"
#include "common/handshake.h"
#include "common/net.h"
#include "common/sha256.h"
#include "test_util.h"

namespace hvd {
namespace {

using hvd_test::SecondsSince;
using hvd_test::Watchdog;

std::string Pattern(size_t n) {
  std::string s(n, '\0');
  for (size_t i = 0; i < n; ++i) s[i] = static_cast<char>((i * 7 + 3) % 256);
  return s;
}

TEST(Sha256, KnownVectors) {
  EXPECT_EQ(Hex(Sha256("")), "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
  EXPECT_EQ(Hex(Sha256("abc")), "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
  EXPECT_EQ(Hex(Sha256("abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq")),
            "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1");
  EXPECT_EQ(Hex(Sha256(std::string(1000000, 'a'))),
            "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0");
  // Padding boundaries (values from Python's hashlib).
  const std::pair<size_t, const char*> cases[] = {
      {3, "6ab0dba1f4f1dfbb37b4f9eeb092c09fca4900ad32bdcd147d8dde35d6c87c35"},
      {55, "e7313d333c272e639f790978283f9eb392e843d0f29b7016828bb1daa4aac70b"},
      {56, "4324d65f3c103567f5589c710bc08f8523f929a9272e3af36fc968e52abc6c27"},
      {63, "81c80242132f230c3bd41b3e63bbcff16107339549214a99614ff26664625055"},
      {64, "39e3d7b6b5d075d37d053ad89b24b41bef4f3c29760c84447cab3f3be1882241"},
      {65, "aacca6ff74fdbb296d165a45cecfa04e5127bc008770fbbdd48006f2d2fae95e"},
      {119, "9ce7368e4daf32341631b492e80359dc9f594b48453cd0dd5bf0b19279cc177e"},
      {1000, "1e9bc38cbf860b9ec31918b065f9b52476c549a782e0e7990bed8ce3868d2371"},
  };
  for (const auto& c : cases) EXPECT_EQ(Hex(Sha256(Pattern(c.first))), c.second) << c.first;
  EXPECT_EQ(Sha256("x").size(), 32u);
}

// RFC 4231's test cases 1-4, 6 and 7 (case 5 truncates the output).
TEST(HmacSha256, Rfc4231Vectors) {
  std::string key4;
  for (int i = 1; i <= 25; ++i) key4.push_back(static_cast<char>(i));
  const std::string big_key(131, '\xaa');
  const struct {
    std::string key, data;
    const char* mac;
  } cases[] = {
      {std::string(20, '\x0b'), "Hi There",
       "b0344c61d8db38535ca8afceaf0bf12b881dc200c9833da726e9376c2e32cff7"},
      {"Jefe", "what do ya want for nothing?",
       "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843"},
      {std::string(20, '\xaa'), std::string(50, '\xdd'),
       "773ea91e36800e46854db8ebd09181a72959098b3ef8c122d9635514ced565fe"},
      {key4, std::string(50, '\xcd'),
       "82558a389a443c0ea4cc819899f2083a85f0faa3e578f8077a2e3ff46729665b"},
      {big_key, "Test Using Larger Than Block-Size Key - Hash Key First",
       "60e431591ee0b67f0d8a26aacbf5b77f8e0bc6213728c5140546040f0ee37f54"},
      {big_key,
       "This is a test using a larger than block-size key and a larger than block-size data. "
       "The key needs to be hashed before being used by the HMAC algorithm.",
       "9b09ffa71b942fcb27635fbcd5b0e944bfdc63644f0713938a7f51535c3a35e2"},
  };
  for (const auto& c : cases) EXPECT_EQ(Hex(HmacSha256(c.key, c.data)), c.mac) << c.data;
}

// A connected loopback pair: a.fd() <-> b.fd().
void Pair(Socket* a, Socket* b) {
  Socket listener;
  int port = 0;
  ASSERT_TRUE(Listen("127.0.0.1", 0, &listener, &port).ok());
  ASSERT_TRUE(Connect("127.0.0.1", port, 2.0, a).ok());
  ASSERT_TRUE(Accept(listener, 2.0, b).ok());
}

TEST(Net, FramesRoundTripLargeAndEmpty) {
  Watchdog wd(20, "Net.FramesRoundTripLargeAndEmpty");
  Socket a, b;
  ASSERT_NO_FATAL_FAILURE(Pair(&a, &b));
  TuneForData(a.fd());
  TuneForData(b.fd());
  std::string big = Pattern(3 << 20);
  Status send_st;
  std::thread t([&] {
    send_st = SendFrame(a.fd(), big, 5.0);
    if (send_st.ok()) send_st = SendFrame(a.fd(), "", 5.0);
  });
  std::string got, empty = "junk";
  Status r1 = RecvFrame(b.fd(), &got, 5.0);
  Status r2 = RecvFrame(b.fd(), &empty, 5.0);
  t.join();
  HVD_EXPECT_OK(send_st);
  HVD_EXPECT_OK(r1);
  HVD_EXPECT_OK(r2);
  EXPECT_EQ(got, big);
  EXPECT_EQ(empty, "");
}

TEST(Net, RecvTimesOut) {
  Watchdog wd(20, "Net.RecvTimesOut");
  Socket a, b;
  ASSERT_NO_FATAL_FAILURE(Pair(&a, &b));
  char buf[4];
  auto t0 = std::chrono::steady_clock::now();
  Status st = RecvAll(b.fd(), buf, 4, 0.3);
  double took = SecondsSince(t0);
  EXPECT_EQ(st.code(), StatusCode::kAborted);
  EXPECT_NE(st.message().find("timed out"), std::string::npos) << st.message();
  EXPECT_GE(took, 0.25);
  EXPECT_LT(took, 2.0);
}

TEST(Net, RecvAfterPeerCloseFails) {
  Watchdog wd(20, "Net.RecvAfterPeerCloseFails");
  Socket a, b;
  ASSERT_NO_FATAL_FAILURE(Pair(&a, &b));
  a.Close();
  std::string s;
  auto t0 = std::chrono::steady_clock::now();
  Status st = RecvFrame(b.fd(), &s, 5.0);
  EXPECT_EQ(st.code(), StatusCode::kAborted);
  EXPECT_LT(SecondsSince(t0), 1.0);
}

TEST(Net, ShutdownWakesABlockedRecv) {
  Watchdog wd(20, "Net.ShutdownWakesABlockedRecv");
  Socket a, b;
  ASSERT_NO_FATAL_FAILURE(Pair(&a, &b));
  Status st;
  std::thread t([&] {
    char c;
    st = RecvAll(b.fd(), &c, 1, 10.0);
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  auto t0 = std::chrono::steady_clock::now();
  b.Shutdown();
  t.join();
  EXPECT_FALSE(st.ok());
  EXPECT_LT(SecondsSince(t0), 2.0);
}

TEST(Net, CorruptFrameLengthRejected) {
  Watchdog wd(20, "Net.CorruptFrameLengthRejected");
  Socket a, b;
  ASSERT_NO_FATAL_FAILURE(Pair(&a, &b));
  uint64_t huge = ~0ull;
  HVD_ASSERT_OK(SendAll(a.fd(), &huge, 8, 1.0));
  std::string s;
  Status st = RecvFrame(b.fd(), &s, 1.0);
  EXPECT_EQ(st.code(), StatusCode::kAborted);
}

void Handshake(const std::string& server_secret, const std::string& client_secret,
               const std::string& tag, Status* server_st, Status* client_st, std::string* got_tag) {
  Socket a, b;
  ASSERT_NO_FATAL_FAILURE(Pair(&a, &b));
  std::thread t([&] { *client_st = ClientHandshake(a.fd(), client_secret, tag, 2.0); });
  *server_st = ServerHandshake(b.fd(), server_secret, 2.0, got_tag);
  t.join();
}

TEST(Net, HandshakeAcceptsTheSecretAndCarriesTheTag) {
  Watchdog wd(20, "Net.Handshake");
  Status s, c;
  std::string tag;
  ASSERT_NO_FATAL_FAILURE(Handshake("s3cret", "s3cret", "rank 7", &s, &c, &tag));
  HVD_EXPECT_OK(s);
  HVD_EXPECT_OK(c);
  EXPECT_EQ(tag, "rank 7");
  ASSERT_NO_FATAL_FAILURE(Handshake("", "", "", &s, &c, &tag));
  HVD_EXPECT_OK(s);
  HVD_EXPECT_OK(c);
  EXPECT_EQ(tag, "");
}

TEST(Net, HandshakeRejectsAWrongSecret) {
  Watchdog wd(20, "Net.HandshakeWrong");
  Status s, c;
  std::string tag = "untouched";
  ASSERT_NO_FATAL_FAILURE(Handshake("right", "wrong", "3", &s, &c, &tag));
  EXPECT_EQ(s.code(), StatusCode::kAborted);
  EXPECT_EQ(c.code(), StatusCode::kAborted);
  EXPECT_NE(c.message().find("secret"), std::string::npos) << c.message();
  EXPECT_NE(s.message().find("secret"), std::string::npos) << s.message();
  EXPECT_EQ(tag, "untouched");
}

// A port of `host` that was listened on and is closed now (connections are refused).
int ClosedPort(const std::string& host) {
  Socket l;
  int port = 0;
  EXPECT_TRUE(Listen(host, 0, &l, &port).ok()) << host;
  return port;
}

TEST(Net, ConnectRefusedRetriesUntilTimeout) {
  Watchdog wd(20, "Net.ConnectRefused");
  const int port = ClosedPort("127.0.0.1");
  Socket s;
  auto t0 = std::chrono::steady_clock::now();
  Status st = Connect("127.0.0.1", port, 0.3, &s);
  EXPECT_FALSE(st.ok());
  EXPECT_FALSE(s.valid());
  EXPECT_GE(SecondsSince(t0), 0.25);
  EXPECT_LT(SecondsSince(t0), 2.0);
  EXPECT_FALSE(Connect("no-such-host.invalid", port, 0.1, &s).ok());
}

// A connected pair over host (listening there, connecting to `dial`), with a frame
// each way.
void ExpectPairWorks(const std::string& host, const std::string& dial) {
  Socket l;
  int port = 0;
  ASSERT_TRUE(Listen(host, 0, &l, &port).ok()) << host;
  ASSERT_GT(port, 0);
  Socket c, a;
  ASSERT_TRUE(Connect(dial, port, 5.0, &c).ok()) << dial;
  ASSERT_TRUE(Accept(l, 5.0, &a).ok());
  ASSERT_TRUE(SendFrame(c.fd(), "ping", 5.0).ok());
  std::string got;
  ASSERT_TRUE(RecvFrame(a.fd(), &got, 5.0, 1 << 20).ok());
  EXPECT_EQ(got, "ping");
}

// Whether this machine has IPv6 loopback (a kernel or container may have IPv6 off).
bool HaveIpv6Loopback() {
  Socket l;
  int port = 0;
  return Listen("::1", 0, &l, &port).ok();
}

TEST(Net, Ipv6LoopbackPlainAndBracketed) {
  if (!HaveIpv6Loopback()) GTEST_SKIP() << "no IPv6 loopback here";
  Watchdog wd(20, "Net.Ipv6");
  ExpectPairWorks("::1", "::1");
  ExpectPairWorks("[::1]", "::1");
  ExpectPairWorks("::1", "[::1]");
  Socket l;
  int port = 0;
  ASSERT_TRUE(Listen("::1", 0, &l, &port).ok());
  Socket c, a;
  ASSERT_TRUE(Connect("::1", port, 5.0, &c).ok());
  ASSERT_TRUE(Accept(l, 5.0, &a).ok());
  // The mesh listens on the address it reaches the store from, and peers dial it.
  EXPECT_EQ(LocalAddress(c), "::1");
  EXPECT_EQ(PeerAddress(a).rfind("[::1]:", 0), 0u) << PeerAddress(a);
}

TEST(Net, NamesWithBothFamiliesStayOnIpv4) {
  Watchdog wd(20, "Net.BothFamilies");
  // localhost may resolve to ::1 and 127.0.0.1: listening there binds IPv4, so that
  // a peer dialling 127.0.0.1 (as before IPv6) still gets through...
  Socket l;
  int port = 0;
  ASSERT_TRUE(Listen("localhost", 0, &l, &port).ok());
  Socket c, a;
  ASSERT_TRUE(Connect("127.0.0.1", port, 5.0, &c).ok());
  ASSERT_TRUE(Accept(l, 5.0, &a).ok());
  EXPECT_EQ(LocalAddress(a), "127.0.0.1");
  // ...and dialling a name tries each of its addresses: a listener on ::1 only is
  // reached through localhost when this machine's localhost has ::1 as well.
  addrinfo hints{};
  hints.ai_family = AF_INET6;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  const bool has_v6 = ::getaddrinfo("localhost", "1", &hints, &res) == 0 && res != nullptr;
  if (res != nullptr) ::freeaddrinfo(res);
  if (has_v6 && HaveIpv6Loopback()) ExpectPairWorks("::1", "localhost");
}

TEST(Net, RefusedOnEveryAddressFailsAtOnceWithoutRetry) {
  if (!HaveIpv6Loopback()) GTEST_SKIP() << "no IPv6 loopback here";
  Watchdog wd(20, "Net.RefusedAll");
  const int port = ClosedPort("::1");
  Socket s;
  auto t0 = std::chrono::steady_clock::now();
  EXPECT_FALSE(Connect("::1", port, 5.0, &s, /*retry_refused=*/false).ok());
  EXPECT_LT(SecondsSince(t0), 1.0);
}

TEST(Config, FromEnvDefaultsAndOverrides) {
  const char* vars[] = {"HOROVOD_FUSION_THRESHOLD", "HOROVOD_CYCLE_TIME", "HOROVOD_CACHE_CAPACITY",
                        "HOROVOD_LOG_LEVEL"};
  for (const char* v : vars) unsetenv(v);
  std::string err;
  Config d = Config::FromEnv(&err);
  EXPECT_EQ(err, "");
  EXPECT_EQ(d.fusion_threshold_bytes, 64 * 1024 * 1024);
  EXPECT_EQ(d.cache_capacity, 1024);
  EXPECT_EQ(d.log_level, "warning");

  setenv("HOROVOD_FUSION_THRESHOLD", "123", 1);
  setenv("HOROVOD_CYCLE_TIME", "2.5", 1);
  setenv("HOROVOD_CACHE_CAPACITY", "12abc", 1);
  setenv("HOROVOD_LOG_LEVEL", "debug", 1);
  err.clear();
  Config c = Config::FromEnv(&err);
  EXPECT_EQ(c.fusion_threshold_bytes, 123);
  EXPECT_EQ(c.cycle_time_ms, 2.5);
  EXPECT_EQ(c.cache_capacity, 1024) << "an unparsable value keeps the default";
  EXPECT_EQ(c.log_level, "debug");
  EXPECT_NE(err.find("HOROVOD_CACHE_CAPACITY"), std::string::npos) << err;
  for (const char* v : vars) unsetenv(v);
}

}  // namespace
}  // namespace hvd
