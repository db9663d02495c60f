// The rendezvous store: a small authenticated key/value server that the launcher
// runs and every worker talks to, to find its peers and to re-form after a reset.
//
// Threading: StoreServer runs one accept thread, which also runs every handshake
// (non-blocking, at most StoreOptions::max_pending_handshakes at a time), plus one
// thread per authenticated client connection; its public methods may be called from
// any thread. StoreClient keeps one connection and serialises calls with a mutex, so
// it may be shared.
#pragma once

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "common/handshake.h"
#include "common/net.h"
#include "common/status.h"
#include "common/thread_annotations.h"

namespace hvd {

// Largest request frame (opcode, key and value together) the rendezvous store takes
// by default: its keys and values are addresses, counters and error messages, far
// below this. A store that carries more (horovod.run's function and return values)
// is built with a larger StoreOptions::max_frame.
constexpr uint64_t kStoreMaxFrame = 4ull << 20;
// The largest max_frame there can be: a value's length is a u32 on the wire.
constexpr uint64_t kStoreMaxFrameLimit = (1ull << 32) + 64;

// The store's protocol, inside frames (net.h). Exposed for the tests, which fuzz it.
// A request: u8 opcode, key (u32 length + bytes), then the opcode's operand; a
// reply: u8 status (1: ok / found), then the opcode's result. A request that does
// not parse (unknown opcode, short, or with bytes left over) gets the one-byte
// reply "\0" and changes nothing.
namespace store_wire {

enum Op : uint8_t {
  kSet = 'S',    // value (u32 length + bytes)             -> status
  kGet = 'G',    // f64 seconds to wait for the key        -> status (found), value
  kAdd = 'A',    // i64 delta                              -> status (integer), i64 sum
  kLimit = 'L',  // nothing (empty key): the server's max_frame -> status, u64 limit
};

struct Request {
  uint8_t op = kSet;
  std::string key;
  std::string value;     // kSet
  double timeout_s = 0;  // kGet: any double; the server waits within [0, one year]
  int64_t delta = 0;     // kAdd
};
std::string EncodeRequest(const Request& r);
// True if `bytes` is exactly one well-formed request.
bool ParseRequest(const std::string& bytes, Request* r);

struct Reply {
  bool ok = false;
  std::string value;    // kGet
  uint64_t number = 0;  // kAdd: the sum (as two's complement); kLimit: the limit
};
std::string EncodeReply(uint8_t op, const Reply& r);
// True if `bytes` is a well-formed reply to `op`: the full one, or the one-byte
// refusal "\0" (then r->ok is false).
bool ParseReply(uint8_t op, const std::string& bytes, Reply* r);

}  // namespace store_wire

struct StoreOptions {
  // Requests longer than this are refused before anything is allocated: the client
  // gets an InvalidArgument error without sending (it learns the limit when it
  // connects); a connection that sends one anyway is closed. Clamped to
  // [4096, kStoreMaxFrameLimit].
  uint64_t max_frame = kStoreMaxFrame;
  // Connections still in the job-secret handshake. One more pushes out the oldest,
  // so idle connections cannot lock honest clients out (their handshake takes one
  // round trip), and hold no thread.
  int max_pending_handshakes = 64;
  // A connection that has not completed the handshake within this is closed.
  double handshake_timeout_s = 5.0;
  // Rejected handshakes: the first is logged at once, later ones as one line with
  // a count per interval.
  double log_interval_s = 10.0;
};

class StoreServer {
 public:
  // Binds host:port (0 = any free port) and starts serving. Check status().
  StoreServer(const std::string& host, int port, std::string secret,
              StoreOptions options = StoreOptions());
  ~StoreServer();

  const Status& status() const { return status_; }
  int port() const { return port_; }

  // Local access for the launcher (no socket round trip).
  void Set(const std::string& key, const std::string& value);
  bool Get(const std::string& key, std::string* value);
  // Adds delta to the integer stored at key (absent = 0). False if the stored value
  // is not an integer or the sum overflows.
  bool Add(const std::string& key, int64_t delta, int64_t* result);
  void Stop();
  // Authenticated connections being served.
  size_t num_connections();
  // Connections still in the handshake (for tests).
  size_t num_pending_handshakes() const { return num_pending_.load(); }
  uint64_t max_frame() const { return options_.max_frame; }

 private:
  void AcceptLoop();
  void StartServing(Socket sock);
  void Serve(uint64_t id, std::shared_ptr<Socket> conn);
  void ReapFinished();
  std::string Handle(const std::string& request);

  std::string secret_;
  StoreOptions options_;
  Status status_;
  int port_ = 0;
  Socket listener_;
  std::unique_ptr<HandshakeQueue> handshakes_;  // accept thread only
  std::thread accept_thread_;
  std::atomic<bool> stopping_{false};
  std::atomic<size_t> num_pending_{0};

  Mutex mu_;
  CondVar cv_;  // signalled on every Set/Add
  std::map<std::string, std::string> data_ HVD_GUARDED_BY(mu_);
  // Live connections and their threads; a thread whose client left moves its id to
  // finished_ and the accept loop joins it, so sockets and threads do not pile up.
  std::map<uint64_t, std::shared_ptr<Socket>> conns_ HVD_GUARDED_BY(mu_);
  std::map<uint64_t, std::thread> conn_threads_ HVD_GUARDED_BY(mu_);
  std::vector<uint64_t> finished_ HVD_GUARDED_BY(mu_);
  uint64_t next_id_ HVD_GUARDED_BY(mu_) = 0;
};

class StoreClient {
 public:
  // Connects and authenticates, retrying until timeout_s (a refused connection, or
  // one the server dropped before its verdict, e.g. while it was flooded; a wrong
  // secret fails at once).
  static Status Connect(const std::string& host, int port, const std::string& secret,
                        double timeout_s, std::unique_ptr<StoreClient>* out);

  Status Set(const std::string& key, const std::string& value);
  // Waits up to timeout_s for the key to exist.
  Status Get(const std::string& key, double timeout_s, std::string* value);
  // Returns immediately: *found tells whether the key exists.
  Status TryGet(const std::string& key, std::string* value, bool* found);
  // Waits up to timeout_s for the key; *found tells if it came.
  Status Fetch(const std::string& key, double timeout_s, std::string* value, bool* found);
  Status Add(const std::string& key, int64_t delta, int64_t* result);
  // Local address of the connection to the store: an address peers can reach us at.
  std::string LocalAddress();

 private:
  StoreClient() = default;
  // Sends one request and waits up to timeout_s (plus the I/O timeout) for its reply.
  Status Call(const store_wire::Request& request, double timeout_s, store_wire::Reply* reply);

  Mutex mu_;
  Socket sock_ HVD_GUARDED_BY(mu_);
  uint64_t max_frame_ = kStoreMaxFrame;  // the server's, learned at Connect
};

}  // namespace hvd
