// The job-secret handshake every connection to the rendezvous store and between
// ranks goes through: blocking, one connection at a time (ServerHandshake,
// ClientHandshake), or, on a server, for many connections at once without blocking
// (HandshakeQueue).
#pragma once

#include <poll.h>

#include <cstdint>
#include <deque>
#include <functional>
#include <string>
#include <vector>

#include "common/net.h"
#include "common/status.h"

namespace hvd {

// A handshake frame longer than this is refused from its length header alone.
constexpr uint64_t kMaxHandshakeFrame = 4096;

// Challenge-response with the job secret: the server sends a nonce, the client
// answers SHA-256(secret | nonce | tag). The secret never crosses the wire.
// `tag` is a short hello the client sends along (e.g. its rank); the server gets it.
Status ServerHandshake(int fd, const std::string& secret, double timeout_s, std::string* tag);
// ServerHandshake in two halves for a caller that cannot block: send the nonce as
// a frame, then check the client's reply frame (and send "Y" or "N" yourself).
std::string HandshakeNonce();
bool HandshakeReplyValid(const std::string& secret, const std::string& nonce,
                         const std::string& reply, std::string* tag);
// *rejected (if given) tells a verdict of "N" (a wrong secret: retrying cannot help)
// from a connection lost or timed out before the verdict.
Status ClientHandshake(int fd, const std::string& secret, const std::string& tag, double timeout_s,
                       bool* rejected = nullptr);

struct HandshakeQueueOptions {
  // Connections in the handshake at once. One more pushes out the oldest, so idle
  // connections cannot lock honest peers out (their handshake takes one round
  // trip; a client pushed out before its verdict may simply retry), and the queue
  // never grows past this. At least 1.
  size_t max_pending = 64;
  // A connection that has not sent its whole reply within this is dropped.
  double timeout_s = 5.0;
  // Rejected connections: the first is logged at once, later ones as one line with
  // a count per interval.
  double log_interval_s = 10.0;
  // Names the server in log lines ("rendezvous store", "rank 3").
  std::string who = "server";
};

// The server side of the job-secret handshake for every connection accepted on
// one listener, run without blocking by the single thread that owns the listener
// (the rendezvous store's accept thread; a rank of the TCP mesh, between
// transfers). A connection costs a socket and a few bytes until it proves the
// secret: it gets a nonce when accepted, its reply frame (at most
// kMaxHandshakeFrame, refused from its length header alone) is read as it arrives,
// then it gets "Y" and is handed to the owner, or "N" (or nothing) and is closed.
// A round of the owner's poll loop:
//   fds = {...the owner's own...}; queue.AddPollFds(&fds);  poll(fds);
//   queue.Advance(&fds[first], done); if (listener readable) queue.Accept(listener);
//   queue.Expire(done);   // and poll again within queue.WaitMs(...)
// Not thread-safe: one thread uses it.
class HandshakeQueue {
 public:
  // Receives a connection that proved the secret (its verdict "Y" is sent) and the
  // tag it sent along.
  using Done = std::function<void(Socket sock, const std::string& tag)>;

  HandshakeQueue(std::string secret, HandshakeQueueOptions options);
  ~HandshakeQueue();  // closes what is pending and logs the last count
  HandshakeQueue(const HandshakeQueue&) = delete;
  HandshakeQueue& operator=(const HandshakeQueue&) = delete;

  // Accepts what waits on `listener` (non-blocking; at most a burst per call, so a
  // flood cannot starve the handshakes under way) and sends each its nonce.
  void Accept(const Socket& listener);
  // Appends one pollfd (POLLIN) per pending connection, oldest first.
  void AddPollFds(std::vector<pollfd>* fds) const;
  // Reads what the connections signalled in `fds` (the entries AddPollFds added,
  // polled since, with no Accept or Expire in between) and finishes those whose
  // reply is complete.
  void Advance(const pollfd* fds, const Done& done);
  // Drops the connections past their deadline (after a last read, so a reply that
  // arrived while the owner was busy elsewhere still counts) and logs the
  // interval's count when it is due.
  void Expire(const Done& done);
  // How long the owner may wait in poll(): until the next deadline or log line, at
  // most cap_ms.
  int WaitMs(int cap_ms) const;
  // Closes every pending connection and logs the last count (the owner stops).
  void Clear();
  size_t size() const { return pending_.size(); }

 private:
  enum class Reject { kWrongSecret, kMalformed, kTooSlow, kPushedOut, kCount };
  // A connection whose nonce went out; `in` collects its reply frame.
  struct Pending {
    Socket sock;
    std::string peer, nonce, in;
    Clock::time_point deadline;
  };

  // Reads what `p` sent; false once it is finished (handed to `done`, or rejected).
  bool Step(Pending* p, const Done& done);
  void NoteRejected(Reject why, const std::string& peer);
  void FlushLog(bool final);

  std::string secret_;
  HandshakeQueueOptions options_;
  std::deque<Pending> pending_;  // oldest first
  // The reject log's current interval.
  bool window_open_ = false;
  Clock::time_point window_start_, window_end_;
  uint64_t rejected_[static_cast<int>(Reject::kCount)] = {};
  std::string last_rejected_peer_;
};

}  // namespace hvd
