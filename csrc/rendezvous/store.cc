#include "rendezvous/store.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
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

std::chrono::microseconds Micros(double s) {
  return std::chrono::microseconds(static_cast<int64_t>(s * 1e6));
}

double SecondsLeft(Clock::time_point deadline) {
  return std::max(0.0, std::chrono::duration<double>(deadline - Clock::now()).count());
}

// A wait asked for over the wire, as a duration that is safe to convert: NaN and
// negative values are 0, anything above kForever is kForever.
double WaitSeconds(double s) { return s > 0 ? std::min(s, kForever) : 0.0; }

}  // namespace

namespace store_wire {

std::string EncodeRequest(const Request& r) {
  Writer w;
  w.U8(r.op);
  w.Str(r.key);
  if (r.op == kSet) w.Str(r.value);
  if (r.op == kGet) w.F64(r.timeout_s);
  if (r.op == kAdd) w.I64(r.delta);
  return std::move(w.str());
}

bool ParseRequest(const std::string& bytes, Request* r) {
  Reader rd(bytes);
  *r = Request();
  r->op = rd.U8();
  r->key = rd.Str();
  switch (r->op) {
    case kSet:
      r->value = rd.Str();
      break;
    case kGet:
      r->timeout_s = rd.F64();
      break;
    case kAdd:
      r->delta = rd.I64();
      break;
    case kLimit:
      break;
    default:
      return false;
  }
  return rd.ok() && rd.done();
}

std::string EncodeReply(uint8_t op, const Reply& r) {
  Writer w;
  w.U8(r.ok ? 1 : 0);
  if (op == kGet) w.Str(r.value);
  if (op == kAdd || op == kLimit) w.U64(r.number);
  return std::move(w.str());
}

bool ParseReply(uint8_t op, const std::string& bytes, Reply* r) {
  *r = Reply();
  if (bytes.size() == 1 && bytes[0] == 0) return true;  // the request was refused
  Reader rd(bytes);
  const uint8_t status = rd.U8();
  r->ok = status == 1;
  if (op == kGet) r->value = rd.Str();
  if (op == kAdd || op == kLimit) r->number = rd.U64();
  return status <= 1 && rd.ok() && rd.done();
}

}  // namespace store_wire

StoreServer::StoreServer(const std::string& host, int port, std::string secret,
                         StoreOptions options)
    : secret_(std::move(secret)), options_(options) {
  options_.max_frame =
      std::clamp<uint64_t>(options_.max_frame, kMaxHandshakeFrame, kStoreMaxFrameLimit);
  status_ = Listen(host, port, &listener_, &port_);
  if (!status_.ok()) return;
  // poll() says when to accept; accept4 must then never block.
  ::fcntl(listener_.fd(), F_SETFL, ::fcntl(listener_.fd(), F_GETFL, 0) | O_NONBLOCK);
  HandshakeQueueOptions hs;
  hs.max_pending = static_cast<size_t>(std::max(1, options_.max_pending_handshakes));
  hs.timeout_s = options_.handshake_timeout_s;
  hs.log_interval_s = options_.log_interval_s;
  hs.who = "rendezvous store";
  handshakes_ = std::make_unique<HandshakeQueue>(secret_, hs);
  accept_thread_ = std::thread([this] { AcceptLoop(); });
}

StoreServer::~StoreServer() { Stop(); }

void StoreServer::Stop() {
  if (stopping_.exchange(true)) return;
  listener_.Shutdown();
  if (accept_thread_.joinable()) accept_thread_.join();
  std::map<uint64_t, std::thread> threads;
  {
    MutexLock lock(mu_);
    for (auto& c : conns_) c.second->Shutdown();
    threads.swap(conn_threads_);
  }
  cv_.NotifyAll();
  for (auto& t : threads) t.second.join();
  listener_.Close();
}

size_t StoreServer::num_connections() {
  ReapFinished();
  MutexLock lock(mu_);
  return conns_.size();
}

void StoreServer::ReapFinished() {
  std::vector<std::thread> done;
  {
    MutexLock lock(mu_);
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

// One thread accepts connections and runs their handshakes without blocking
// (HandshakeQueue): a connection costs no thread until it has proven it holds the
// secret, at most max_pending_handshakes are in the handshake at once, and each has
// handshake_timeout_s to finish it.
void StoreServer::AcceptLoop() {
  HandshakeQueue& queue = *handshakes_;
  const HandshakeQueue::Done serve = [this](Socket sock, const std::string&) {
    StartServing(std::move(sock));
  };
  std::vector<pollfd> fds;
  while (!stopping_) {
    queue.Expire(serve);
    num_pending_ = queue.size();
    fds.assign(1, pollfd{listener_.fd(), POLLIN, 0});
    queue.AddPollFds(&fds);
    int rc = ::poll(fds.data(), fds.size(), queue.WaitMs(500));  // re-checks stopping_
    ReapFinished();
    if (stopping_) break;
    if (rc < 0) {
      if (errno != EINTR) std::this_thread::sleep_for(std::chrono::milliseconds(10));
      continue;
    }
    if (rc == 0) continue;
    queue.Advance(fds.data() + 1, serve);
    if (fds[0].revents != 0) queue.Accept(listener_);
  }
  queue.Clear();
  num_pending_ = 0;
}

void StoreServer::StartServing(Socket sock) {
  auto conn = std::make_shared<Socket>(std::move(sock));
  MutexLock lock(mu_);
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
  MutexLock lock(mu_);
  conns_.erase(id);
  finished_.push_back(id);
}

std::string StoreServer::Handle(const std::string& request) {
  using namespace store_wire;
  Request req;
  Reply reply;
  if (!ParseRequest(request, &req)) return std::string(1, '\0');
  if (req.op == kSet) {
    Set(req.key, req.value);
    reply.ok = true;
  } else if (req.op == kAdd) {
    int64_t sum = 0;
    reply.ok = Add(req.key, req.delta, &sum);
    reply.number = static_cast<uint64_t>(sum);
  } else if (req.op == kGet) {
    auto deadline = Clock::now() + Micros(WaitSeconds(req.timeout_s));
    MutexLock lock(mu_);
    cv_.WaitUntil(mu_, deadline,
                  [&]() HVD_REQUIRES(mu_) { return stopping_ || data_.count(req.key) > 0; });
    auto it = data_.find(req.key);
    reply.ok = it != data_.end();
    if (reply.ok) reply.value = it->second;
  } else if (req.op == kLimit) {
    reply.ok = true;
    reply.number = options_.max_frame;
  }
  return EncodeReply(req.op, reply);
}

void StoreServer::Set(const std::string& key, const std::string& value) {
  {
    MutexLock lock(mu_);
    data_[key] = value;
  }
  cv_.NotifyAll();
}

bool StoreServer::Get(const std::string& key, std::string* value) {
  MutexLock lock(mu_);
  auto it = data_.find(key);
  if (it == data_.end()) return false;
  *value = it->second;
  return true;
}

bool StoreServer::Add(const std::string& key, int64_t delta, int64_t* result) {
  {
    MutexLock lock(mu_);
    auto it = data_.find(key);
    int64_t v = 0;
    if (it != data_.end()) {
      char* end = nullptr;
      errno = 0;
      v = std::strtoll(it->second.c_str(), &end, 10);
      if (it->second.empty() || *end != '\0' || errno != 0) return false;
    }
    int64_t sum = 0;
    if (__builtin_add_overflow(v, delta, &sum)) return false;
    *result = sum;
    data_[key] = std::to_string(sum);
  }
  cv_.NotifyAll();
  return true;
}

Status StoreClient::Connect(const std::string& host, int port, const std::string& secret,
                            double timeout_s, std::unique_ptr<StoreClient>* out) {
  const std::string where = "rendezvous store at " + host + ":" + std::to_string(port) + ": ";
  const auto deadline = Clock::now() + Micros(timeout_s);
  while (true) {
    std::unique_ptr<StoreClient> c(new StoreClient());
    bool rejected = false;
    Status st;
    {
      MutexLock lock(c->mu_);  // nobody else has it yet; the lock keeps the rule simple
      HVD_RETURN_IF_ERROR(::hvd::Connect(host, port, SecondsLeft(deadline), &c->sock_));
      st = ClientHandshake(c->sock_.fd(), secret, "store",
                           std::clamp(SecondsLeft(deadline), 1.0, kIoTimeout), &rejected);
    }
    store_wire::Reply reply;
    if (st.ok()) {
      store_wire::Request limit;
      limit.op = store_wire::kLimit;
      st = c->Call(limit, 0, &reply);
    }
    if (st.ok()) {
      if (reply.ok) c->max_frame_ = std::min(reply.number, kStoreMaxFrameLimit);
      *out = std::move(c);
      return Status::Ok();
    }
    // A wrong secret is final. A connection dropped before the verdict (the server
    // pushed it out of a full handshake queue, or is stopping) is worth another try.
    if (rejected || Clock::now() >= deadline) return Status::Aborted(where + st.message());
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
}

Status StoreClient::Call(const store_wire::Request& request, double timeout_s,
                         store_wire::Reply* reply) {
  const std::string bytes = store_wire::EncodeRequest(request);
  MutexLock lock(mu_);
  if (bytes.size() > max_frame_) {
    return Status::InvalidArgument("a rendezvous store request of " + std::to_string(bytes.size()) +
                                   " bytes is larger than the " + std::to_string(max_frame_) +
                                   " bytes this store accepts");
  }
  HVD_RETURN_IF_ERROR(SendFrame(sock_.fd(), bytes, kIoTimeout));
  std::string got;
  Status st = RecvFrame(sock_.fd(), &got, WaitSeconds(timeout_s) + kIoTimeout, kStoreMaxFrameLimit);
  if (!st.ok()) return Status::Aborted("lost the rendezvous store: " + st.message());
  if (!store_wire::ParseReply(request.op, got, reply)) {
    return Status::Aborted("the rendezvous store sent a malformed reply");
  }
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
  store_wire::Request req;
  req.op = store_wire::kSet;
  req.key = key;
  req.value = value;
  store_wire::Reply reply;
  HVD_RETURN_IF_ERROR(Call(req, 0, &reply));
  if (!reply.ok) return Status::Aborted("the rendezvous store refused to set '" + key + "'");
  return Status::Ok();
}

Status StoreClient::Get(const std::string& key, double timeout_s, std::string* value) {
  bool found = false;
  HVD_RETURN_IF_ERROR(Fetch(key, timeout_s, value, &found));
  if (!found) {
    return Status::Aborted("timed out after " + std::to_string(timeout_s) +
                           " s waiting for rendezvous key '" + key + "'");
  }
  return Status::Ok();
}

Status StoreClient::TryGet(const std::string& key, std::string* value, bool* found) {
  return Fetch(key, 0.0, value, found);
}

Status StoreClient::Fetch(const std::string& key, double timeout_s, std::string* value,
                          bool* found) {
  store_wire::Request req;
  req.op = store_wire::kGet;
  req.key = key;
  req.timeout_s = timeout_s;
  store_wire::Reply reply;
  HVD_RETURN_IF_ERROR(Call(req, timeout_s, &reply));
  *found = reply.ok;
  *value = std::move(reply.value);
  return Status::Ok();
}

Status StoreClient::Add(const std::string& key, int64_t delta, int64_t* result) {
  store_wire::Request req;
  req.op = store_wire::kAdd;
  req.key = key;
  req.delta = delta;
  store_wire::Reply reply;
  HVD_RETURN_IF_ERROR(Call(req, 0, &reply));
  *result = static_cast<int64_t>(reply.number);
  if (!reply.ok) {
    return Status::InvalidArgument("store key '" + key + "' does not hold an integer (or adding " +
                                   std::to_string(delta) + " to it overflows)");
  }
  return Status::Ok();
}

std::string StoreClient::LocalAddress() {
  MutexLock lock(mu_);
  return ::hvd::LocalAddress(sock_);
}

}  // namespace hvd
