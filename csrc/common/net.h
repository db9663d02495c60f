// Blocking TCP helpers with deadlines, shared by the rendezvous store and the TCP
// transport. Every wait is bounded: a peer that stops answering yields an Aborted
// Status, never a hang. Not thread-safe per socket: one thread uses a socket at a time.
#pragma once

#include <chrono>
#include <string>

#include "common/status.h"

namespace hvd {

using Clock = std::chrono::steady_clock;

// Owns a file descriptor; closes it on destruction.
class Socket {
 public:
  Socket() = default;
  explicit Socket(int fd) : fd_(fd) {}
  Socket(Socket&& o) noexcept : fd_(o.fd_) { o.fd_ = -1; }
  Socket& operator=(Socket&& o) noexcept;
  Socket(const Socket&) = delete;
  Socket& operator=(const Socket&) = delete;
  ~Socket() { Close(); }

  int fd() const { return fd_; }
  bool valid() const { return fd_ >= 0; }
  void Close();
  // Half-close both directions so a thread blocked in poll() on it wakes up.
  void Shutdown();

 private:
  int fd_ = -1;
};

// Listens on host:port (port 0 picks a free one, reported in *bound_port).
Status Listen(const std::string& host, int port, Socket* out, int* bound_port);
// Accepts one connection, waiting at most timeout_s.
Status Accept(const Socket& listener, double timeout_s, Socket* out);
// Connects to host:port, retrying refused connections until timeout_s has passed
// (the peer may not be listening yet) unless retry_refused is false (the peer is
// known to have listened: refusal means it is gone).
Status Connect(const std::string& host, int port, double timeout_s, Socket* out,
               bool retry_refused = true);
// The local address of a connected socket, as a numeric host string.
std::string LocalAddress(const Socket& s);
// "ip:port" of the other end of a connected socket ("unknown" if it cannot tell).
std::string PeerAddress(const Socket& s);

Status SendAll(int fd, const void* buf, size_t len, double timeout_s);
Status RecvAll(int fd, void* buf, size_t len, double timeout_s);
// A frame is a u64 length followed by the bytes. A frame longer than max_len is
// refused before anything is allocated (an unauthenticated peer must not be able
// to make us allocate gigabytes).
constexpr uint64_t kMaxFrame = 1ull << 32;
constexpr uint64_t kMaxHandshakeFrame = 4096;
Status SendFrame(int fd, const std::string& data, double timeout_s);
Status RecvFrame(int fd, std::string* data, double timeout_s, uint64_t max_len = kMaxFrame);

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
Status ClientHandshake(int fd, const std::string& secret, const std::string& tag,
                       double timeout_s, bool* rejected = nullptr);

// Puts the socket into non-blocking mode and disables Nagle.
void TuneForData(int fd);

}  // namespace hvd
