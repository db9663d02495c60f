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
#include <thread>

#include "common/config.h"
#include "common/handshake.h"
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

// The listener's handshake queue holds max(this, 2 * size) connections, and each
// has min(this timeout, HOROVOD_START_TIMEOUT) to send its reply: a peer answers
// its nonce within a round trip.
constexpr size_t kMinPendingHandshakes = 64;
constexpr double kHandshakeTimeout = 5.0;
constexpr double kWatchPeriodS = 0.25;  // Mesh::Watch()

// A peer's hello: its rank, in decimal, and nothing else.
bool ParseRank(const std::string& tag, int* rank) {
  if (tag.empty() || tag.size() > 9 || (tag.size() > 1 && tag[0] == '0')) return false;
  int v = 0;
  for (char c : tag) {
    if (c < '0' || c > '9') return false;
    v = v * 10 + (c - '0');
  }
  *rank = v;
  return true;
}

// At most 64 bytes of `s` for a log line, non-printable bytes as '?'.
std::string Printable(const std::string& s) {
  std::string out = s.substr(0, 64);
  for (char& c : out) {
    if (c < 0x20 || c > 0x7e) c = '?';
  }
  return s.size() > 64 ? out + "..." : out;
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

  // Connections accepted on the listener whose job-secret handshake is under way
  // (bounded; see Create). Null while size == 1.
  std::unique_ptr<HandshakeQueue> handshakes;
  Clock::time_point last_tended{};  // TendListener()'s last poll

  // While Create() sets the mesh up: a store key whose appearance ends the
  // rendezvous at once with its value as the error (<prefix>/init_error: the
  // elastic driver writes it when a member died before reaching the rendezvous, so
  // the others need not wait for HOROVOD_START_TIMEOUT). Empty afterwards.
  std::string watch_key;
  Clock::time_point last_watched{};

  // Looks at watch_key at most every kWatchPeriodS.
  Status Watch() {
    if (watch_key.empty() || Since(last_watched) < kWatchPeriodS) return Status::Ok();
    last_watched = Clock::now();
    std::string cause;
    bool found = false;
    if (store->TryGet(watch_key, &cause, &found).ok() && found) return Status::Aborted(cause);
    return Status::Ok();
  }

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

  // HandshakeQueue::Done: a connection that proved the secret. Its hello must name
  // a higher rank that has no socket yet (the higher rank of a pair connects).
  void Authenticated(Socket sock, const std::string& tag) {
    int peer = -1;
    if (!ParseRank(tag, &peer) || peer <= rank || peer >= size || sockets[peer].valid()) {
      HVD_LOG(kWarning) << "rank " << rank << ": dropped an unexpected connection from "
                        << PeerAddress(sock) << " (hello '" << Printable(tag) << "')";
      return;
    }
    (void)Install(peer, std::move(sock));  // fails only once aborted; Run() reports that
  }

  // One round of the handshakes for a poll() whose fds end with the queue's (from
  // index `first`); `listener_ready` if the listener was readable.
  void TendHandshakes(const pollfd* first, bool listener_ready) {
    const HandshakeQueue::Done done = [this](Socket s, const std::string& tag) {
      Authenticated(std::move(s), tag);
    };
    handshakes->Advance(first, done);
    if (listener_ready) handshakes->Accept(listener);
    handshakes->Expire(done);
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
  mesh->watch_key = prefix + "/init_error";
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
    // Honest peers all fit in the handshake queue at once; a flood of connections
    // that never prove the secret pushes out its own oldest and cannot grow it.
    HandshakeQueueOptions hs;
    hs.max_pending = std::max<size_t>(kMinPendingHandshakes, 2 * static_cast<size_t>(size));
    hs.timeout_s = std::min(options.connect_timeout_s, kHandshakeTimeout);
    hs.who = "rank " + std::to_string(rank) + " (TCP mesh)";
    mesh->handshakes = std::make_unique<HandshakeQueue>(secret, hs);
    HVD_RETURN_IF_ERROR(
        store->Set(prefix + "/addr/" + std::to_string(rank), host + ":" + std::to_string(port)));
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
    mesh->watch_key.clear();
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
    bool found = false;
    const auto waited = Clock::now();
    while (!found) {  // in slices while the rendezvous is watched (Mesh::Watch)
      HVD_RETURN_IF_ERROR(m.Watch());
      const double left = std::max(timeout - Since(waited), 0.0);
      Status st =
          m.store->Fetch(m.prefix + "/addr/" + std::to_string(g),
                         m.watch_key.empty() ? left : std::min(left, kWatchPeriodS), &addr, &found);
      if (!st.ok() || (!found && left <= 0.0)) {
        return Status::Aborted("rank " + std::to_string(g) +
                               " did not reach the rendezvous in time (HOROVOD_START_TIMEOUT=" +
                               std::to_string(timeout) + " s)" +
                               (st.ok() ? std::string() : ": " + st.message()));
      }
    }
    const size_t colon = addr.rfind(':');
    const std::string host = addr.substr(0, colon);
    const int port = std::atoi(addr.c_str() + colon + 1);
    // A connection dropped before the verdict (the peer's handshake queue was
    // flooded and pushed it out) is tried again; a wrong secret fails at once.
    const auto t0 = Clock::now();
    while (true) {
      Socket s;
      Status st =
          Connect(host, port, std::max(timeout - Since(t0), 0.0), &s, /*retry_refused=*/false);
      if (!st.ok()) return Status::Aborted(PeerLost(g, st.message()));
      bool rejected = false;
      st = ClientHandshake(s.fd(), m.secret, std::to_string(m.rank),
                           std::max(timeout - Since(t0), 0.1), &rejected);
      if (st.ok()) {
        HVD_RETURN_IF_ERROR(m.Install(g, std::move(s)));
        break;
      }
      if (rejected || m.aborted || Since(t0) >= timeout) return st;
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
  }
  return Status::Ok();
}

// Run() accepts and authenticates whoever connects; while the control plane goes
// through shared memory a rank may not call it for a long time, so the control
// operations call this instead: one poll that does not wait, at most every 10 ms.
void TcpTransport::TendListener() {
  Mesh& m = *mesh_;
  const auto now = Clock::now();
  if (now - m.last_tended < std::chrono::milliseconds(10) || m.aborted || !m.handshakes) return;
  m.last_tended = now;
  std::vector<pollfd> fds{pollfd{m.listener.fd(), POLLIN, 0}};
  m.handshakes->AddPollFds(&fds);
  if (::poll(fds.data(), fds.size(), 0) < 0) return;
  // Errors on the listener (shut down by Abort()) surface in the next Run().
  m.TendHandshakes(fds.data() + 1, (fds[0].revents & POLLIN) != 0);
}

// Drives all transfers concurrently with poll(). The per-peer queues keep the
// order of transfers that share a direction; on_done callbacks (used to reduce a
// chunk as soon as it lands) run on this thread while other chunks are in flight.
// Peers without a socket yet: lower ranks are connected first; higher ones
// connect to us, and are accepted and authenticated inside the loop.
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
  std::vector<int> who;  // the peer of fds[i], for i < who.size(); then the listener
                         // and the handshakes under way
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
    const size_t listener_at = fds.size();
    if (m.handshakes) {
      fds.push_back(pollfd{m.listener.fd(), POLLIN, 0});
      m.handshakes->AddPollFds(&fds);
    }
    int rc = ::poll(fds.data(), fds.size(), 200);
    if (rc < 0) {
      if (errno == EINTR) continue;
      return Status::Aborted(std::string("poll failed: ") + std::strerror(errno));
    }
    // Handshakes every round, before anything else can change the queue that was
    // polled; they expire on their deadlines even when nothing is readable.
    if (m.handshakes) {
      const short re = fds[listener_at].revents;
      if (re & (POLLERR | POLLHUP | POLLNVAL)) return Mesh::AbortedStatus();  // shut down
      m.TendHandshakes(&fds[listener_at + 1], (re & POLLIN) != 0);
    }
    HVD_RETURN_IF_ERROR(m.Watch());
    // Deadlines are checked every round: a stream of events on other sockets
    // (a client knocking on the listener) must not hide a peer that is stuck.
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
    for (size_t i = 0; i < who.size(); ++i) {
      if ((fds[i].revents & (POLLRDHUP | POLLHUP | POLLERR)) && m.first_hung_up < 0) {
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
          m.store->TryGet(m.prefix + "/lost/" + std::to_string(g), &note, &found).ok() && found) {
        blamed = std::atoi(note.c_str());
        detail = "rank " + std::to_string(g) + " lost it first and closed; then " + why;
      } else if (m.first_hung_up >= 0 && m.first_hung_up != g) {
        blamed = m.first_hung_up;
        detail = "it hung up first; then rank " + std::to_string(g) + ": " + why;
      }
      if (m.store != nullptr) {
        m.store->Set(m.prefix + "/lost/" + std::to_string(global_[rank_]), std::to_string(blamed));
      }
      return Status::Aborted(PeerLost(blamed, detail));
    };
    for (size_t i = 0; i < who.size(); ++i) {
      short re = fds[i].revents;
      if (re == 0) continue;
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
          ssize_t n =
              ::send(fds[i].fd, x->buf + x->done, x->len - x->done, MSG_DONTWAIT | MSG_NOSIGNAL);
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
  }
  return Status::Ok();
}

}  // namespace hvd
