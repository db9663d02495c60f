#include "common/handshake.h"

#include <sys/socket.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <random>
#include <thread>

#include "common/logging.h"
#include "common/sha256.h"

namespace hvd {

std::string HandshakeNonce() {
  std::random_device rd;
  std::string nonce(16, '\0');
  for (auto& c : nonce) c = static_cast<char>(rd());
  return nonce;
}

bool HandshakeReplyValid(const std::string& secret, const std::string& nonce,
                         const std::string& reply, std::string* tag) {
  if (reply.size() < 32) return false;
  std::string hello = reply.substr(32);
  std::string expect = HmacSha256(secret, nonce + hello);
  // Constant-time comparison.
  unsigned char diff = 0;
  for (int i = 0; i < 32; ++i) diff |= static_cast<unsigned char>(expect[i] ^ reply[i]);
  if (diff != 0) return false;
  if (tag != nullptr) *tag = hello;
  return true;
}

Status ServerHandshake(int fd, const std::string& secret, double timeout_s, std::string* tag) {
  std::string nonce = HandshakeNonce();
  HVD_RETURN_IF_ERROR(SendFrame(fd, nonce, timeout_s));
  std::string reply;
  HVD_RETURN_IF_ERROR(RecvFrame(fd, &reply, timeout_s, kMaxHandshakeFrame));
  bool ok = HandshakeReplyValid(secret, nonce, reply, tag);
  HVD_RETURN_IF_ERROR(SendFrame(fd, ok ? "Y" : "N", timeout_s));
  if (!ok) return Status::Aborted("a peer without the job secret tried to connect");
  return Status::Ok();
}

Status ClientHandshake(int fd, const std::string& secret, const std::string& tag, double timeout_s,
                       bool* rejected) {
  if (rejected != nullptr) *rejected = false;
  std::string nonce;
  HVD_RETURN_IF_ERROR(RecvFrame(fd, &nonce, timeout_s, kMaxHandshakeFrame));
  HVD_RETURN_IF_ERROR(SendFrame(fd, HmacSha256(secret, nonce + tag) + tag, timeout_s));
  std::string verdict;
  HVD_RETURN_IF_ERROR(RecvFrame(fd, &verdict, timeout_s, kMaxHandshakeFrame));
  if (verdict != "Y") {
    if (rejected != nullptr) *rejected = true;
    return Status::Aborted(
        "the peer rejected our job secret: HOROVOD_SECRET differs from the launcher's");
  }
  return Status::Ok();
}

namespace {

// Connections accepted per HandshakeQueue::Accept call, so that a flood of new
// connections cannot starve the handshakes in progress.
constexpr int kAcceptBurst = 256;

const char* const kRejectWhat[] = {"wrong secret", "malformed or closed", "too slow",
                                   "pushed out by newer connections"};

int MsUntil(Clock::time_point t) {
  auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(t - Clock::now()).count();
  return ms < 0 ? 0 : static_cast<int>(std::min<int64_t>(ms + 1, 1 << 30));
}

// Sends a small frame on a non-blocking socket whose send buffer has room (a fresh
// connection): all or nothing, no waiting.
bool SendSmall(int fd, const std::string& payload) {
  uint64_t n = payload.size();
  std::string buf(reinterpret_cast<const char*>(&n), 8);
  buf += payload;
  ssize_t sent = ::send(fd, buf.data(), buf.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
  return sent == static_cast<ssize_t>(buf.size());
}

std::string Seconds(double s) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%g", std::max(0.1, std::round(s * 10) / 10));
  return buf;
}

}  // namespace

HandshakeQueue::HandshakeQueue(std::string secret, HandshakeQueueOptions options)
    : secret_(std::move(secret)), options_(std::move(options)) {
  constexpr double kYear = 365.0 * 24 * 3600;  // longer ones would overflow a deadline
  options_.max_pending = std::max<size_t>(1, options_.max_pending);
  if (!(options_.timeout_s > 0)) options_.timeout_s = 5.0;
  if (!(options_.log_interval_s >= 0)) options_.log_interval_s = 10.0;
  options_.timeout_s = std::min(options_.timeout_s, kYear);
  options_.log_interval_s = std::min(options_.log_interval_s, kYear);
}

HandshakeQueue::~HandshakeQueue() { Clear(); }

void HandshakeQueue::Clear() {
  pending_.clear();  // closes them
  FlushLog(true);
}

void HandshakeQueue::Accept(const Socket& listener) {
  for (int i = 0; i < kAcceptBurst; ++i) {
    int fd = ::accept4(listener.fd(), nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
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
    p.deadline = Deadline(options_.timeout_s);
    if (!SendSmall(fd, p.nonce)) {
      NoteRejected(Reject::kMalformed, p.peer);
      continue;
    }
    if (pending_.size() >= options_.max_pending) {
      NoteRejected(Reject::kPushedOut, pending_.front().peer);
      pending_.pop_front();
    }
    pending_.push_back(std::move(p));
  }
}

void HandshakeQueue::AddPollFds(std::vector<pollfd>* fds) const {
  for (const Pending& p : pending_) fds->push_back(pollfd{p.sock.fd(), POLLIN, 0});
}

void HandshakeQueue::Advance(const pollfd* fds, const Done& done) {
  std::deque<Pending> still;
  for (size_t i = 0; i < pending_.size(); ++i) {
    if (fds[i].revents == 0 || Step(&pending_[i], done)) still.push_back(std::move(pending_[i]));
  }
  pending_.swap(still);
}

void HandshakeQueue::Expire(const Done& done) {
  const auto now = Clock::now();
  std::deque<Pending> still;
  for (Pending& p : pending_) {
    if (now < p.deadline) {
      still.push_back(std::move(p));
    } else if (Step(&p, done)) {  // still incomplete after a last read
      NoteRejected(Reject::kTooSlow, p.peer);
    }
  }
  pending_.swap(still);
  FlushLog(false);
}

int HandshakeQueue::WaitMs(int cap_ms) const {
  int ms = cap_ms;
  for (const Pending& p : pending_) ms = std::min(ms, MsUntil(p.deadline));
  if (window_open_) ms = std::min(ms, MsUntil(window_end_));
  return ms;
}

bool HandshakeQueue::Step(Pending* p, const Done& done) {
  const int fd = p->sock.fd();
  while (true) {
    uint64_t len = 0;
    if (p->in.size() >= 8) std::memcpy(&len, p->in.data(), 8);
    if (len > kMaxHandshakeFrame) {  // before reading (let alone allocating) the rest
      NoteRejected(Reject::kMalformed, p->peer);
      return false;
    }
    // Exactly the frame: what the client sends after its verdict is not ours.
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
  std::string tag;
  const bool ok = HandshakeReplyValid(secret_, p->nonce, p->in.substr(8), &tag);
  const bool sent = SendSmall(fd, ok ? "Y" : "N");
  if (!ok) {
    NoteRejected(Reject::kWrongSecret, p->peer);
    return false;
  }
  if (sent) done(std::move(p->sock), tag);
  return false;
}

void HandshakeQueue::NoteRejected(Reject why, const std::string& peer) {
  if (!window_open_) {
    window_open_ = true;
    window_start_ = Clock::now();
    window_end_ = Deadline(options_.log_interval_s);
    HVD_LOG(kWarning) << options_.who
                      << ": rejected a connection that failed the job-secret handshake ("
                      << kRejectWhat[static_cast<int>(why)] << ", from " << peer
                      << "); more are reported as one count every "
                      << Seconds(options_.log_interval_s) << " s";
    return;
  }
  ++rejected_[static_cast<int>(why)];
  last_rejected_peer_ = peer;
}

void HandshakeQueue::FlushLog(bool final) {
  if (!window_open_) return;
  if (!final && Clock::now() < window_end_) return;
  const double elapsed = std::chrono::duration<double>(Clock::now() - window_start_).count();
  uint64_t total = 0;
  std::string detail;
  for (int i = 0; i < static_cast<int>(Reject::kCount); ++i) {
    if (rejected_[i] == 0) continue;
    total += rejected_[i];
    detail += (detail.empty() ? "" : ", ") + std::to_string(rejected_[i]) + " " + kRejectWhat[i];
    rejected_[i] = 0;
  }
  if (total == 0) {  // a quiet interval: the next rejection is logged at once again
    window_open_ = false;
    return;
  }
  HVD_LOG(kWarning) << options_.who << ": rejected " << total
                    << (total == 1 ? " connection" : " connections")
                    << " that failed the job-secret handshake in the last " << Seconds(elapsed)
                    << " s (" << detail << "; the latest from " << last_rejected_peer_ << ")";
  window_start_ = Clock::now();
  window_end_ = Deadline(options_.log_interval_s);
  if (final) window_open_ = false;
}

}  // namespace hvd
