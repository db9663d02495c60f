#include "common/net.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <net/if.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <thread>
#include <vector>

namespace hvd {
namespace {

int RemainingMs(Clock::time_point deadline) {
  auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
  return left.count() < 0 ? 0 : static_cast<int>(left.count());
}

// Waits until fd is readable/writable or the deadline passes.
Status WaitFd(int fd, short events, Clock::time_point deadline, const char* what) {
  while (true) {
    pollfd p{fd, events, 0};
    int rc = ::poll(&p, 1, RemainingMs(deadline));
    if (rc > 0) return Status::Ok();
    if (rc == 0) return Status::Aborted(std::string("timed out while ") + what);
    if (errno != EINTR) return Status::Aborted(Errno("poll"));
  }
}

struct Address {
  sockaddr_storage addr{};
  socklen_t len = 0;
  int family = AF_INET;
};

// The addresses of host:port, IPv4 before IPv6 (a name with both, such as localhost,
// binds and connects as it did when only IPv4 was supported). An IPv6 address may be
// given in brackets, as in URLs: "[::1]".
Status Resolve(const std::string& host, int port, std::vector<Address>* out) {
  std::string name = host;
  if (name.size() >= 2 && name.front() == '[' && name.back() == ']') {
    name = name.substr(1, name.size() - 2);
  }
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  int rc = ::getaddrinfo(name.c_str(), std::to_string(port).c_str(), &hints, &res);
  if (rc != 0 || res == nullptr) {
    return Status::Aborted("cannot resolve host '" + host + "': " + gai_strerror(rc));
  }
  out->clear();
  for (addrinfo* ai = res; ai != nullptr; ai = ai->ai_next) {
    if ((ai->ai_family != AF_INET && ai->ai_family != AF_INET6) ||
        ai->ai_addrlen > sizeof(sockaddr_storage)) {
      continue;
    }
    Address a;
    std::memcpy(&a.addr, ai->ai_addr, ai->ai_addrlen);
    a.len = ai->ai_addrlen;
    a.family = ai->ai_family;
    out->push_back(a);
  }
  ::freeaddrinfo(res);
  std::stable_sort(out->begin(), out->end(), [](const Address& a, const Address& b) {
    return a.family == AF_INET && b.family != AF_INET;
  });
  if (out->empty()) return Status::Aborted("cannot resolve host '" + host + "': no address");
  return Status::Ok();
}

// The port of a socket address of either family.
int PortOf(const sockaddr_storage& a) {
  if (a.ss_family == AF_INET6) return ntohs(reinterpret_cast<const sockaddr_in6&>(a).sin6_port);
  return ntohs(reinterpret_cast<const sockaddr_in&>(a).sin_port);
}

// The numeric host of a socket address of either family (IPv6 without brackets or
// scope); empty for another family.
std::string NumericHost(const sockaddr_storage& a) {
  char buf[INET6_ADDRSTRLEN] = {0};
  if (a.ss_family == AF_INET6) {
    ::inet_ntop(AF_INET6, &reinterpret_cast<const sockaddr_in6&>(a).sin6_addr, buf, sizeof(buf));
  } else if (a.ss_family == AF_INET) {
    ::inet_ntop(AF_INET, &reinterpret_cast<const sockaddr_in&>(a).sin_addr, buf, sizeof(buf));
  }
  return buf;
}

}  // namespace

Clock::time_point Deadline(double timeout_s) {
  return Clock::now() + std::chrono::microseconds(static_cast<int64_t>(timeout_s * 1e6));
}

Socket& Socket::operator=(Socket&& o) noexcept {
  if (this != &o) {
    Close();
    fd_ = o.fd_;
    o.fd_ = -1;
  }
  return *this;
}

void Socket::Close() {
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
}

void Socket::Shutdown() {
  if (fd_ >= 0) ::shutdown(fd_, SHUT_RDWR);
}

Status Listen(const std::string& host, int port, Socket* out, int* bound_port) {
  std::vector<Address> addrs;
  HVD_RETURN_IF_ERROR(Resolve(host, port, &addrs));
  const Address& addr = addrs.front();
  Socket s(::socket(addr.family, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (!s.valid()) return Status::Aborted(Errno("socket"));
  int one = 1;
  ::setsockopt(s.fd(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  if (::bind(s.fd(), reinterpret_cast<const sockaddr*>(&addr.addr), addr.len) != 0) {
    return Status::Aborted(Errno(("bind " + host + ":" + std::to_string(port)).c_str()));
  }
  if (::listen(s.fd(), 1024) != 0) return Status::Aborted(Errno("listen"));
  sockaddr_storage bound{};
  socklen_t blen = sizeof(bound);
  ::getsockname(s.fd(), reinterpret_cast<sockaddr*>(&bound), &blen);
  if (bound_port != nullptr) *bound_port = PortOf(bound);
  *out = std::move(s);
  return Status::Ok();
}

Status Accept(const Socket& listener, double timeout_s, Socket* out) {
  auto deadline = Deadline(timeout_s);
  while (true) {
    HVD_RETURN_IF_ERROR(WaitFd(listener.fd(), POLLIN, deadline, "waiting for a connection"));
    int fd = ::accept4(listener.fd(), nullptr, nullptr, SOCK_CLOEXEC);
    if (fd >= 0) {
      *out = Socket(fd);
      return Status::Ok();
    }
    if (errno != EINTR && errno != EAGAIN && errno != ECONNABORTED) {
      return Status::Aborted(Errno("accept"));
    }
  }
}

namespace {
// One connection attempt to `a`, for at most `limit` (a non-blocking connect, so that
// an address that drops packets cannot hold the caller past its deadline). 0 on
// success, else the errno (ETIMEDOUT when `limit` passed).
int ConnectOnce(const Address& a, Clock::time_point limit, Socket* out) {
  Socket s(::socket(a.family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
  if (!s.valid()) return errno;  // e.g. IPv6 disabled in this kernel: skip the address
  int err = 0;
  if (::connect(s.fd(), reinterpret_cast<const sockaddr*>(&a.addr), a.len) != 0) {
    if (errno != EINPROGRESS) return errno;
    if (!WaitFd(s.fd(), POLLOUT, limit, "connecting").ok()) return ETIMEDOUT;
    socklen_t len = sizeof(err);
    if (::getsockopt(s.fd(), SOL_SOCKET, SO_ERROR, &err, &len) != 0) return errno;
    if (err != 0) return err;
  }
  ::fcntl(s.fd(), F_SETFL, ::fcntl(s.fd(), F_GETFL, 0) & ~O_NONBLOCK);
  int one = 1;
  ::setsockopt(s.fd(), IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  *out = std::move(s);
  return 0;
}
}  // namespace

Status Connect(const std::string& host, int port, double timeout_s, Socket* out,
               bool retry_refused) {
  std::vector<Address> addrs;
  HVD_RETURN_IF_ERROR(Resolve(host, port, &addrs));
  auto deadline = Deadline(timeout_s);
  // With several addresses, one attempt may take a few seconds at most, so that an
  // address that never answers does not keep the others from being tried again.
  const auto per_attempt = std::chrono::seconds(addrs.size() > 1 ? 3 : 1000000);
  std::vector<std::string> errors(addrs.size());
  while (true) {
    // Every address of the name in turn (localhost: 127.0.0.1, then ::1).
    bool refused = true;
    for (size_t i = 0; i < addrs.size(); ++i) {
      const int err = ConnectOnce(addrs[i], std::min(deadline, Clock::now() + per_attempt), out);
      if (err == 0) return Status::Ok();
      errors[i] = std::strerror(err);
      refused = refused && err == ECONNREFUSED;
    }
    if (Clock::now() >= deadline || (!retry_refused && refused)) {
      std::string why;
      for (size_t i = 0; i < addrs.size(); ++i) {
        const std::string ip = addrs.size() > 1 ? NumericHost(addrs[i].addr) + ": " : "";
        why += (i ? "; " : "") + ip + errors[i];
      }
      return Status::Aborted("cannot connect to " + host + ":" + std::to_string(port) + " within " +
                             std::to_string(timeout_s) + " s (" + why + ")");
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
}

namespace {
// getsockname / getpeername of `s` as a numeric host (IPv4 or IPv6, no brackets);
// false if it fails.
bool SocketAddress(const Socket& s, bool peer, std::string* host, int* port) {
  sockaddr_storage addr{};
  socklen_t len = sizeof(addr);
  auto* sa = reinterpret_cast<sockaddr*>(&addr);
  if ((peer ? ::getpeername(s.fd(), sa, &len) : ::getsockname(s.fd(), sa, &len)) != 0) {
    return false;
  }
  *host = NumericHost(addr);
  if (host->empty()) return false;
  char scope[IF_NAMESIZE] = {0};
  const auto* a6 = reinterpret_cast<sockaddr_in6*>(&addr);
  // A link-local address is only usable with its interface: "fe80::1%eth0".
  if (addr.ss_family == AF_INET6 && a6->sin6_scope_id != 0 &&
      ::if_indextoname(a6->sin6_scope_id, scope) != nullptr) {
    *host += std::string("%") + scope;
  }
  *port = PortOf(addr);
  return true;
}
}  // namespace

std::string LocalAddress(const Socket& s) {
  std::string host;
  int port = 0;
  return SocketAddress(s, false, &host, &port) ? host : "127.0.0.1";
}

std::string PeerAddress(const Socket& s) {
  std::string host;
  int port = 0;
  if (!SocketAddress(s, true, &host, &port)) return "unknown";
  const bool v6 = host.find(':') != std::string::npos;
  return (v6 ? "[" + host + "]" : host) + ":" + std::to_string(port);
}

Status SendAll(int fd, const void* buf, size_t len, double timeout_s) {
  auto deadline = Deadline(timeout_s);
  const char* p = static_cast<const char*>(buf);
  while (len > 0) {
    ssize_t n = ::send(fd, p, len, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n > 0) {
      p += n;
      len -= static_cast<size_t>(n);
      continue;
    }
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) {
      HVD_RETURN_IF_ERROR(WaitFd(fd, POLLOUT, deadline, "sending to a peer"));
      continue;
    }
    return Status::Aborted(Errno("connection to a peer lost (send)"));
  }
  return Status::Ok();
}

Status RecvAll(int fd, void* buf, size_t len, double timeout_s) {
  auto deadline = Deadline(timeout_s);
  char* p = static_cast<char*>(buf);
  while (len > 0) {
    ssize_t n = ::recv(fd, p, len, MSG_DONTWAIT);
    if (n > 0) {
      p += n;
      len -= static_cast<size_t>(n);
      continue;
    }
    if (n == 0) return Status::Aborted("connection to a peer lost (closed by the other side)");
    if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) {
      HVD_RETURN_IF_ERROR(WaitFd(fd, POLLIN, deadline, "receiving from a peer"));
      continue;
    }
    return Status::Aborted(Errno("connection to a peer lost (recv)"));
  }
  return Status::Ok();
}

Status SendFrame(int fd, const std::string& data, double timeout_s) {
  uint64_t n = data.size();
  std::string buf(reinterpret_cast<const char*>(&n), 8);
  buf += data;
  return SendAll(fd, buf.data(), buf.size(), timeout_s);
}

Status RecvFrame(int fd, std::string* data, double timeout_s, uint64_t max_len) {
  uint64_t n = 0;
  HVD_RETURN_IF_ERROR(RecvAll(fd, &n, 8, timeout_s));
  if (n > max_len) {
    return Status::Aborted("a peer sent a frame of " + std::to_string(n) +
                           " bytes, more than the " + std::to_string(max_len) + " allowed");
  }
  data->resize(n);
  return RecvAll(fd, data->data(), n, timeout_s);
}

void TuneForData(int fd) {
  int one = 1;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  int buf = 4 * 1024 * 1024;
  ::setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &buf, sizeof(buf));
  ::setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &buf, sizeof(buf));
  int flags = ::fcntl(fd, F_GETFL, 0);
  ::fcntl(fd, F_SETFL, flags | O_NONBLOCK);
}

}  // namespace hvd
