// The rendezvous store: a small authenticated key/value server that the launcher
// runs and every worker talks to, to find its peers and to re-form after a reset.
//
// Threading: StoreServer runs one accept thread plus one thread per client
// connection; its public methods may be called from any thread. StoreClient keeps
// one connection and serialises calls with a mutex, so it may be shared.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "common/net.h"
#include "common/status.h"

namespace hvd {

class StoreServer {
 public:
  // Binds host:port (0 = any free port) and starts serving. Check status().
  StoreServer(const std::string& host, int port, std::string secret);
  ~StoreServer();

  const Status& status() const { return status_; }
  int port() const { return port_; }

  // Local access for the launcher (no socket round trip).
  void Set(const std::string& key, const std::string& value);
  bool Get(const std::string& key, std::string* value);
  // Adds delta to the integer stored at key (absent = 0). False if the stored value
  // is not an integer.
  bool Add(const std::string& key, int64_t delta, int64_t* result);
  void Stop();
  size_t num_connections();

 private:
  void AcceptLoop();
  void Serve(uint64_t id, std::shared_ptr<Socket> conn);
  void ReapFinished();
  std::string Handle(const std::string& request);

  std::string secret_;
  Status status_;
  int port_ = 0;
  Socket listener_;
  std::thread accept_thread_;
  std::atomic<bool> stopping_{false};

  std::mutex mu_;
  std::condition_variable cv_;                      // signalled on every Set/Add
  std::map<std::string, std::string> data_;                 // GUARDED_BY(mu_)
  // Live connections and their threads; a thread whose client left moves its id to
  // finished_ and the accept loop joins it, so sockets and threads do not pile up.
  std::map<uint64_t, std::shared_ptr<Socket>> conns_;       // GUARDED_BY(mu_)
  std::map<uint64_t, std::thread> conn_threads_;            // GUARDED_BY(mu_)
  std::vector<uint64_t> finished_;                          // GUARDED_BY(mu_)
  uint64_t next_id_ = 0;                                    // GUARDED_BY(mu_)
};

class StoreClient {
 public:
  // Connects and authenticates, retrying until timeout_s.
  static Status Connect(const std::string& host, int port, const std::string& secret,
                        double timeout_s, std::unique_ptr<StoreClient>* out);

  Status Set(const std::string& key, const std::string& value);
  // Waits up to timeout_s for the key to exist.
  Status Get(const std::string& key, double timeout_s, std::string* value);
  // Returns immediately: *found tells whether the key exists.
  Status TryGet(const std::string& key, std::string* value, bool* found);
  Status Add(const std::string& key, int64_t delta, int64_t* result);
  // Local address of the connection to the store: an address peers can reach us at.
  std::string LocalAddress() const;

 private:
  StoreClient() = default;
  Status Call(const std::string& request, double timeout_s, std::string* reply);

  std::mutex mu_;
  Socket sock_;  // GUARDED_BY(mu_)
};

}  // namespace hvd
