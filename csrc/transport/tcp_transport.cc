// The TCP transport's connections and its transfer engine (Run). The collective
// algorithms built on Run are in tcp_collectives.cc.
#include "transport/tcp_transport.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/socket.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <deque>
#include <mutex>

#include "common/config.h"
#include "common/logging.h"
#include "transport/shm.h"

namespace hvd {
namespace {

std::string PeerLost(int peer, const std::string& why) {
  return "connection to rank " + std::to_string(peer) + " lost (" + why +
         "); the peer process probably died";
}

double Since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

}  // namespace

// State shared by a mesh and its subset views; only the background thread touches
// it, except Abort(), which takes mu to shut sockets down.
struct TcpTransport::Mesh {
  StoreClient* store = nullptr;  // borrowed
  std::string prefix, secret;
  int rank = 0, size = 1;
  double connect_timeout_s = 30;
  Socket listener;
  std::vector<Socket> sockets;  // by mesh rank; invalid until connected
  // Peers whose socket hung up while we had nothing to exchange with them (a rank
  // that finished the last cycle and left, or one that died): polled again only
  // for a transfer, which reads what they sent before leaving, then fails.
  std::vector<bool> hung_up;
  // The first peer seen hanging up (-1: none). When a peer dies, the ranks that
  // notice first abort and close their sockets too; a rank that then loses one of
  // those names the first one instead, the rank that most likely died.
  int first_hung_up = -1;

  // A connection accepted on the listener whose job-secret handshake is under way:
  // the nonce went out, the reply frame is being read without blocking.
  struct Incoming {
    Socket sock;
    std::string nonce, in;
    Clock::time_point deadline;
  };
  std::vector<Incoming> incoming;
  Clock::time_point last_tended{};  // TendListener()'s last poll

  std::mutex mu;                     // guards installing sockets against Abort()
  std::atomic<bool> aborted{false};  // set under mu; Run() checks it every round

  Status Install(int peer, Socket s) {
    std::lock_guard<std::mutex> lock(mu);
    if (aborted) return AbortedStatus();
    TuneForData(s.fd());
    sockets[peer] = std::move(s);
    return Status::Ok();
  }

  static Status AbortedStatus() {
    return Status::Aborted("the TCP transport was aborted (shutting down after an error)");
  }

  // Accepts every connection waiting on the listener and sends each its nonce.
  void AcceptWaiting() {
    while (true) {
      int fd = ::accept4(listener.fd(), nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
      if (fd < 0) return;  // EAGAIN (none left) or an error seen on the next poll
      Incoming c;
      c.sock = Socket(fd);
      c.nonce = HandshakeNonce();
      c.deadline = Clock::now() + std::chrono::milliseconds(
                                      static_cast<int64_t>(connect_timeout_s * 1000));
      if (SendFrame(fd, c.nonce, 1.0).ok()) incoming.push_back(std::move(c));
    }
  }

  // Reads what incoming[i] has sent; when its reply is complete, answers it and
  // installs the socket (a peer) or drops it. Returns false once incoming[i] is
  // finished (the caller erases it).
  bool Advance(size_t i) {
    Incoming& c = incoming[i];
    char buf[512];
    ssize_t n = ::recv(c.sock.fd(), buf, sizeof(buf), MSG_DONTWAIT);
    if (n == 0 || (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)) {
      return false;  // the client went away
    }
    if (n > 0) c.in.append(buf, static_cast<size_t>(n));
    if (c.in.size() < 8) return true;
    uint64_t len = 0;
    std::memcpy(&len, c.in.data(), 8);
    bool ok = len <= kMaxHandshakeFrame;
    if (ok && c.in.size() < 8 + len) return true;
    std::string tag;
    ok = ok && HandshakeReplyValid(secret, c.nonce, c.in.substr(8, len), &tag);
    SendFrame(c.sock.fd(), ok ? "Y" : "N", 1.0);
    if (!ok) {
      HVD_LOG(kWarning) << "rejected a connection from " << PeerAddress(c.sock)
                        << " that failed the job-secret handshake";
      return false;
    }
    int peer = std::atoi(tag.c_str());
    if (peer <= rank || peer >= size || sockets[peer].valid()) {
      HVD_LOG(kWarning) << "dropped an unexpected connection (hello '" << tag << "')";
      return false;
    }
    Install(peer, std::move(c.sock));
    return false;
  }

  void DropExpired() {
    const auto now = Clock::now();
    auto expired = [&](const Incoming& c) {
      if (now <= c.deadline) return false;
      HVD_LOG(kWarning) << "dropped a connection from " << PeerAddress(c.sock)
                        << " that did not finish the job-secret handshake in time";
      return true;
    };
    incoming.erase(std::remove_if(incoming.begin(), incoming.end(), expired), incoming.end());
  }
};

TcpTransport::TcpTransport(int rank, int size, TcpOptions options, std::shared_ptr<Mesh> mesh)
    : rank_(rank), size_(size), options_(options), mesh_(std::move(mesh)), global_(size) {
  for (int r = 0; r < size; ++r) global_[r] = r;
}

TcpTransport::~TcpTransport() = default;

Status TcpTransport::Create(StoreClient* store, const std::string& prefix, int rank, int size,
                            const std::string& secret, const TcpOptions& options,
                            std::unique_ptr<TcpTransport>* out) {
  auto mesh = std::make_shared<Mesh>();
  mesh->store = store;
  mesh->prefix = prefix;
  mesh->secret = secret;
  mesh->rank = rank;
  mesh->size = size;
  mesh->connect_timeout_s = options.connect_timeout_s;
  mesh->sockets.resize(size);
  mesh->hung_up.assign(size, false);
  std::unique_ptr<TcpTransport> t(new TcpTransport(rank, size, options, mesh));
  if (size > 1) {
    // Listen on the address we reach the store from: peers reach us the same way.
    std::string host = store->LocalAddress();
    int port = 0;
    HVD_RETURN_IF_ERROR(Listen(host, 0, &mesh->listener, &port));
    ::fcntl(mesh->listener.fd(), F_SETFL, ::fcntl(mesh->listener.fd(), F_GETFL, 0) | O_NONBLOCK);
    HVD_RETURN_IF_ERROR(store->Set(prefix + "/addr/" + std::to_string(rank),
                                   host + ":" + std::to_string(port)));
    // A barrier along the control tree: init() returns once every rank is here.
    // Waiting on a peer here is waiting for the slowest rank to arrive, so the
    // start timeout applies on top of the I/O one.
    t->options_.io_timeout_s = options.connect_timeout_s + options.io_timeout_s;
    // It carries each rank's settings to rank 0, and rank 0's verdict back.
    std::vector<std::string> settings;
    std::string verdict;
    Status st = t->Gather(options.settings, &settings);
    if (st.ok() && rank == 0) verdict = SettingsDisagreement(settings);
    if (st.ok()) st = t->Bcast(&verdict);
    if (st.ok() && !verdict.empty()) st = Status::InvalidArgument(verdict);
    t->options_.io_timeout_s = options.io_timeout_s;
    if (!st.ok()) {
      // The rank that saw the cause (a rank that never came) leaves it in the
      // store before its sockets close; the ranks that only see those sockets
      // close report the cause instead of "connection lost".
      const std::string key = prefix + "/init_error";
      if (st.message().find("did not reach the rendezvous") != std::string::npos) {
        store->Set(key, "rank " + std::to_string(rank) + ": " + st.message());
      }
      t->Abort();
      std::string cause;
      bool found = false;
      if (store->TryGet(key, &cause, &found).ok() && found) return Status::Aborted(cause);
      return st;
    }
    if (options.hierarchical_allreduce != 0 || options.hierarchical_allgather != 0) {
      HVD_RETURN_IF_ERROR(t->SetUpHierarchy(secret, prefix));
    }
  }
  *out = std::move(t);
  return Status::Ok();
}

void TcpTransport::Abort() {
  std::lock_guard<std::mutex> lock(mesh_->mu);
  mesh_->aborted = true;
  for (auto& s : mesh_->sockets) s.Shutdown();
  mesh_->listener.Shutdown();
  if (local_) local_->Abort();
}

int TcpTransport::open_connections() const {
  int n = 0;
  for (const auto& s : mesh_->sockets) n += s.valid() ? 1 : 0;
  return n;
}

int TcpTransport::Fd(int r) const { return mesh_->sockets[global_[r]].fd(); }

std::unique_ptr<TcpTransport> TcpTransport::SubsetView(const std::vector<int>& members) const {
  int me = -1;
  for (size_t i = 0; i < members.size(); ++i) {
    if (members[i] == rank_) me = static_cast<int>(i);
  }
  if (me < 0) return nullptr;
  std::unique_ptr<TcpTransport> t(
      new TcpTransport(me, static_cast<int>(members.size()), options_, mesh_));
  for (size_t i = 0; i < members.size(); ++i) t->global_[i] = global_[members[i]];
  return t;
}

Status TcpTransport::ConnectLower(const std::vector<int>& peers) {
  Mesh& m = *mesh_;
  const double timeout = m.connect_timeout_s;
  for (int p : peers) {
    if (m.aborted) return Mesh::AbortedStatus();
    const int g = global_[p];
    if (m.sockets[g].valid()) continue;
    std::string addr;
    Status st = m.store->Get(m.prefix + "/addr/" + std::to_string(g), timeout, &addr);
    if (!st.ok()) {
      return Status::Aborted("rank " + std::to_string(g) +
                             " did not reach the rendezvous in time (HOROVOD_START_TIMEOUT=" +
                             std::to_string(timeout) + " s): " + st.message());
    }
    size_t colon = addr.rfind(':');
    Socket s;
    st = Connect(addr.substr(0, colon), std::stoi(addr.substr(colon + 1)), timeout, &s,
                 /*retry_refused=*/false);
    if (!st.ok()) return Status::Aborted(PeerLost(g, st.message()));
    HVD_RETURN_IF_ERROR(ClientHandshake(s.fd(), m.secret, std::to_string(m.rank), timeout));
    HVD_RETURN_IF_ERROR(m.Install(g, std::move(s)));
  }
  return Status::Ok();
}

// Drives all transfers concurrently with poll(). The per-peer queues keep the
// order of transfers that share a direction; on_done callbacks (used to reduce a
// chunk as soon as it lands) run on this thread while other chunks are in flight.
// Peers without a socket yet: lower ranks are connected first; higher ones
// connect to us, and are accepted and authenticated inside the loop.
// Run() accepts and authenticates whoever connects; while the control plane goes
// through shared memory a rank may not call it for a long time, so the control
// operations call this instead: one poll that does not wait, at most every 10 ms.
void TcpTransport::TendListener() {
  Mesh& m = *mesh_;
  const auto now = Clock::now();
  if (now - m.last_tended < std::chrono::milliseconds(10) || m.aborted) return;
  m.last_tended = now;
  m.DropExpired();
  std::vector<pollfd> fds;
  for (const auto& c : m.incoming) fds.push_back(pollfd{c.sock.fd(), POLLIN, 0});
  if (m.listener.valid()) fds.push_back(pollfd{m.listener.fd(), POLLIN, 0});
  if (fds.empty() || ::poll(fds.data(), fds.size(), 0) <= 0) return;
  std::vector<size_t> finished;
  for (size_t k = 0; k < m.incoming.size() && k < fds.size(); ++k) {
    if (fds[k].revents != 0 && !m.Advance(k)) finished.push_back(k);
  }
  std::sort(finished.rbegin(), finished.rend());
  for (size_t k : finished) m.incoming.erase(m.incoming.begin() + static_cast<long>(k));
  // Errors on the listener (shut down by Abort()) surface in the next Run().
  if (m.listener.valid() && (fds.back().revents & POLLIN)) m.AcceptWaiting();
}

Status TcpTransport::Run(std::vector<Xfer>& xs) {
  Mesh& m = *mesh_;
  std::vector<std::deque<Xfer*>> sendq(size_), recvq(size_);
  std::vector<int> lower;
  size_t pending = 0;
  for (auto& x : xs) {
    if (x.len == 0) {
      if (x.on_done) x.on_done();
      continue;
    }
    (x.send ? sendq : recvq)[x.peer].push_back(&x);
    ++pending;
    if (Fd(x.peer) < 0 && global_[x.peer] < m.rank) lower.push_back(x.peer);
  }
  if (pending == 0) return Status::Ok();
  std::sort(lower.begin(), lower.end());
  lower.erase(std::unique(lower.begin(), lower.end()), lower.end());
  HVD_RETURN_IF_ERROR(ConnectLower(lower));

  const auto start = Clock::now();
  auto last_progress = start;
  std::vector<pollfd> fds;
  std::vector<int> who;  // >= 0: a peer; -1: the listener; <= -2: incoming[-2 - who]
  while (pending > 0) {
    if (m.aborted) return Mesh::AbortedStatus();
    fds.clear();
    who.clear();
    for (int p = 0; p < size_; ++p) {
      if (p == rank_ || Fd(p) < 0) continue;
      short ev = (sendq[p].empty() ? 0 : POLLOUT) | (recvq[p].empty() ? 0 : POLLIN);
      if (ev == 0 && m.hung_up[global_[p]]) continue;
      // Peers we exchange nothing with are watched for hang-ups only (their early
      // data for a later exchange must stay unread).
      fds.push_back(pollfd{Fd(p), static_cast<short>(ev | POLLRDHUP), 0});
      who.push_back(p);
    }
    if (m.listener.valid()) {
      fds.push_back(pollfd{m.listener.fd(), POLLIN, 0});
      who.push_back(-1);
    }
    for (size_t i = 0; i < m.incoming.size(); ++i) {
      fds.push_back(pollfd{m.incoming[i].sock.fd(), POLLIN, 0});
      who.push_back(-2 - static_cast<int>(i));
    }
    int rc = ::poll(fds.data(), fds.size(), 200);
    if (rc < 0) {
      if (errno == EINTR) continue;
      return Status::Aborted(std::string("poll failed: ") + std::strerror(errno));
    }
    // Deadlines are checked every round: a stream of events on other sockets
    // (a client knocking on the listener) must not hide a peer that is stuck.
    m.DropExpired();
    for (int p = 0; p < size_; ++p) {
      if (Fd(p) < 0 && (!sendq[p].empty() || !recvq[p].empty()) &&
          Since(start) > m.connect_timeout_s) {
        return Status::Aborted("rank " + std::to_string(global_[p]) +
                               " did not reach the rendezvous within " +
                               std::to_string(m.connect_timeout_s) +
                               " s (HOROVOD_START_TIMEOUT): it never started, or died");
      }
    }
    double idle = Since(last_progress);
    if (idle > options_.io_timeout_s) {
      for (int p = 0; p < size_; ++p) {
        if (Fd(p) >= 0 && (!sendq[p].empty() || !recvq[p].empty())) {
          return Status::Aborted("rank " + std::to_string(global_[p]) + " made no progress for " +
                                 std::to_string(idle) +
                                 " s (HOROVOD_TCP_TIMEOUT); treating it as lost");
        }
      }
    }
    if (rc == 0) continue;
    for (size_t i = 0; i < fds.size(); ++i) {
      if (who[i] >= 0 && (fds[i].revents & (POLLRDHUP | POLLHUP | POLLERR)) &&
          m.first_hung_up < 0) {
        m.first_hung_up = global_[who[i]];
      }
    }
    // Which rank to blame when the connection to peer p fails. A rank that loses a
    // peer leaves a note in the store (under this mesh's prefix) naming the rank it
    // blames, before it aborts and closes its own connections; so a rank that then
    // loses that one names the rank that died, not the messenger.
    auto lost = [&](int p, const std::string& why) {
      const int g = global_[p];
      int blamed = g;
      std::string detail = why;
      std::string note;
      bool found = false;
      if (m.store != nullptr &&
          m.store->TryGet(m.prefix + "/lost/" + std::to_string(g), &note, &found).ok() &&
          found) {
        blamed = std::atoi(note.c_str());
        detail = "rank " + std::to_string(g) + " lost it first and closed; then " + why;
      } else if (m.first_hung_up >= 0 && m.first_hung_up != g) {
        blamed = m.first_hung_up;
        detail = "it hung up first; then rank " + std::to_string(g) + ": " + why;
      }
      if (m.store != nullptr) {
        m.store->Set(m.prefix + "/lost/" + std::to_string(global_[rank_]),
                     std::to_string(blamed));
      }
      return Status::Aborted(PeerLost(blamed, detail));
    };
    std::vector<size_t> finished;  // incoming handshakes done this round
    for (size_t i = 0; i < fds.size(); ++i) {
      short re = fds[i].revents;
      if (re == 0) continue;
      if (who[i] == -1) {
        if (re & (POLLERR | POLLHUP | POLLNVAL)) return Mesh::AbortedStatus();  // shut down
        m.AcceptWaiting();
        continue;
      }
      if (who[i] <= -2) {
        size_t k = static_cast<size_t>(-2 - who[i]);
        if (!m.Advance(k)) finished.push_back(k);
        continue;
      }
      int p = who[i];
      if ((re & POLLRDHUP) && recvq[p].empty() && !sendq[p].empty()) {
        return lost(p, "closed by the other side");  // it will never read what we send
      }
      if (sendq[p].empty() && recvq[p].empty()) {
        // Not an error by itself: after the final cycle ranks leave at different
        // times. If the peer died, whoever waits on it fails and aborts, and the
        // failure reaches us through the peers we do wait on.
        if (re & (POLLRDHUP | POLLHUP | POLLERR)) m.hung_up[global_[p]] = true;
        continue;
      }
      if ((re & (POLLIN | POLLERR | POLLHUP)) && !recvq[p].empty()) {
        while (!recvq[p].empty()) {
          Xfer* x = recvq[p].front();
          ssize_t n = ::recv(fds[i].fd, x->buf + x->done, x->len - x->done, MSG_DONTWAIT);
          if (n == 0) return lost(p, "closed by the other side");
          if (n < 0) {
            if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) break;
            return lost(p, std::strerror(errno));
          }
          x->done += static_cast<size_t>(n);
          last_progress = Clock::now();
          if (x->done < x->len) continue;
          if (x->on_done) x->on_done();
          recvq[p].pop_front();
          --pending;
        }
      }
      if ((re & (POLLOUT | POLLERR | POLLHUP)) && !sendq[p].empty()) {
        while (!sendq[p].empty()) {
          Xfer* x = sendq[p].front();
          ssize_t n = ::send(fds[i].fd, x->buf + x->done, x->len - x->done,
                             MSG_DONTWAIT | MSG_NOSIGNAL);
          if (n < 0) {
            if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) break;
            return lost(p, std::strerror(errno));
          }
          x->done += static_cast<size_t>(n);
          last_progress = Clock::now();
          if (x->done < x->len) continue;
          if (x->on_done) x->on_done();
          sendq[p].pop_front();
          --pending;
        }
      } else if ((re & (POLLERR | POLLHUP)) && recvq[p].empty()) {
        return lost(p, "socket hung up");
      }
    }
    std::sort(finished.rbegin(), finished.rend());
    for (size_t k : finished) m.incoming.erase(m.incoming.begin() + static_cast<long>(k));
  }
  return Status::Ok();
}

}  // namespace hvd
