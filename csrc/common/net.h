// Blocking TCP helpers with deadlines, shared by the rendezvous store and the TCP
// transport. Every wait is bounded: a peer that stops answering yields an Aborted
// Status, never a hang. Not thread-safe per socket: one thread uses a socket at a time.
// The job-secret handshake over these sockets is in common/handshake.h.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

#include "common/status.h"

namespace hvd {

using Clock = std::chrono::steady_clock;

// Now plus timeout_s.
Clock::time_point Deadline(double timeout_s);

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

// Hosts are names or numeric IPv4 or IPv6 addresses (an IPv6 one may be bracketed,
// "[::1]"); a name with both kinds of address uses its IPv4 ones first.
// Listens on host:port (port 0 picks a free one, reported in *bound_port).
Status Listen(const std::string& host, int port, Socket* out, int* bound_port);
// Accepts one connection, waiting at most timeout_s.
Status Accept(const Socket& listener, double timeout_s, Socket* out);
// Connects to host:port, retrying refused connections until timeout_s has passed
// (the peer may not be listening yet) unless retry_refused is false (the peer is
// known to have listened: refusal means it is gone).
Status Connect(const std::string& host, int port, double timeout_s, Socket* out,
               bool retry_refused = true);
// The local address of a connected socket, as a numeric host string (IPv6 without
// brackets).
std::string LocalAddress(const Socket& s);
// "ip:port" or "[ipv6]:port" of the other end of a connected socket ("unknown" if it
// cannot tell).
std::string PeerAddress(const Socket& s);

Status SendAll(int fd, const void* buf, size_t len, double timeout_s);
Status RecvAll(int fd, void* buf, size_t len, double timeout_s);
// A frame is a u64 length followed by the bytes. A frame longer than max_len is
// refused before anything is allocated (an unauthenticated peer must not be able
// to make us allocate gigabytes).
constexpr uint64_t kMaxFrame = 1ull << 32;
Status SendFrame(int fd, const std::string& data, double timeout_s);
Status RecvFrame(int fd, std::string* data, double timeout_s, uint64_t max_len = kMaxFrame);

// Puts the socket into non-blocking mode and disables Nagle.
void TuneForData(int fd);

}  // namespace hvd
