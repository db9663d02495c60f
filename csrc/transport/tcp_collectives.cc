// The TCP transport's algorithms, all built on Run(): a list of transfers with
// peers that proceed concurrently. Every algorithm pairs a rank with O(log n)
// peers (ring neighbours, recursive-doubling partners, Bruck and tree peers), so
// a rank opens few connections; alltoall alone talks to everyone.
#include <algorithm>
#include <cstring>

#include "transport/shm.h"
#include "transport/tcp_transport.h"

namespace hvd {
namespace {

// Element offsets of `counts` laid end to end.
std::vector<size_t> Offsets(const std::vector<size_t>& counts) {
  std::vector<size_t> off(counts.size(), 0);
  for (size_t i = 1; i < counts.size(); ++i) off[i] = off[i - 1] + counts[i - 1];
  return off;
}

// Binomial tree over virtual ranks 0..n-1 rooted at 0: v's parent is v minus its
// lowest set bit; its children are v + m for the powers of two m below that bit.
// Children come largest subtree first. The subtree of v is [v, v + Span(v, n)).
int TreeParent(int v) { return v == 0 ? -1 : v & (v - 1); }
std::vector<int> TreeChildren(int v, int n) {
  std::vector<int> kids;
  int low = v == 0 ? 1 << 30 : v & -v;
  for (int m = 1; m < low && v + m < n; m <<= 1) kids.push_back(v + m);
  std::reverse(kids.begin(), kids.end());
  return kids;
}
int Span(int v, int n) {
  int low = v == 0 ? n : v & -v;
  return std::min(low, n - v);
}

const size_t kMaxControlMessage = 1ull << 32;
// ShmGroup::Exchange tags of the control operations (a rank calling another
// operation than its peers gets a kMismatch).
enum : uint64_t { kShmGather = 1, kShmBcast, kShmAllgather };

}  // namespace

// Control plane. Gather: each rank sends its parent one frame holding the records
// (rank, length, bytes) of its whole subtree; rank 0 ends with all of them.
Status TcpTransport::Gather(const std::string& mine, std::vector<std::string>* all) {
  if (ShmControl()) {
    TendListener();
    return local_->Exchange(kShmGather, &mine, rank_ == 0 ? all : nullptr);
  }
  std::string acc;
  auto add_record = [&acc](uint32_t r, const std::string& body) {
    uint64_t len = body.size();
    acc.append(reinterpret_cast<const char*>(&r), 4);
    acc.append(reinterpret_cast<const char*>(&len), 8);
    acc += body;
  };
  add_record(static_cast<uint32_t>(rank_), mine);
  std::vector<int> kids = TreeChildren(rank_, size_);
  std::vector<uint64_t> lens(kids.size(), 0);
  std::vector<Xfer> xs;
  for (size_t i = 0; i < kids.size(); ++i) {
    xs.push_back({kids[i], false, reinterpret_cast<char*>(&lens[i]), 8});
  }
  HVD_RETURN_IF_ERROR(Run(xs));
  std::vector<std::string> bodies(kids.size());
  xs.clear();
  for (size_t i = 0; i < kids.size(); ++i) {
    if (lens[i] > kMaxControlMessage) {
      return Status::Aborted("rank " + std::to_string(global_[kids[i]]) +
                             " sent a corrupt control message length");
    }
    bodies[i].resize(lens[i]);
    xs.push_back({kids[i], false, &bodies[i][0], lens[i]});
  }
  HVD_RETURN_IF_ERROR(Run(xs));
  for (auto& b : bodies) acc += b;
  if (rank_ != 0) {
    uint64_t n = acc.size();
    std::string frame(reinterpret_cast<const char*>(&n), 8);
    frame += acc;
    xs = {{TreeParent(rank_), true, &frame[0], frame.size()}};
    return Run(xs);
  }
  all->assign(size_, std::string());
  std::vector<bool> seen(size_, false);
  for (size_t pos = 0; pos < acc.size();) {
    uint32_t r = 0;
    uint64_t len = 0;
    if (acc.size() - pos < 12) return Status::Aborted("corrupt control message (truncated)");
    std::memcpy(&r, acc.data() + pos, 4);
    std::memcpy(&len, acc.data() + pos + 4, 8);
    pos += 12;
    if (r >= static_cast<uint32_t>(size_) || seen[r] || len > acc.size() - pos) {
      return Status::Aborted("corrupt control message (bad record)");
    }
    seen[r] = true;
    (*all)[r] = acc.substr(pos, len);
    pos += len;
  }
  if (std::count(seen.begin(), seen.end(), true) != size_) {
    return Status::Aborted("corrupt control message (missing ranks)");
  }
  return Status::Ok();
}

// Bcast: down the same tree, each rank forwarding the length-prefixed frame.
Status TcpTransport::Bcast(std::string* data) {
  if (size_ == 1) return Status::Ok();
  if (ShmControl()) {
    TendListener();
    if (rank_ == 0) return local_->Exchange(kShmBcast, data, nullptr);
    std::vector<std::string> all;
    HVD_RETURN_IF_ERROR(local_->Exchange(kShmBcast, nullptr, &all));
    *data = std::move(all[0]);
    return Status::Ok();
  }
  uint64_t n = data->size();
  if (rank_ != 0) {
    std::vector<Xfer> xs{{TreeParent(rank_), false, reinterpret_cast<char*>(&n), 8}};
    HVD_RETURN_IF_ERROR(Run(xs));
    if (n > kMaxControlMessage) {
      return Status::Aborted("rank " + std::to_string(global_[TreeParent(rank_)]) +
                             " sent a corrupt control message length");
    }
    data->resize(n);
    xs = {{TreeParent(rank_), false, &(*data)[0], n}};
    HVD_RETURN_IF_ERROR(Run(xs));
  }
  std::vector<Xfer> xs;
  for (int c : TreeChildren(rank_, size_)) {
    xs.push_back({c, true, reinterpret_cast<char*>(&n), 8});
    xs.push_back({c, true, &(*data)[0], n});
  }
  return Run(xs);
}

Status TcpTransport::Allgather(const std::string& mine, std::vector<std::string>* all) {
  if (ShmControl()) {
    TendListener();
    return local_->Exchange(kShmAllgather, &mine, all);
  }
  const size_t n = mine.size();
  std::string buf(n * size_, '\0');
  HVD_RETURN_IF_ERROR(Allgatherv(mine.data(), &buf[0], std::vector<size_t>(size_, n)));
  all->resize(size_);
  for (int r = 0; r < size_; ++r) (*all)[r] = buf.substr(r * n, n);
  return Status::Ok();
}

Status TcpTransport::AllreduceBits(std::vector<uint64_t>* and_bits,
                                   std::vector<uint64_t>* or_bits) {
  if (size_ == 1) return Status::Ok();
  // Through the segment, everybody reads everybody's bits: one barrier.
  if (ShmControl()) return ControlPlane::AllreduceBits(and_bits, or_bits);
  const size_t na = and_bits->size(), no = or_bits->size();
  std::vector<uint64_t> words(*and_bits);
  words.insert(words.end(), or_bits->begin(), or_bits->end());
  HVD_RETURN_IF_ERROR(RecursiveDoubling(
      reinterpret_cast<char*>(words.data()), words.size() * 8, [&](char* dst, const char* src) {
        uint64_t* d = reinterpret_cast<uint64_t*>(dst);
        const uint64_t* s = reinterpret_cast<const uint64_t*>(src);
        for (size_t i = 0; i < na; ++i) d[i] &= s[i];
        for (size_t i = na; i < na + no; ++i) d[i] |= s[i];
      }));
  std::copy(words.begin(), words.begin() + na, and_bits->begin());
  std::copy(words.begin() + na, words.begin() + na + no, or_bits->begin());
  return Status::Ok();
}

void TcpTransport::AddBlocks(std::vector<Xfer>* xs, int peer, bool send, char* buf,
                             const std::vector<size_t>& offsets, const std::vector<size_t>& bytes,
                             int first, int count) {
  // [first, first+count) mod n is one contiguous byte range, or two if it wraps.
  int end = std::min(first + count, size_);
  size_t len = 0;
  for (int b = first; b < end; ++b) len += bytes[b];
  xs->push_back({peer, send, buf + offsets[first], len});
  if (first + count > size_) {
    len = 0;
    for (int b = 0; b < first + count - size_; ++b) len += bytes[b];
    xs->push_back({peer, send, buf, len});
  }
}

// Bruck's allgather, in place: block v (of virtual rank v; real rank (v+root)%n)
// sits at offsets[v]. After the round with distance d, v holds blocks
// [v, v + 2d): it sends its first min(d, n-d) blocks to v-d and receives the
// blocks starting at v+d from v+d. ceil(log2 n) rounds, each byte received once.
Status TcpTransport::BruckAllgather(char* buf, const std::vector<size_t>& offsets,
                                    const std::vector<size_t>& bytes, int root) {
  const int n = size_;
  const int v = (rank_ - root + n) % n;
  for (int d = 1; d < n; d <<= 1) {
    int count = std::min(d, n - d);
    std::vector<Xfer> xs;
    AddBlocks(&xs, (v - d + n + root) % n, true, buf, offsets, bytes, v, count);
    AddBlocks(&xs, (v + d + root) % n, false, buf, offsets, bytes, (v + d) % n, count);
    HVD_RETURN_IF_ERROR(Run(xs));
  }
  return Status::Ok();
}

Status TcpTransport::Allgatherv(const void* send, void* recv, const std::vector<size_t>& bytes) {
  std::vector<size_t> off = Offsets(bytes);
  char* out = static_cast<char*>(recv);
  if (bytes[rank_] > 0) std::memmove(out + off[rank_], send, bytes[rank_]);
  if (size_ == 1) return Status::Ok();
  const Path path = PathOf(OpType::kAllgather, off.back() + bytes.back());
  if (path == Path::kShm) return local_->Allgather(out, bytes);
  if (path == Path::kHier) return HierarchicalAllgather(out, off, bytes);
  return BruckAllgather(out, off, bytes, /*root=*/0);
}

// Binomial-tree broadcast of `bytes` from `root` (virtual rank 0).
Status TcpTransport::TreeBroadcast(char* buf, size_t bytes, int root) {
  const int n = size_;
  const int v = (rank_ - root + n) % n;
  std::vector<Xfer> xs;
  if (v != 0) {
    xs.push_back({(TreeParent(v) + root) % n, false, buf, bytes});
    HVD_RETURN_IF_ERROR(Run(xs));
    xs.clear();
  }
  for (int c : TreeChildren(v, n)) xs.push_back({(c + root) % n, true, buf, bytes});
  return Run(xs);
}

// Binomial-tree scatter from `root`: virtual rank v ends with blocks
// [v, v + Span(v)) of the root's buffer, its own block v among them.
Status TcpTransport::TreeScatter(char* buf, const std::vector<size_t>& offsets,
                                 const std::vector<size_t>& bytes, int root) {
  const int n = size_;
  const int v = (rank_ - root + n) % n;
  std::vector<Xfer> xs;
  if (v != 0) {
    AddBlocks(&xs, (TreeParent(v) + root) % n, false, buf, offsets, bytes, v, Span(v, n));
    HVD_RETURN_IF_ERROR(Run(xs));
    xs.clear();
  }
  for (int c : TreeChildren(v, n)) {
    AddBlocks(&xs, (c + root) % n, true, buf, offsets, bytes, c, Span(c, n));
  }
  return Run(xs);
}

Status TcpTransport::Broadcast(void* buf, size_t bytes, int root) {
  if (size_ == 1 || bytes == 0) return Status::Ok();
  char* p = static_cast<char*>(buf);
  if (PathOf(OpType::kBroadcast, bytes) == Path::kShm) return local_->Broadcast(p, bytes, root);
  if (bytes <= options_.small_allreduce_bytes || size_ == 2) return TreeBroadcast(p, bytes, root);
  // Large buffers: scatter one block per rank down the tree, then allgather them,
  // so the root sends the data about once instead of log2(n) times.
  std::vector<size_t> seg(size_, bytes / size_);
  for (size_t r = 0; r < bytes % size_; ++r) ++seg[r];
  std::vector<size_t> off = Offsets(seg);
  HVD_RETURN_IF_ERROR(TreeScatter(p, off, seg, root));
  return BruckAllgather(p, off, seg, root);
}

Status TcpTransport::Transfer(void* buf, size_t bytes, int from, int to) {
  if (bytes == 0 || from == to) return Status::Ok();
  std::vector<Xfer> xs{{rank_ == from ? to : from, rank_ == from, static_cast<char*>(buf), bytes}};
  return Run(xs);
}

Status TcpTransport::Alltoallv(const void* send, const std::vector<size_t>& send_bytes, void* recv,
                               const std::vector<size_t>& recv_bytes) {
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

// Small buffers on up to this many ranks: one direct exchange beats log2(n) rounds.
constexpr int kDirectReduceMaxRanks = 4;

Status TcpTransport::Allreduce(void* buf, size_t count, DataType dtype, ReduceOp op) {
  if (size_ == 1 || count == 0) return Status::Ok();
  size_t esize = DataTypeSize(dtype);
  char* p = static_cast<char*>(buf);
  const Path path = PathOf(OpType::kAllreduce, count * esize);
  if (path == Path::kShm) return local_->Allreduce(p, count, dtype, op);
  if (path == Path::kHier) return HierarchicalAllreduce(p, count, dtype, op);
  if (count * esize <= options_.small_allreduce_bytes || count < static_cast<size_t>(size_)) {
    if (size_ <= kDirectReduceMaxRanks) return DirectReduce(buf, {count}, dtype, op, buf, true);
    return RecursiveDoubling(p, count * esize, [&](char* dst, const char* src) {
      ReduceInto(dst, src, count, dtype, op);
    });
  }
  std::vector<size_t> counts(size_, count / size_);
  for (size_t r = 0; r < count % size_; ++r) ++counts[r];
  std::vector<size_t> offsets = Offsets(counts);
  HVD_RETURN_IF_ERROR(RingReduceScatter(p, offsets, counts, dtype, op));
  std::vector<size_t> boff(size_), bbytes(size_);
  for (int r = 0; r < size_; ++r) {
    boff[r] = offsets[r] * esize;
    bbytes[r] = counts[r] * esize;
  }
  return RingAllgather(p, boff, bbytes);
}

// One exchange, then every rank reduces the contributions in rank order (so
// results are bitwise identical everywhere). all=true: allreduce of counts[0]
// elements, in place. all=false: reducescatter, segment r of buf goes to rank r,
// this rank's result lands in out.
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

// Recursive doubling on the largest power of two p2 <= n: ranks p2.. first fold
// into rank - p2 and get the result back at the end. In each round partners
// exchange everything and both compute op(lower rank's, higher rank's), so all
// ranks hold bitwise identical values after every round (Min/Max with NaN, too).
Status TcpTransport::RecursiveDoubling(char* buf, size_t bytes,
                                       const std::function<void(char*, const char*)>& reduce) {
  int p2 = 1;
  while (p2 * 2 <= size_) p2 *= 2;
  const int extra = size_ - p2;
  scratch_.resize(bytes);
  char* tmp = scratch_.data();
  std::vector<Xfer> xs;
  if (rank_ >= p2) {
    xs = {{rank_ - p2, true, buf, bytes}, {rank_ - p2, false, buf, bytes}};
    return Run(xs);  // the send completes before the reply can arrive
  }
  if (rank_ < extra) {
    xs = {{rank_ + p2, false, tmp, bytes}};
    HVD_RETURN_IF_ERROR(Run(xs));
    reduce(buf, tmp);
  }
  for (int mask = 1; mask < p2; mask <<= 1) {
    int partner = rank_ ^ mask;
    xs = {{partner, true, buf, bytes}, {partner, false, tmp, bytes}};
    HVD_RETURN_IF_ERROR(Run(xs));
    if (rank_ < partner) {
      reduce(buf, tmp);
    } else {
      reduce(tmp, buf);
      std::memcpy(buf, tmp, bytes);
    }
  }
  if (rank_ < extra) {
    xs = {{rank_ + p2, true, buf, bytes}};
    HVD_RETURN_IF_ERROR(Run(xs));
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

Status TcpTransport::Reducescatter(void* buf, const std::vector<size_t>& counts, DataType dtype,
                                   ReduceOp op, void* out) {
  size_t esize = DataTypeSize(dtype);
  size_t total = 0;
  for (size_t c : counts) total += c;
  std::vector<size_t> offsets = Offsets(counts);
  char* p = static_cast<char*>(buf);
  if (PathOf(OpType::kReducescatter, total * esize) == Path::kShm) {
    HVD_RETURN_IF_ERROR(local_->ReduceScatter(p, counts, dtype, op));
  } else if (size_ > 1 && total * esize <= options_.small_allreduce_bytes) {
    if (size_ <= kDirectReduceMaxRanks) return DirectReduce(buf, counts, dtype, op, out, false);
    HVD_RETURN_IF_ERROR(RecursiveDoubling(p, total * esize, [&](char* dst, const char* src) {
      ReduceInto(dst, src, total, dtype, op);
    }));
  } else if (size_ > 1) {
    HVD_RETURN_IF_ERROR(RingReduceScatter(p, offsets, counts, dtype, op));
  }
  std::memmove(out, p + offsets[rank_] * esize, counts[rank_] * esize);
  return Status::Ok();
}

}  // namespace hvd
