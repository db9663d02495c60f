#include "rendezvous/store.h"

#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <system_error>

#include "common/logging.h"
#include "wire/codec.h"

namespace hvd {
namespace {

constexpr double kForever = 365.0 * 24 * 3600;
constexpr double kHandshakeTimeout = 10.0;

// Requests: u8 opcode, then fields. Replies: u8 status (1 = found/ok), then fields.
enum : uint8_t { kSet = 'S', kGet = 'G', kAdd = 'A' };

}  // namespace

StoreServer::StoreServer(const std::string& host, int port, std::string secret)
    : secret_(std::move(secret)) {
  status_ = Listen(host, port, &listener_, &port_);
  if (status_.ok()) accept_thread_ = std::thread([this] { AcceptLoop(); });
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

void StoreServer::AcceptLoop() {
  while (!stopping_) {
    Socket s;
    Status st = Accept(listener_, 0.5, &s);
    ReapFinished();
    if (!st.ok()) continue;  // timeout (re-check stopping_) or shut down
    auto conn = std::make_shared<Socket>(std::move(s));
    std::lock_guard<std::mutex> lock(mu_);
    if (stopping_) break;
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
}

void StoreServer::Serve(uint64_t id, std::shared_ptr<Socket> conn) {
  if (ServerHandshake(conn->fd(), secret_, kHandshakeTimeout, nullptr).ok()) {
    std::string request;
    while (!stopping_ && RecvFrame(conn->fd(), &request, kForever).ok()) {
      if (!SendFrame(conn->fd(), Handle(request), kHandshakeTimeout).ok()) break;
    }
  } else if (!stopping_) {
    HVD_LOG(kWarning) << "rendezvous store: rejected a connection that failed the "
                         "job-secret handshake (from " << PeerAddress(*conn) << ")";
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
    auto deadline = Clock::now() + std::chrono::microseconds(static_cast<int64_t>(timeout_s * 1e6));
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait_until(lock, deadline, [&] { return stopping_ || data_.count(key) > 0; });
    auto it = data_.find(key);
    w.U8(it != data_.end() ? 1 : 0);
    w.Str(it != data_.end() ? it->second : std::string());
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
  std::unique_ptr<StoreClient> c(new StoreClient());
  HVD_RETURN_IF_ERROR(::hvd::Connect(host, port, timeout_s, &c->sock_));
  Status st = ClientHandshake(c->sock_.fd(), secret, "store", kHandshakeTimeout);
  if (!st.ok()) {
    return Status::Aborted("rendezvous store at " + host + ":" + std::to_string(port) + ": " +
                           st.message());
  }
  *out = std::move(c);
  return Status::Ok();
}

Status StoreClient::Call(const std::string& request, double timeout_s, std::string* reply) {
  std::lock_guard<std::mutex> lock(mu_);
  HVD_RETURN_IF_ERROR(SendFrame(sock_.fd(), request, kHandshakeTimeout));
  Status st = RecvFrame(sock_.fd(), reply, timeout_s + kHandshakeTimeout);
  if (!st.ok()) return Status::Aborted("lost the rendezvous store: " + st.message());
  return Status::Ok();
}

Status StoreClient::Set(const std::string& key, const std::string& value) {
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
