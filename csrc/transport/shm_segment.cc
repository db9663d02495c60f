#include "transport/shm_segment.h"

#include <fcntl.h>
#include <linux/futex.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <vector>

#include "common/handshake.h"
#include "common/logging.h"
#include "common/sha256.h"
#include "common/types.h"

namespace hvd {
namespace shm {
namespace {

double SecondsLeft(Clock::time_point deadline) {
  return std::max(0.0, std::chrono::duration<double>(deadline - Clock::now()).count());
}

// State letter and start time of a process, from /proc/<pid>/stat; false if it
// cannot be read.
bool ReadProcStat(pid_t pid, char* state, uint64_t* start_time) {
  std::string path = "/proc/" + std::to_string(pid) + "/stat";
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return false;
  char buf[1024];
  ssize_t n = ::read(fd, buf, sizeof(buf) - 1);
  ::close(fd);
  if (n <= 0) return false;
  buf[n] = '\0';
  const char* p = std::strrchr(buf, ')');  // the command name may hold spaces
  if (p == nullptr || p[1] != ' ') return false;
  *state = p[2];
  int field = 3;  // the state; the start time is field 22
  for (const char* q = p + 2; *q != '\0'; ++q) {
    if (*q == ' ' && ++field == 22) {
      *start_time = std::strtoull(q + 1, nullptr, 10);
      return true;
    }
  }
  return false;
}

sockaddr_un AbstractAddress(const std::string& key, socklen_t* len) {
  const std::string name = RendezvousName(key);
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path + 1, name.data(), name.size());  // sun_path[0] = '\0'
  *len = static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 + name.size());
  return addr;
}

Status PeerCred(int fd, ucred* cred) {
  socklen_t len = sizeof(*cred);
  if (::getsockopt(fd, SOL_SOCKET, SO_PEERCRED, cred, &len) != 0) {
    return Status::Aborted(Errno("getsockopt(SO_PEERCRED)"));
  }
  return Status::Ok();
}

Status SendFd(int sock, int fd) {
  char byte = 'F';
  iovec iov{&byte, 1};
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))] = {};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  msg.msg_control = control;
  msg.msg_controllen = sizeof(control);
  cmsghdr* c = CMSG_FIRSTHDR(&msg);
  c->cmsg_level = SOL_SOCKET;
  c->cmsg_type = SCM_RIGHTS;
  c->cmsg_len = CMSG_LEN(sizeof(int));
  std::memcpy(CMSG_DATA(c), &fd, sizeof(int));
  while (::sendmsg(sock, &msg, MSG_NOSIGNAL) != 1) {
    if (errno != EINTR) return Status::Aborted(Errno("sending the shared-memory segment"));
  }
  return Status::Ok();
}

Status RecvFd(int sock, Clock::time_point deadline, int* fd) {
  while (true) {
    char byte = 0;
    iovec iov{&byte, 1};
    alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))] = {};
    msghdr msg{};
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control;
    msg.msg_controllen = sizeof(control);
    ssize_t n = ::recvmsg(sock, &msg, MSG_DONTWAIT | MSG_CMSG_CLOEXEC);
    if (n == 1) {
      cmsghdr* c = CMSG_FIRSTHDR(&msg);
      if (c == nullptr || c->cmsg_type != SCM_RIGHTS || c->cmsg_len != CMSG_LEN(sizeof(int))) {
        return Status::Aborted("local rank 0 sent no shared-memory segment");
      }
      std::memcpy(fd, CMSG_DATA(c), sizeof(int));
      return Status::Ok();
    }
    if (n == 0) {
      return Status::Aborted("local rank 0 closed the connection before sending the segment");
    }
    if (errno != EAGAIN && errno != EINTR) return Status::Aborted(Errno("recvmsg"));
    if (Clock::now() >= deadline) {
      return Status::Aborted("timed out waiting for local rank 0 to send the segment");
    }
    pollfd p{sock, POLLIN, 0};
    ::poll(&p, 1, 10);
  }
}

}  // namespace

bool Descriptor::operator==(const Descriptor& o) const {
  return kind == o.kind && dtype == o.dtype && op == o.op && count == o.count && root == o.root &&
         layout == o.layout;
}

std::string Descriptor::ToString() const {
  static const char* kNames[] = {"?",         "Allreduce", "ReduceScatter", "Allgather",
                                 "Broadcast", "Barrier",   "Exchange"};
  std::string s = kNames[kind <= kExchangeCall ? kind : 0];
  if (kind == kAllreduceCall || kind == kReduceScatterCall) {
    s += std::string("(") + DataTypeName(static_cast<DataType>(dtype)) + ", " +
         ReduceOpName(static_cast<ReduceOp>(op)) + ", " + std::to_string(count) + " elements";
    if (kind == kReduceScatterCall) s += ", split " + std::to_string(layout);
    s += ")";
  } else if (kind == kAllgatherCall) {
    s += "(" + std::to_string(count) + " bytes, split " + std::to_string(layout) + ")";
  } else if (kind == kBroadcastCall) {
    s += "(" + std::to_string(count) + " bytes, root " + std::to_string(root) + ")";
  } else if (kind == kExchangeCall) {
    s += "(control message kind " + std::to_string(op) + ")";
  }
  return s;
}

void FutexWait(std::atomic<uint32_t>* word, uint32_t expected, std::chrono::nanoseconds d) {
  timespec ts;
  ts.tv_sec = static_cast<time_t>(d.count() / 1000000000);
  ts.tv_nsec = static_cast<long>(d.count() % 1000000000);
  ::syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAIT, expected, &ts, nullptr, 0);
}

void FutexWake(std::atomic<uint32_t>* word) {
  ::syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
}

uint64_t OwnStartTime() {
  char state;
  uint64_t t = 0;
  return ReadProcStat(::getpid(), &state, &t) ? t : 0;
}

bool ProcessGone(pid_t pid, uint64_t start_time) {
  if (::kill(pid, 0) != 0 && errno == ESRCH) return true;
  char state = '?';
  uint64_t started = 0;
  if (!ReadProcStat(pid, &state, &started)) return errno == ENOENT;
  if (state == 'Z' || state == 'X') return true;
  return start_time != 0 && started != start_time;
}

void Poison(SegmentHeader* h, int rank, const std::string& why) {
  int32_t expected = -1;
  if (h->poison_rank.compare_exchange_strong(expected, rank)) {
    size_t n = std::min(why.size(), sizeof(h->poison_msg) - 1);
    std::memcpy(h->poison_msg, why.data(), n);
    h->poison_msg[n] = '\0';
    h->poison_ready.store(1, std::memory_order_release);
  }
  h->poison.store(1);
  // Wakes the barrier's sleepers, which look at the flag. The generation is left
  // alone: a rank whose barrier did complete (the generation moved) keeps its
  // result, even if a peer poisons the segment right after (say, because it read
  // a fatal error in the message the barrier delivered).
  FutexWake(&h->generation);
}

std::string RendezvousName(const std::string& key) {
  // A hash of the key: any key works, and the name has a fixed length.
  return "horovod_torch-shm-" + Hex(Sha256("horovod_torch shm group: " + key).substr(0, 16));
}

Status ServeSegment(const std::string& key, const std::string& secret, int size, int memfd,
                    Clock::time_point deadline,
                    const std::function<void(int, pid_t, bool)>& joined) {
  socklen_t len = 0;
  sockaddr_un addr = AbstractAddress(key, &len);
  Socket listener(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (!listener.valid()) return Status::Aborted(Errno("socket(AF_UNIX)"));
  if (::bind(listener.fd(), reinterpret_cast<sockaddr*>(&addr), len) != 0) {
    if (errno == EADDRINUSE) {
      return Status::Aborted("another shared-memory group with key '" + key +
                             "' is live on this host; keys must be unique per group");
    }
    return Status::Aborted(Errno("bind of the shared-memory rendezvous socket"));
  }
  if (::listen(listener.fd(), size) != 0) return Status::Aborted(Errno("listen"));
  const std::string group = "shared-memory group '" + key + "': ";
  std::vector<bool> done(size, false);
  for (int n = 1; n < size;) {
    Socket conn;
    Status st = Accept(listener, SecondsLeft(deadline), &conn);
    if (!st.ok()) {
      std::string missing;
      for (int r = 1; r < size; ++r) {
        if (!done[r]) missing += (missing.empty() ? "" : ", ") + std::to_string(r);
      }
      return Status::Aborted("local rank 0 timed out waiting for local ranks [" + missing +
                             "] to join " + group + st.message());
    }
    ucred cred{};
    HVD_RETURN_IF_ERROR(PeerCred(conn.fd(), &cred));
    if (cred.uid != ::getuid()) {
      HVD_LOG(kWarning) << group << "ignoring a connection from pid " << static_cast<int>(cred.pid)
                        << " of another user (uid " << static_cast<int>(cred.uid) << ")";
      continue;
    }
    std::string tag;
    st = ServerHandshake(conn.fd(), secret, SecondsLeft(deadline), &tag);
    if (!st.ok()) {
      return Status::Aborted(group + "process " + std::to_string(cred.pid) +
                             " failed authentication (" + st.message() +
                             "); do all local ranks share the job secret?");
    }
    HVD_RETURN_IF_ERROR(ClientHandshake(conn.fd(), secret, "0", SecondsLeft(deadline)));
    int rank = -1;
    long long pid = -1;
    if (std::sscanf(tag.c_str(), "%d %lld", &rank, &pid) != 2 || rank < 1 || rank >= size ||
        done[rank]) {
      return Status::Aborted(group + "bad or duplicate local rank '" + tag +
                             "' (do all local ranks agree on the local size " +
                             std::to_string(size) + "?)");
    }
    joined(rank, cred.pid, pid == cred.pid);
    HVD_RETURN_IF_ERROR(SendFd(conn.fd(), memfd));
    done[rank] = true;
    ++n;
  }
  return Status::Ok();  // the listener closes here: nothing remains addressable
}

Status FetchSegment(const std::string& key, const std::string& secret, int rank,
                    Clock::time_point deadline, int* memfd) {
  const std::string group = "shared-memory group '" + key + "': ";
  socklen_t len = 0;
  sockaddr_un addr = AbstractAddress(key, &len);
  Socket conn;
  // Local rank 0 may not be listening yet.
  while (true) {
    Socket s(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
    if (!s.valid()) return Status::Aborted(Errno("socket(AF_UNIX)"));
    if (::connect(s.fd(), reinterpret_cast<sockaddr*>(&addr), len) == 0) {
      conn = std::move(s);
      break;
    }
    if (errno != ECONNREFUSED && errno != ENOENT && errno != EAGAIN && errno != EINTR) {
      return Status::Aborted(Errno(group + "connecting to local rank 0"));
    }
    if (Clock::now() >= deadline) {
      return Status::Aborted("local rank " + std::to_string(rank) + " found no local rank 0 of " +
                             group +
                             "is local rank 0 alive, on this host, and in the same "
                             "network namespace (container)?");
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  ucred cred{};
  HVD_RETURN_IF_ERROR(PeerCred(conn.fd(), &cred));
  if (cred.uid != ::getuid()) {
    return Status::Aborted(group + "the rendezvous socket belongs to another user (uid " +
                           std::to_string(cred.uid) + ")");
  }
  const std::string tag = std::to_string(rank) + " " + std::to_string(::getpid());
  HVD_RETURN_IF_ERROR(ClientHandshake(conn.fd(), secret, tag, SecondsLeft(deadline)));
  Status st = ServerHandshake(conn.fd(), secret, SecondsLeft(deadline), nullptr);
  if (!st.ok()) {
    return Status::Aborted(group + "local rank 0 (pid " + std::to_string(cred.pid) +
                           ") failed authentication: " + st.message());
  }
  st = RecvFd(conn.fd(), deadline, memfd);
  if (!st.ok()) return Status::Aborted(group + st.message());
  return Status::Ok();
}

}  // namespace shm
}  // namespace hvd
