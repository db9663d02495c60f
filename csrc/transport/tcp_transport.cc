#include "transport/tcp_transport.h"

#include <poll.h>
#include <sys/socket.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <thread>
#include <cerrno>
#include <cstring>
#include <deque>

#include "common/logging.h"

namespace hvd {
namespace {

std::string PeerLost(int peer, const std::string& why) {
  return "connection to rank " + std::to_string(peer) + " lost (" + why +
         "); the peer process probably died";
}

// Element offsets of `counts` laid end to end.
std::vector<size_t> Offsets(const std::vector<size_t>& counts) {
  std::vector<size_t> off(counts.size(), 0);
  for (size_t i = 1; i < counts.size(); ++i) off[i] = off[i - 1] + counts[i - 1];
  return off;
}

}  // namespace

Status TcpTransport::Create(StoreClient* store, const std::string& prefix, int rank, int size,
                            const std::string& secret, const TcpOptions& options,
                            std::unique_ptr<TcpTransport>* out) {
  std::unique_ptr<TcpTransport> t(new TcpTransport(rank, size, options));
  if (size == 1) {
    *out = std::move(t);
    return Status::Ok();
  }
  // Listen on the address we reach the store from: peers reach us the same way.
  std::string host = store->LocalAddress();
  Socket listener;
  int port = 0;
  HVD_RETURN_IF_ERROR(Listen(host, 0, &listener, &port));
  HVD_RETURN_IF_ERROR(store->Set(prefix + "/addr/" + std::to_string(rank),
                                 host + ":" + std::to_string(port)));
  const double timeout = options.connect_timeout_s;
  // Connect to lower ranks; they accept us. Lower ranks finish their own connects
  // before accepting, so by induction from rank 0 nobody waits forever.
  for (int peer = 0; peer < rank; ++peer) {
    std::string addr;
    Status st = store->Get(prefix + "/addr/" + std::to_string(peer), timeout, &addr);
    if (!st.ok()) {
      return Status::Aborted("rank " + std::to_string(peer) +
                             " did not reach the rendezvous in time (HOROVOD_START_TIMEOUT=" +
                             std::to_string(timeout) + " s): " + st.message());
    }
    size_t colon = addr.rfind(':');
    Socket s;
    HVD_RETURN_IF_ERROR(Connect(addr.substr(0, colon), std::stoi(addr.substr(colon + 1)),
                                timeout, &s));
    HVD_RETURN_IF_ERROR(ClientHandshake(s.fd(), secret, std::to_string(rank), timeout));
    (*t->sockets_)[peer] = std::move(s);
  }
  // Higher ranks connect to us. Each accepted connection is authenticated on its
  // own thread, so a client that connects and stays silent (or is slow) cannot hold
  // up the real peers queued behind it; one overall deadline bounds the wait.
  struct Handshake {
    Socket sock;
    std::string tag;
    Status status;
    std::atomic<bool> done{false};
    std::thread thread;
  };
  std::vector<std::unique_ptr<Handshake>> shakes;
  auto stop_all = [&shakes] {
    for (auto& h : shakes) {
      h->sock.Shutdown();  // wakes a handshake blocked on a silent client
      if (h->thread.joinable()) h->thread.join();
    }
  };
  const auto deadline = std::chrono::steady_clock::now() +
                        std::chrono::milliseconds(static_cast<int64_t>(timeout * 1000));
  for (int accepted = 0; accepted < size - 1 - rank;) {
    double left = std::chrono::duration<double>(deadline - std::chrono::steady_clock::now())
                      .count();
    if (left <= 0) {
      stop_all();
      return Status::Aborted("not every higher rank connected within " +
                             std::to_string(timeout) + " s (HOROVOD_START_TIMEOUT)");
    }
    Socket s;
    if (Accept(listener, std::min(left, 0.05), &s).ok()) {
      auto h = std::make_unique<Handshake>();
      h->sock = std::move(s);
      Handshake* raw = h.get();
      raw->thread = std::thread([raw, secret, left] {
        raw->status = ServerHandshake(raw->sock.fd(), secret, left, &raw->tag);
        raw->done = true;
      });
      shakes.push_back(std::move(h));
    }
    for (auto it = shakes.begin(); it != shakes.end();) {
      Handshake& h = **it;
      if (!h.done) {
        ++it;
        continue;
      }
      h.thread.join();
      if (!h.status.ok()) {
        HVD_LOG(kWarning) << "rejected a connection that failed the job-secret handshake";
      } else {
        int peer = std::atoi(h.tag.c_str());
        if (peer <= rank || peer >= size || (*t->sockets_)[peer].valid()) {
          stop_all();
          return Status::Aborted("unexpected hello '" + h.tag + "' during connection set-up");
        }
        (*t->sockets_)[peer] = std::move(h.sock);
        ++accepted;
      }
      it = shakes.erase(it);
    }
  }
  stop_all();  // connections still handshaking are not peers we need
  for (int p = 0; p < size; ++p) {
    if (p != rank) TuneForData((*t->sockets_)[p].fd());
  }
  *out = std::move(t);
  return Status::Ok();
}

void TcpTransport::Abort() {
  for (auto& s : *sockets_) s.Shutdown();
}

std::unique_ptr<TcpTransport> TcpTransport::SubsetView(const std::vector<int>& members) const {
  int me = -1;
  for (size_t i = 0; i < members.size(); ++i) {
    if (members[i] == rank_) me = static_cast<int>(i);
  }
  if (me < 0) return nullptr;
  std::unique_ptr<TcpTransport> t(
      new TcpTransport(me, static_cast<int>(members.size()), options_));
  t->sockets_ = sockets_;
  for (size_t i = 0; i < members.size(); ++i) t->global_[i] = global_[members[i]];
  return t;
}

// Drives all transfers concurrently with poll(). The per-peer queues keep the
// order of transfers that share a direction; on_done callbacks (used to reduce a
// chunk as soon as it lands) run on this thread while other chunks are in flight.
Status TcpTransport::Run(std::vector<Xfer>& xs) {
  std::vector<std::deque<Xfer*>> sendq(size_), recvq(size_);
  size_t pending = 0;
  for (auto& x : xs) {
    if (x.len == 0) {
      if (x.on_done) x.on_done();
      continue;
    }
    (x.send ? sendq : recvq)[x.peer].push_back(&x);
    ++pending;
  }
  auto last_progress = Clock::now();
  std::vector<pollfd> fds;
  std::vector<int> who;
  while (pending > 0) {
    fds.clear();
    who.clear();
    for (int p = 0; p < size_; ++p) {
      if (p == rank_) continue;
      short ev = (sendq[p].empty() ? 0 : POLLOUT) | (recvq[p].empty() ? 0 : POLLIN);
      // Peers we exchange nothing with are watched for hang-ups only (their early
      // data for a later exchange must stay unread), so a death anywhere is seen.
      fds.push_back(pollfd{Peer(p).fd(), static_cast<short>(ev | POLLRDHUP), 0});
      who.push_back(p);
    }
    int rc = ::poll(fds.data(), fds.size(), 200);
    if (rc < 0) {
      if (errno == EINTR) continue;
      return Status::Aborted(std::string("poll failed: ") + std::strerror(errno));
    }
    if (rc == 0) {
      double idle = std::chrono::duration<double>(Clock::now() - last_progress).count();
      if (idle > options_.io_timeout_s) {
        int stuck = -1;
        for (int p = 0; p < size_ && stuck < 0; ++p) {
          if (!sendq[p].empty() || !recvq[p].empty()) stuck = p;
        }
        return Status::Aborted("rank " + std::to_string(global_[stuck]) +
                               " made no progress for " + std::to_string(idle) +
                               " s (HOROVOD_TCP_TIMEOUT); treating it as lost");
      }
      continue;
    }
    for (size_t i = 0; i < fds.size(); ++i) {
      int p = who[i];
      short re = fds[i].revents;
      if (re == 0) continue;
      if (sendq[p].empty() && recvq[p].empty()) {
        if (re & (POLLRDHUP | POLLHUP | POLLERR)) {
          return Status::Aborted(PeerLost(global_[p], "closed by the other side"));
        }
        continue;
      }
      if ((re & (POLLIN | POLLERR | POLLHUP)) && !recvq[p].empty()) {
        while (!recvq[p].empty()) {
          Xfer* x = recvq[p].front();
          ssize_t n = ::recv(fds[i].fd, x->buf + x->done, x->len - x->done, MSG_DONTWAIT);
          if (n == 0) return Status::Aborted(PeerLost(global_[p], "closed by the other side"));
          if (n < 0) {
            if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) break;
            return Status::Aborted(PeerLost(global_[p], std::strerror(errno)));
          }
          x->done += static_cast<size_t>(n);
          last_progress = Clock::now();
          if (x->done < x->len) continue;
          if (x->on_done) x->on_done();
          recvq[p].pop_front();
          --pending;
        }
      }
      if ((re & (POLLOUT | POLLERR | POLLHUP)) && !sendq[p].empty()) {
        while (!sendq[p].empty()) {
          Xfer* x = sendq[p].front();
          ssize_t n = ::send(fds[i].fd, x->buf + x->done, x->len - x->done,
                             MSG_DONTWAIT | MSG_NOSIGNAL);
          if (n < 0) {
            if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) break;
            return Status::Aborted(PeerLost(global_[p], std::strerror(errno)));
          }
          x->done += static_cast<size_t>(n);
          last_progress = Clock::now();
          if (x->done < x->len) continue;
          if (x->on_done) x->on_done();
          sendq[p].pop_front();
          --pending;
        }
      } else if ((re & (POLLERR | POLLHUP)) && recvq[p].empty()) {
        return Status::Aborted(PeerLost(global_[p], "socket hung up"));
      }
    }
  }
  return Status::Ok();
}

Status TcpTransport::Gather(const std::string& mine, std::vector<std::string>* all) {
  if (rank_ != 0) {
    uint64_t n = mine.size();
    std::string frame(reinterpret_cast<const char*>(&n), 8);
    frame += mine;
    std::vector<Xfer> xs{{0, true, frame.data(), frame.size()}};
    return Run(xs);
  }
  all->assign(size_, std::string());
  (*all)[0] = mine;
  std::vector<uint64_t> lens(size_, 0);
  std::vector<Xfer> xs;
  for (int p = 1; p < size_; ++p) {
    xs.push_back({p, false, reinterpret_cast<char*>(&lens[p]), 8});
  }
  HVD_RETURN_IF_ERROR(Run(xs));
  xs.clear();
  for (int p = 1; p < size_; ++p) {
    if (lens[p] > (1ull << 32)) return Status::Aborted(PeerLost(global_[p], "corrupt message length"));
    (*all)[p].resize(lens[p]);
    xs.push_back({p, false, (*all)[p].data(), lens[p]});
  }
  return Run(xs);
}

Status TcpTransport::Allgather(const std::string& mine, std::vector<std::string>* all) {
  const size_t n = mine.size();
  std::string buf(n * size_, '\0');
  HVD_RETURN_IF_ERROR(Allgatherv(mine.data(), &buf[0], std::vector<size_t>(size_, n)));
  all->resize(size_);
  for (int r = 0; r < size_; ++r) (*all)[r] = buf.substr(r * n, n);
  return Status::Ok();
}

Status TcpTransport::Bcast(std::string* data) {
  if (size_ == 1) return Status::Ok();
  if (rank_ == 0) {
    uint64_t n = data->size();
    std::string frame(reinterpret_cast<const char*>(&n), 8);
    frame += *data;
    std::vector<Xfer> xs;
    for (int p = 1; p < size_; ++p) xs.push_back({p, true, frame.data(), frame.size()});
    return Run(xs);
  }
  uint64_t n = 0;
  std::vector<Xfer> xs{{0, false, reinterpret_cast<char*>(&n), 8}};
  HVD_RETURN_IF_ERROR(Run(xs));
  if (n > (1ull << 32)) return Status::Aborted(PeerLost(0, "corrupt message length"));
  data->resize(n);
  xs = {{0, false, data->data(), n}};
  return Run(xs);
}

Status TcpTransport::Allreduce(void* buf, size_t count, DataType dtype, ReduceOp op) {
  if (size_ == 1 || count == 0) return Status::Ok();
  size_t esize = DataTypeSize(dtype);
  if (count * esize <= options_.small_allreduce_bytes || count < static_cast<size_t>(size_)) {
    return DirectReduce(buf, {count}, dtype, op, buf, /*all=*/true);
  }
  std::vector<size_t> counts(size_, count / size_);
  for (size_t r = 0; r < count % size_; ++r) ++counts[r];
  std::vector<size_t> offsets = Offsets(counts);
  char* p = static_cast<char*>(buf);
  HVD_RETURN_IF_ERROR(RingReduceScatter(p, offsets, counts, dtype, op));
  std::vector<size_t> boff(size_), bbytes(size_);
  for (int r = 0; r < size_; ++r) {
    boff[r] = offsets[r] * esize;
    bbytes[r] = counts[r] * esize;
  }
  return RingAllgather(p, boff, bbytes);
}

// Latency-optimal reduction: one exchange, then every rank reduces the
// contributions in rank order (so results are bitwise identical everywhere).
// all=true: allreduce of counts[0] elements, in place. all=false: reducescatter,
// segment r of buf goes to rank r, this rank's result lands in out.
Status TcpTransport::DirectReduce(void* buf, const std::vector<size_t>& counts, DataType dtype,
                                  ReduceOp op, void* out, bool all) {
  size_t esize = DataTypeSize(dtype);
  std::vector<size_t> offsets = all ? std::vector<size_t>(size_, 0) : Offsets(counts);
  size_t mine = (all ? counts[0] : counts[rank_]) * esize;
  scratch_.resize(mine * size_);
  char* base = static_cast<char*>(buf);
  std::vector<Xfer> xs;
  for (int p = 0; p < size_; ++p) {
    if (p == rank_) continue;
    size_t seg_bytes = (all ? counts[0] : counts[p]) * esize;
    xs.push_back({p, true, base + offsets[p] * esize, seg_bytes});
    xs.push_back({p, false, scratch_.data() + p * mine, mine});
  }
  if (mine > 0) std::memcpy(scratch_.data() + rank_ * mine, base + offsets[rank_] * esize, mine);
  HVD_RETURN_IF_ERROR(Run(xs));
  char* dst = static_cast<char*>(out);
  if (mine == 0) return Status::Ok();
  std::memcpy(dst, scratch_.data(), mine);
  for (int p = 1; p < size_; ++p) {
    ReduceInto(dst, scratch_.data() + p * mine, mine / esize, dtype, op);
  }
  return Status::Ok();
}

// Ring reduce-scatter: in step s rank r sends segment (r-s-1) to its right
// neighbour and receives segment (r-s-2) from its left one, reducing it into its
// own copy. After size-1 steps rank r holds the full reduction of segment r.
// The receive is split into chunks; each chunk is reduced as soon as it lands.
Status TcpTransport::RingReduceScatter(char* buf, const std::vector<size_t>& offsets,
                                       const std::vector<size_t>& counts, DataType dtype,
                                       ReduceOp op) {
  const int n = size_;
  const int right = (rank_ + 1) % n, left = (rank_ + n - 1) % n;
  const size_t esize = DataTypeSize(dtype);
  const size_t chunk_elems = std::max<size_t>(1, options_.ring_chunk_bytes / esize);
  size_t max_count = *std::max_element(counts.begin(), counts.end());
  scratch_.resize(max_count * esize);
  for (int s = 0; s < n - 1; ++s) {
    int send_seg = ((rank_ - s - 1) % n + n) % n;
    int recv_seg = ((rank_ - s - 2) % n + n) % n;
    std::vector<Xfer> xs;
    xs.push_back({right, true, buf + offsets[send_seg] * esize, counts[send_seg] * esize});
    char* dst = buf + offsets[recv_seg] * esize;
    for (size_t off = 0; off < counts[recv_seg]; off += chunk_elems) {
      size_t len = std::min(chunk_elems, counts[recv_seg] - off);
      char* tmp = scratch_.data() + off * esize;
      xs.push_back({left, false, tmp, len * esize,
                    [=] { ReduceInto(dst + off * esize, tmp, len, dtype, op); }});
    }
    HVD_RETURN_IF_ERROR(Run(xs));
  }
  return Status::Ok();
}

// Ring allgather: rank r starts owning segment r; in step s it forwards segment
// (r-s) to the right and receives segment (r-s-1) from the left, in place.
Status TcpTransport::RingAllgather(char* buf, const std::vector<size_t>& offsets,
                                   const std::vector<size_t>& bytes) {
  const int n = size_;
  const int right = (rank_ + 1) % n, left = (rank_ + n - 1) % n;
  for (int s = 0; s < n - 1; ++s) {
    int send_seg = ((rank_ - s) % n + n) % n;
    int recv_seg = ((rank_ - s - 1) % n + n) % n;
    std::vector<Xfer> xs{{right, true, buf + offsets[send_seg], bytes[send_seg]},
                         {left, false, buf + offsets[recv_seg], bytes[recv_seg]}};
    HVD_RETURN_IF_ERROR(Run(xs));
  }
  return Status::Ok();
}

Status TcpTransport::Allgatherv(const void* send, void* recv, const std::vector<size_t>& bytes) {
  std::vector<size_t> off = Offsets(bytes);
  char* out = static_cast<char*>(recv);
  if (bytes[rank_] > 0) std::memmove(out + off[rank_], send, bytes[rank_]);
  std::vector<Xfer> xs;
  for (int p = 0; p < size_; ++p) {
    if (p == rank_) continue;
    xs.push_back({p, true, out + off[rank_], bytes[rank_]});
    xs.push_back({p, false, out + off[p], bytes[p]});
  }
  return Run(xs);
}

Status TcpTransport::Broadcast(void* buf, size_t bytes, int root) {
  if (size_ == 1 || bytes == 0) return Status::Ok();
  char* p = static_cast<char*>(buf);
  std::vector<Xfer> xs;
  if (bytes <= options_.small_allreduce_bytes || size_ == 2) {
    // Root sends the whole buffer to each peer.
    for (int q = 0; q < size_; ++q) {
      if (q == rank_) continue;
      if (rank_ == root) xs.push_back({q, true, p, bytes});
      if (q == root) xs.push_back({q, false, p, bytes});
    }
    return Run(xs);
  }
  // Large buffers: root scatters one segment to each rank, then a ring allgather
  // spreads them, so the root sends the data about once instead of size-1 times.
  std::vector<size_t> seg(size_, bytes / size_);
  for (size_t r = 0; r < bytes % size_; ++r) ++seg[r];
  std::vector<size_t> off = Offsets(seg);
  for (int q = 0; q < size_; ++q) {
    if (q == root) continue;
    if (rank_ == root) xs.push_back({q, true, p + off[q], seg[q]});
    if (rank_ == q) xs.push_back({root, false, p + off[q], seg[q]});
  }
  HVD_RETURN_IF_ERROR(Run(xs));
  return RingAllgather(p, off, seg);
}

Status TcpTransport::Alltoallv(const void* send, const std::vector<size_t>& send_bytes,
                               void* recv, const std::vector<size_t>& recv_bytes) {
  std::vector<size_t> soff = Offsets(send_bytes), roff = Offsets(recv_bytes);
  char* in = const_cast<char*>(static_cast<const char*>(send));
  char* out = static_cast<char*>(recv);
  if (recv_bytes[rank_] > 0) std::memcpy(out + roff[rank_], in + soff[rank_], recv_bytes[rank_]);
  std::vector<Xfer> xs;
  for (int p = 0; p < size_; ++p) {
    if (p == rank_) continue;
    xs.push_back({p, true, in + soff[p], send_bytes[p]});
    xs.push_back({p, false, out + roff[p], recv_bytes[p]});
  }
  return Run(xs);
}

Status TcpTransport::Reducescatter(void* buf, const std::vector<size_t>& counts, DataType dtype,
                                   ReduceOp op, void* out) {
  size_t esize = DataTypeSize(dtype);
  size_t total = 0;
  for (size_t c : counts) total += c;
  if (size_ == 1) {
    std::memmove(out, buf, total * esize);
    return Status::Ok();
  }
  if (total * esize <= options_.small_allreduce_bytes) {
    return DirectReduce(buf, counts, dtype, op, out, /*all=*/false);
  }
  std::vector<size_t> offsets = Offsets(counts);
  char* p = static_cast<char*>(buf);
  HVD_RETURN_IF_ERROR(RingReduceScatter(p, offsets, counts, dtype, op));
  std::memmove(out, p + offsets[rank_] * esize, counts[rank_] * esize);
  return Status::Ok();
}

}  // namespace hvd
