#include "rendezvous/store.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <system_error>

#include "common/logging.h"
#include "wire/codec.h"

namespace hvd {
namespace {

constexpr double kForever = 365.0 * 24 * 3600;
// Sending one request or reply, and the client's side of the handshake.
constexpr double kIoTimeout = 10.0;
// Connections accepted per wake-up of the accept loop, so that a flood of new
// connections cannot starve the handshakes in progress.
constexpr int kAcceptBurst = 256;

// Requests: u8 opcode, then fields. Replies: u8 status (1 = found/ok), then fields.
// 'L' (limit) asks for the server's max_frame; the client sends it once, at Connect.
enum : uint8_t { kSet = 'S', kGet = 'G', kAdd = 'A', kLimit = 'L' };

const char* const kRejectWhat[] = {"wrong secret", "malformed or closed", "too slow",
                                   "pushed out by newer connections"};

std::chrono::microseconds Micros(double s) {
  return std::chrono::microseconds(static_cast<int64_t>(s * 1e6));
}

double SecondsLeft(Clock::time_point deadline) {
  return std::max(0.0, std::chrono::duration<double>(deadline - Clock::now()).count());
}

int MsUntil(Clock::time_point t) {
  auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(t - Clock::now()).count();
  return ms < 0 ? 0 : static_cast<int>(std::min<int64_t>(ms + 1, 1 << 30));
}

std::string Frame(const std::string& payload) {
  uint64_t n = payload.size();
  std::string buf(reinterpret_cast<const char*>(&n), 8);
  return buf + payload;
}

// Sends a small frame on a non-blocking socket whose send buffer has room (a fresh
// connection): all or nothing, no waiting.
bool SendSmall(int fd, const std::string& payload) {
  std::string buf = Frame(payload);
  ssize_t n = ::send(fd, buf.data(), buf.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
  return n == static_cast<ssize_t>(buf.size());
}

std::string Seconds(double s) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%g", std::max(0.1, std::round(s * 10) / 10));
  return buf;
}

}  // namespace

// A connection in the handshake: its nonce went out; `in` collects the reply frame.
struct StoreServer::Pending {
  Socket sock;
  std::string peer;
  std::string nonce;
  std::string in;
  Clock::time_point deadline;
};

StoreServer::StoreServer(const std::string& host, int port, std::string secret,
                         StoreOptions options)
    : secret_(std::move(secret)), options_(options) {
  options_.max_frame = std::clamp<uint64_t>(options_.max_frame, kMaxHandshakeFrame,
                                            kStoreMaxFrameLimit);
  options_.max_pending_handshakes = std::max(1, options_.max_pending_handshakes);
  if (!(options_.handshake_timeout_s > 0)) options_.handshake_timeout_s = 5.0;
  if (!(options_.log_interval_s >= 0)) options_.log_interval_s = 10.0;
  status_ = Listen(host, port, &listener_, &port_);
  if (!status_.ok()) return;
  // poll() says when to accept; accept4 must then never block.
  ::fcntl(listener_.fd(), F_SETFL, ::fcntl(listener_.fd(), F_GETFL, 0) | O_NONBLOCK);
  accept_thread_ = std::thread([this] { AcceptLoop(); });
}

StoreServer::~StoreServer() { Stop(); }

void StoreServer::Stop() {
  if (stopping_.exchange(true)) return;
  listener_.Shutdown();
  if (accept_thread_.joinable()) accept_thread_.join();
  std::map<uint64_t, std::thread> threads;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& c : conns_) c.second->Shutdown();
    threads.swap(conn_threads_);
  }
  cv_.notify_all();
  for (auto& t : threads) t.second.join();
  listener_.Close();
}

size_t StoreServer::num_connections() {
  ReapFinished();
  std::lock_guard<std::mutex> lock(mu_);
  return conns_.size();
}

void StoreServer::ReapFinished() {
  std::vector<std::thread> done;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (uint64_t id : finished_) {
      auto it = conn_threads_.find(id);
      if (it != conn_threads_.end()) {
        done.push_back(std::move(it->second));
        conn_threads_.erase(it);
      }
    }
    finished_.clear();
  }
  for (auto& t : done) t.join();
}

// One thread accepts connections and runs their handshakes without blocking: a
// connection costs no thread until it has proven it holds the secret, at most
// max_pending_handshakes are in the handshake at once, and each has
// handshake_timeout_s to finish it.
void StoreServer::AcceptLoop() {
  std::vector<Pending> pending;
  std::vector<pollfd> fds;
  while (!stopping_) {
    const auto now = Clock::now();
    auto expired = [&](Pending& p) {
      if (now < p.deadline) return false;
      NoteRejected(Reject::kTooSlow, p.peer);
      return true;
    };
    pending.erase(std::remove_if(pending.begin(), pending.end(), expired), pending.end());
    FlushRejectLog(false);
    num_pending_ = pending.size();

    int wait_ms = 500;  // re-check stopping_ at least this often
    for (const Pending& p : pending) wait_ms = std::min(wait_ms, MsUntil(p.deadline));
    if (reject_window_open_) {
      wait_ms = std::min(wait_ms, MsUntil(reject_window_start_ + Micros(options_.log_interval_s)));
    }
    fds.assign(1, pollfd{listener_.fd(), POLLIN, 0});
    for (const Pending& p : pending) fds.push_back(pollfd{p.sock.fd(), POLLIN, 0});
    int rc = ::poll(fds.data(), fds.size(), wait_ms);
    ReapFinished();
    if (stopping_) break;
    if (rc < 0) {
      if (errno != EINTR) std::this_thread::sleep_for(std::chrono::milliseconds(10));
      continue;
    }
    if (rc == 0) continue;
    std::vector<Pending> still;
    still.reserve(pending.size());
    for (size_t i = 0; i < pending.size(); ++i) {
      if (fds[i + 1].revents == 0 || Advance(&pending[i])) still.push_back(std::move(pending[i]));
    }
    pending.swap(still);
    if (fds[0].revents != 0) AcceptWaiting(&pending);
  }
  pending.clear();  // closes them
  num_pending_ = 0;
  FlushRejectLog(true);
}

void StoreServer::AcceptWaiting(std::vector<Pending>* pending) {
  for (int i = 0; i < kAcceptBurst && !stopping_; ++i) {
    int fd = ::accept4(listener_.fd(), nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
    if (fd < 0) {
      if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM) {
        // Out of descriptors: the connection stays in the backlog; do not spin on it.
        std::this_thread::sleep_for(std::chrono::milliseconds(50));
      }
      return;  // EAGAIN: none left; other errors are the client's (ECONNABORTED)
    }
    Pending p;
    p.sock = Socket(fd);
    p.peer = PeerAddress(p.sock);
    p.nonce = HandshakeNonce();
    p.deadline = Clock::now() + Micros(options_.handshake_timeout_s);
    if (!SendSmall(fd, p.nonce)) {
      NoteRejected(Reject::kMalformed, p.peer);
      continue;
    }
    if (pending->size() >= static_cast<size_t>(options_.max_pending_handshakes)) {
      NoteRejected(Reject::kPushedOut, pending->front().peer);
      pending->erase(pending->begin());
    }
    pending->push_back(std::move(p));
  }
}

bool StoreServer::Advance(Pending* p) {
  const int fd = p->sock.fd();
  while (true) {
    uint64_t len = 0;
    if (p->in.size() >= 8) std::memcpy(&len, p->in.data(), 8);
    if (len > kMaxHandshakeFrame) {  // before reading (let alone allocating) the rest
      NoteRejected(Reject::kMalformed, p->peer);
      return false;
    }
    const size_t want = p->in.size() < 8 ? 8 - p->in.size() : 8 + len - p->in.size();
    if (want == 0) break;
    char buf[kMaxHandshakeFrame + 8];
    ssize_t n = ::recv(fd, buf, want, MSG_DONTWAIT);
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) return true;
    if (n <= 0) {  // closed, or reset
      NoteRejected(Reject::kMalformed, p->peer);
      return false;
    }
    p->in.append(buf, static_cast<size_t>(n));
  }
  const bool ok = HandshakeReplyValid(secret_, p->nonce, p->in.substr(8), nullptr);
  const bool sent = SendSmall(fd, ok ? "Y" : "N");
  if (!ok) {
    NoteRejected(Reject::kWrongSecret, p->peer);
    return false;
  }
  if (sent) StartServing(std::move(p->sock));
  return false;
}

void StoreServer::StartServing(Socket sock) {
  auto conn = std::make_shared<Socket>(std::move(sock));
  std::lock_guard<std::mutex> lock(mu_);
  if (stopping_) return;
  uint64_t id = next_id_++;
  conns_[id] = conn;
  try {
    conn_threads_[id] = std::thread([this, id, conn] { Serve(id, conn); });
  } catch (const std::system_error&) {  // out of threads: refuse this client, keep serving
    HVD_LOG(kWarning) << "rendezvous store: cannot start a thread for a new connection; "
                         "refusing it";
    conns_.erase(id);
    conn_threads_.erase(id);
  }
}

void StoreServer::NoteRejected(Reject why, const std::string& peer) {
  if (stopping_) return;
  if (!reject_window_open_) {
    reject_window_open_ = true;
    reject_window_start_ = Clock::now();
    HVD_LOG(kWarning) << "rendezvous store: rejected a connection that failed the job-secret "
                         "handshake ("
                      << kRejectWhat[static_cast<int>(why)] << ", from " << peer
                      << "); more are reported as one count every "
                      << Seconds(options_.log_interval_s) << " s";
    return;
  }
  ++rejected_[static_cast<int>(why)];
  last_rejected_peer_ = peer;
}

void StoreServer::FlushRejectLog(bool final) {
  if (!reject_window_open_) return;
  const double elapsed =
      std::chrono::duration<double>(Clock::now() - reject_window_start_).count();
  if (!final && elapsed < options_.log_interval_s) return;
  uint64_t total = 0;
  std::string detail;
  for (int i = 0; i < static_cast<int>(Reject::kCount); ++i) {
    if (rejected_[i] == 0) continue;
    total += rejected_[i];
    detail += (detail.empty() ? "" : ", ") + std::to_string(rejected_[i]) + " " + kRejectWhat[i];
    rejected_[i] = 0;
  }
  if (total == 0) {  // a quiet interval: the next rejection is logged at once again
    reject_window_open_ = false;
    return;
  }
  HVD_LOG(kWarning) << "rendezvous store: rejected " << total
                    << (total == 1 ? " connection" : " connections")
                    << " that failed the job-secret handshake in the last " << Seconds(elapsed)
                    << " s (" << detail << "; the latest from " << last_rejected_peer_ << ")";
  reject_window_start_ = Clock::now();
  if (final) reject_window_open_ = false;
}

void StoreServer::Serve(uint64_t id, std::shared_ptr<Socket> conn) {
  const int fd = conn->fd();
  std::string request;
  while (!stopping_) {
    uint64_t n = 0;
    if (!RecvAll(fd, &n, 8, kForever).ok()) break;
    if (n > options_.max_frame) {  // refused before allocating; the stream cannot resync
      if (!stopping_) {
        HVD_LOG(kWarning) << "rendezvous store: a client (" << PeerAddress(*conn)
                          << ") sent a request of " << n << " bytes, more than the "
                          << options_.max_frame << " this store accepts; closing its connection";
      }
      break;
    }
    request.resize(n);
    if (!RecvAll(fd, request.data(), n, kForever).ok()) break;
    if (!SendFrame(fd, Handle(request), kIoTimeout).ok()) break;
    if (request.capacity() > (1u << 20)) std::string().swap(request);  // keep no big buffer
  }
  // Forget the connection under the lock (so Stop() never touches a closed fd),
  // then close it when the last reference goes.
  std::lock_guard<std::mutex> lock(mu_);
  conns_.erase(id);
  finished_.push_back(id);
}

std::string StoreServer::Handle(const std::string& request) {
  Reader rd(request);
  uint8_t op = rd.U8();
  std::string key = rd.Str();
  Writer w;
  if (op == kSet) {
    Set(key, rd.Str());
    w.U8(1);
  } else if (op == kAdd) {
    int64_t result = 0;
    bool ok = Add(key, rd.I64(), &result);
    w.U8(ok ? 1 : 0);
    w.I64(result);
  } else if (op == kGet) {
    double timeout_s = rd.F64();
    auto deadline = Clock::now() + Micros(std::min(timeout_s, kForever));
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait_until(lock, deadline, [&] { return stopping_ || data_.count(key) > 0; });
    auto it = data_.find(key);
    w.U8(it != data_.end() ? 1 : 0);
    w.Str(it != data_.end() ? it->second : std::string());
  } else if (op == kLimit) {
    w.U8(1);
    w.U64(options_.max_frame);
  } else {
    w.U8(0);
  }
  return std::move(w.str());
}

void StoreServer::Set(const std::string& key, const std::string& value) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    data_[key] = value;
  }
  cv_.notify_all();
}

bool StoreServer::Get(const std::string& key, std::string* value) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = data_.find(key);
  if (it == data_.end()) return false;
  *value = it->second;
  return true;
}

bool StoreServer::Add(const std::string& key, int64_t delta, int64_t* result) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = data_.find(key);
    int64_t v = 0;
    if (it != data_.end()) {
      char* end = nullptr;
      errno = 0;
      v = std::strtoll(it->second.c_str(), &end, 10);
      if (it->second.empty() || *end != '\0' || errno != 0) return false;
    }
    *result = v + delta;
    data_[key] = std::to_string(*result);
  }
  cv_.notify_all();
  return true;
}

Status StoreClient::Connect(const std::string& host, int port, const std::string& secret,
                            double timeout_s, std::unique_ptr<StoreClient>* out) {
  const std::string where = "rendezvous store at " + host + ":" + std::to_string(port) + ": ";
  const auto deadline = Clock::now() + Micros(timeout_s);
  while (true) {
    std::unique_ptr<StoreClient> c(new StoreClient());
    HVD_RETURN_IF_ERROR(::hvd::Connect(host, port, SecondsLeft(deadline), &c->sock_));
    bool rejected = false;
    Status st = ClientHandshake(c->sock_.fd(), secret, "store",
                                std::clamp(SecondsLeft(deadline), 1.0, kIoTimeout), &rejected);
    std::string reply;
    if (st.ok()) {
      Writer w;
      w.U8(kLimit);
      w.Str("");
      st = c->Call(w.str(), 0, &reply);
    }
    if (st.ok()) {
      Reader rd(reply);
      const bool known = rd.U8() == 1;
      const uint64_t limit = rd.U64();
      if (known && rd.ok()) c->max_frame_ = std::min(limit, kStoreMaxFrameLimit);
      *out = std::move(c);
      return Status::Ok();
    }
    // A wrong secret is final. A connection dropped before the verdict (the server
    // pushed it out of a full handshake queue, or is stopping) is worth another try.
    if (rejected || Clock::now() >= deadline) return Status::Aborted(where + st.message());
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
}

Status StoreClient::Call(const std::string& request, double timeout_s, std::string* reply) {
  std::lock_guard<std::mutex> lock(mu_);
  if (request.size() > max_frame_) {
    return Status::InvalidArgument("a rendezvous store request of " +
                                   std::to_string(request.size()) +
                                   " bytes is larger than the " + std::to_string(max_frame_) +
                                   " bytes this store accepts");
  }
  HVD_RETURN_IF_ERROR(SendFrame(sock_.fd(), request, kIoTimeout));
  Status st = RecvFrame(sock_.fd(), reply, std::min(timeout_s, kForever) + kIoTimeout,
                        kStoreMaxFrameLimit);
  if (!st.ok()) return Status::Aborted("lost the rendezvous store: " + st.message());
  return Status::Ok();
}

Status StoreClient::Set(const std::string& key, const std::string& value) {
  const uint64_t size = 1 + 4 + key.size() + 4 + value.size();
  if (size > max_frame_ || key.size() > UINT32_MAX || value.size() > UINT32_MAX) {
    return Status::InvalidArgument(
        "the value for rendezvous store key '" + key.substr(0, 200) + "' is " +
        std::to_string(value.size()) + " bytes: this store accepts requests of at most " +
        std::to_string(max_frame_) + " bytes (key and value together); nothing was stored");
  }
  Writer w;
  w.U8(kSet);
  w.Str(key);
  w.Str(value);
  std::string reply;
  return Call(w.str(), 0, &reply);
}

Status StoreClient::Get(const std::string& key, double timeout_s, std::string* value) {
  bool found = false;
  Writer w;
  w.U8(kGet);
  w.Str(key);
  w.F64(timeout_s);
  std::string reply;
  HVD_RETURN_IF_ERROR(Call(w.str(), timeout_s, &reply));
  Reader rd(reply);
  found = rd.U8() == 1;
  *value = rd.Str();
  if (!found) {
    return Status::Aborted("timed out after " + std::to_string(timeout_s) +
                           " s waiting for rendezvous key '" + key + "'");
  }
  return Status::Ok();
}

Status StoreClient::TryGet(const std::string& key, std::string* value, bool* found) {
  Writer w;
  w.U8(kGet);
  w.Str(key);
  w.F64(0.0);
  std::string reply;
  HVD_RETURN_IF_ERROR(Call(w.str(), 0, &reply));
  Reader rd(reply);
  *found = rd.U8() == 1;
  *value = rd.Str();
  return Status::Ok();
}

Status StoreClient::Add(const std::string& key, int64_t delta, int64_t* result) {
  Writer w;
  w.U8(kAdd);
  w.Str(key);
  w.I64(delta);
  std::string reply;
  HVD_RETURN_IF_ERROR(Call(w.str(), 0, &reply));
  Reader rd(reply);
  bool ok = rd.U8() == 1;
  *result = rd.I64();
  if (!ok) return Status::InvalidArgument("store key '" + key + "' does not hold an integer");
  return Status::Ok();
}

std::string StoreClient::LocalAddress() const { return ::hvd::LocalAddress(sock_); }

}  // namespace hvd
