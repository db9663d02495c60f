// transport/tcp_transport: the mesh listener under abuse. Its job-secret handshakes
// run in a bounded HandshakeQueue (common/net.h): connections that never answer
// their nonce are capped at max(64, 2 * size), pushed out by newer ones and dropped
// at their deadline; real peers still get in promptly; rejections are logged as a
// count per interval; a hello must be a rank, exactly.
#include <gtest/gtest.h>

#include <poll.h>
#include <sys/socket.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <thread>

#include "common/handshake.h"
#include "common/net.h"
#include "common/sha256.h"
#include "test_util.h"
#include "transport/tcp_transport.h"

namespace hvd {
namespace {

using hvd_test::MakeWorld;
using hvd_test::RunRanks;
using hvd_test::SecondsSince;
using hvd_test::Watchdog;
using hvd_test::World;

int MeshPort(const World& w, int rank) {
  std::string addr;
  EXPECT_TRUE(w.server->Get("job/addr/" + std::to_string(rank), &addr));
  return std::atoi(addr.c_str() + addr.rfind(':') + 1);
}

// A client connection that never answers: what it has seen of the server.
struct Idle {
  Socket sock;
  size_t received = 0;  // bytes of the nonce frame (24 when complete)
  bool closed = false;
};

// Reads what each idle connection got, without blocking.
void Observe(std::vector<Idle>* idle) {
  char buf[64];
  for (Idle& c : *idle) {
    while (!c.closed) {
      ssize_t n = ::recv(c.sock.fd(), buf, sizeof(buf), MSG_DONTWAIT);
      if (n > 0) {
        c.received += static_cast<size_t>(n);
      } else {
        if (n == 0 || (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)) c.closed = true;
        break;
      }
    }
  }
}

// Connections the server holds in its handshake: sent a nonce, not closed yet.
int Pending(const std::vector<Idle>& idle) {
  int n = 0;
  for (const Idle& c : idle) n += c.received > 0 && !c.closed;
  return n;
}

int CountOf(const std::string& text, const std::string& what) {
  int n = 0;
  for (size_t at = text.find(what); at != std::string::npos; at = text.find(what, at + 1)) ++n;
  return n;
}

// Issue #21: 300 connections that never answer their nonce wait at rank 0 of a
// 4-rank mesh. Rank 0 accepts them while it runs collectives; at most 64 are kept
// in the handshake at once (before: all 300, each until HOROVOD_START_TIMEOUT); rank
// 3, which has no socket to rank 0 yet, still joins an alltoall promptly; the rest
// are dropped at the handshake deadline; and the rejections make a few log lines,
// not 300.
TEST(TcpListener, IdleConnectionsCannotFillTheHandshakeQueue) {
  Watchdog wd(90, "TcpListener.IdleConnectionsCannotFillTheHandshakeQueue");
  TcpOptions options = hvd_test::FastOptions();
  options.connect_timeout_s = 3;  // the mesh's handshake deadline: min(this, 5 s)
  hvd_test::StderrCapture capture;
  {
    World w;
    Status made = MakeWorld(4, options, &w);
    ASSERT_TRUE(made.ok()) << made.message();
    ASSERT_LT(w.transports[3]->open_connections(), 3) << "rank 3 already talks to rank 0";
    const int port = MeshPort(w, 0);
    std::vector<Idle> idle(300);
    for (Idle& c : idle) ASSERT_TRUE(Connect("127.0.0.1", port, 5, &c.sock).ok());

    // All ranks run an alltoall at once: rank 3's connection to rank 0 queues
    // behind the 300 in rank 0's backlog. Then they run allreduces (rank 0 accepts
    // meanwhile) until every idle connection has been accepted (got its nonce) and
    // the count has settled.
    std::atomic<bool> settled{false};
    int most_pending = 0;
    std::thread observer([&] {
      auto t0 = std::chrono::steady_clock::now();
      while (SecondsSince(t0) < 10) {
        Observe(&idle);
        int accepted = 0;
        for (const Idle& c : idle) accepted += c.received > 0 || c.closed;
        if (accepted == static_cast<int>(idle.size())) break;
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(200));  // closes in flight
      Observe(&idle);
      most_pending = Pending(idle);
      settled = true;
    });
    std::vector<double> alltoall_s(4);
    RunRanks(4, [&](int r) {
      auto t0 = std::chrono::steady_clock::now();
      std::vector<char> send(4 * 8, static_cast<char>('a' + r)), recv(4 * 8);
      HVD_EXPECT_OK(w.transports[r]->Alltoallv(send.data(), std::vector<size_t>(4, 8), recv.data(),
                                               std::vector<size_t>(4, 8)));
      for (int p = 0; p < 4; ++p) EXPECT_EQ(recv[p * 8], 'a' + p) << "rank " << r;
      alltoall_s[r] = SecondsSince(t0);
      HVD_EXPECT_OK(hvd_test::AllreduceUntil(w, r, settled));
    });
    observer.join();
    EXPECT_LE(most_pending, 64) << "connections held in rank 0's handshake at once";
    EXPECT_GT(most_pending, 0);
    for (int r = 0; r < 4; ++r) {
      EXPECT_LT(alltoall_s[r], 2.0) << "rank " << r << " waited behind the idle connections";
    }

    // The kept ones are dropped at the deadline (3 s) while rank 0 is in Run().
    std::atomic<bool> all_closed{false};
    auto t0 = std::chrono::steady_clock::now();
    std::thread closer([&] {
      while (SecondsSince(t0) < 10 && Pending(idle) > 0) {
        Observe(&idle);
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
      }
      all_closed = true;
    });
    RunRanks(4, [&](int r) { HVD_EXPECT_OK(hvd_test::AllreduceUntil(w, r, all_closed)); });
    closer.join();
    EXPECT_EQ(Pending(idle), 0);
    EXPECT_LT(SecondsSince(t0), 6.0);
    w.transports.clear();  // logs the last count
  }
  const std::string err = capture.Take();
  const int lines = CountOf(err, "failed the job-secret handshake");
  EXPECT_GE(lines, 1) << err;
  EXPECT_LE(lines, 3) << err;
  EXPECT_EQ(CountOf(err, "rank 0 (TCP mesh): rejected a connection that failed"), 1) << err;
}

// A connection with the secret whose hello is not exactly a rank (this used
// std::atoi: "1x" and " 1" passed as rank 1, digits past INT_MAX were undefined
// behaviour) is answered "Y", then dropped; the mesh keeps working.
TEST(TcpListener, HelloMustBeExactlyARank) {
  Watchdog wd(60, "TcpListener.HelloMustBeExactlyARank");
  World w;
  Status made = MakeWorld(2, hvd_test::FastOptions(), &w);
  ASSERT_TRUE(made.ok()) << made.message();
  const int port = MeshPort(w, 0);
  std::atomic<bool> done{false};
  std::thread ranks(
      [&] { RunRanks(2, [&](int r) { HVD_EXPECT_OK(hvd_test::AllreduceUntil(w, r, done)); }); });
  hvd_test::StderrCapture capture;
  // No ASSERT until `ranks` is joined.
  for (const char* hello : {"1x", " 1", "+1", "01", "99999999999999999999", "", "-1", "0"}) {
    Socket s;
    Status st = Connect("127.0.0.1", port, 5, &s);
    if (st.ok()) st = ClientHandshake(s.fd(), hvd_test::kSecret, hello, 5);
    EXPECT_TRUE(st.ok()) << "hello '" << hello << "': " << st.message();
    if (!st.ok()) break;
    char c;
    pollfd p{s.fd(), POLLIN, 0};
    EXPECT_EQ(::poll(&p, 1, 5000), 1) << "the connection with hello '" << hello << "' stayed";
    EXPECT_EQ(::recv(s.fd(), &c, 1, MSG_DONTWAIT), 0) << hello;
  }
  done = true;
  ranks.join();
  const std::string err = capture.Take();
  EXPECT_EQ(CountOf(err, "dropped an unexpected connection"), 8) << err;
  EXPECT_EQ(w.transports[0]->open_connections(), 1);
}

}  // namespace
}  // namespace hvd
