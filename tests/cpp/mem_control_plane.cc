#include "mem_control_plane.h"

#include <chrono>

namespace hvd_test {
namespace {

const char* OpName(int op) {
  static const char* const kNames[] = {"none", "Gather", "Bcast", "Allgather"};
  return kNames[op];
}

}  // namespace

PlaneStats PlaneStats::operator-(const PlaneStats& o) const {
  PlaneStats d;
  d.gathers = gathers - o.gathers;
  d.bcasts = bcasts - o.bcasts;
  d.allgathers = allgathers - o.allgathers;
  d.bit_allreduces = bit_allreduces - o.bit_allreduces;
  d.msgs_sent = msgs_sent - o.msgs_sent;
  d.msgs_recv = msgs_recv - o.msgs_recv;
  d.bytes_sent = bytes_sent - o.bytes_sent;
  d.bytes_recv = bytes_recv - o.bytes_recv;
  return d;
}

MemWorld::MemWorld(int size, double timeout_s) : size_(size), timeout_s_(timeout_s) {
  for (int k = 0; k < kRounds; ++k) {
    rounds_[k].seq = k;
    rounds_[k].slots.resize(size);
  }
  for (int r = 0; r < size; ++r) planes_.push_back(std::make_unique<MemControlPlane>(this, r));
}

void MemWorld::Abort(const std::string& why) {
  {
    std::lock_guard<std::mutex> lock(why_mu_);
    if (why_.empty()) why_ = why;
  }
  aborted_ = true;
  // Taking each round's mutex orders the flag before any waiter's next check.
  for (auto& rd : rounds_) {
    { std::lock_guard<std::mutex> lock(rd.mu); }
    rd.cv.notify_all();
  }
}

std::string MemWorld::Failure() {
  std::lock_guard<std::mutex> lock(why_mu_);
  return "in-memory control plane aborted: " + why_;
}

template <typename Pred>
hvd::Status MemWorld::Wait(Round& rd, std::unique_lock<std::mutex>* lock, Pred pred,
                           const char* what, int rank, uint64_t seq) {
  auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s_);
  bool ok = rd.cv.wait_until(*lock, deadline, [&] { return aborted_ || pred(); });
  if (aborted_) return hvd::Status::Aborted(Failure());
  if (!ok) {
    std::string why = "rank " + std::to_string(rank) + " waited " + std::to_string(timeout_s_) +
                      " s in call #" + std::to_string(seq) + " (" + what + "); " +
                      std::to_string(rd.arrived) + " of " + std::to_string(size_) +
                      " ranks had arrived";
    lock->unlock();
    Abort(why);
    lock->lock();
    return hvd::Status::Aborted(Failure());
  }
  return hvd::Status::Ok();
}

hvd::Status MemWorld::Enter(Round& rd, std::unique_lock<std::mutex>* lock, uint64_t seq, Op op,
                            int rank) {
  HVD_RETURN_IF_ERROR(Wait(
      rd, lock, [&] { return rd.seq == seq; }, "waiting for a free round", rank, seq));
  if (rd.op == Op::kNone) {
    rd.op = op;
    rd.op_rank = rank;
  } else if (rd.op != op) {
    std::string why = "call #" + std::to_string(seq) + ": rank " + std::to_string(rank) +
                      " called " + OpName(static_cast<int>(op)) + " but rank " +
                      std::to_string(rd.op_rank) + " called " + OpName(static_cast<int>(rd.op)) +
                      " (ranks out of step)";
    lock->unlock();
    Abort(why);
    lock->lock();
    return hvd::Status::Aborted(Failure());
  }
  return hvd::Status::Ok();
}

void MemWorld::Depart(Round& rd) {
  if (++rd.departed < size_) return;
  rd.seq += kRounds;
  rd.op = Op::kNone;
  rd.op_rank = -1;
  rd.arrived = 0;
  rd.departed = 0;
  rd.root_in = false;
  rd.cv.notify_all();  // ranks waiting to enter the next use of this round
}

int MemControlPlane::size() const { return world_->size(); }

hvd::Status MemControlPlane::Gather(const std::string& mine, std::vector<std::string>* all) {
  const int n = world_->size();
  const uint64_t seq = seq_++;
  auto& rd = world_->rounds_[seq % MemWorld::kRounds];
  std::unique_lock<std::mutex> lock(rd.mu);
  HVD_RETURN_IF_ERROR(world_->Enter(rd, &lock, seq, MemWorld::Op::kGather, rank_));
  ++stats_.gathers;
  lock.unlock();
  rd.slots[rank_] = mine;  // nobody reads slot rank_ before `arrived` counts it
  lock.lock();
  if (++rd.arrived == n) rd.cv.notify_all();
  if (rank_ != 0) {
    world_->Depart(rd);
    ++stats_.msgs_sent;
    stats_.bytes_sent += static_cast<int64_t>(mine.size());
    return hvd::Status::Ok();
  }
  HVD_RETURN_IF_ERROR(world_->Wait(
      rd, &lock, [&] { return rd.arrived == n; }, "Gather at rank 0", rank_, seq));
  // Rank 0 is the only reader: take the messages instead of copying them.
  all->resize(n);
  for (int r = 0; r < n; ++r) {
    (*all)[r].swap(rd.slots[r]);
    rd.slots[r].clear();
    if (r != 0) stats_.bytes_recv += static_cast<int64_t>((*all)[r].size());
  }
  stats_.msgs_recv += n - 1;
  world_->Depart(rd);
  return hvd::Status::Ok();
}

hvd::Status MemControlPlane::Bcast(std::string* data) {
  const int n = world_->size();
  const uint64_t seq = seq_++;
  auto& rd = world_->rounds_[seq % MemWorld::kRounds];
  std::unique_lock<std::mutex> lock(rd.mu);
  HVD_RETURN_IF_ERROR(world_->Enter(rd, &lock, seq, MemWorld::Op::kBcast, rank_));
  ++stats_.bcasts;
  if (rank_ == 0) {
    lock.unlock();
    rd.slots[0] = *data;
    lock.lock();
    rd.root_in = true;
    rd.cv.notify_all();
    world_->Depart(rd);
    stats_.msgs_sent += n - 1;
    stats_.bytes_sent += static_cast<int64_t>(data->size()) * (n - 1);
    return hvd::Status::Ok();
  }
  HVD_RETURN_IF_ERROR(world_->Wait(
      rd, &lock, [&] { return rd.root_in; }, "Bcast from rank 0", rank_, seq));
  lock.unlock();
  *data = rd.slots[0];  // read-only until every rank has departed
  lock.lock();
  world_->Depart(rd);
  ++stats_.msgs_recv;
  stats_.bytes_recv += static_cast<int64_t>(data->size());
  return hvd::Status::Ok();
}

hvd::Status MemControlPlane::Allgather(const std::string& mine, std::vector<std::string>* all) {
  const int n = world_->size();
  const uint64_t seq = seq_++;
  auto& rd = world_->rounds_[seq % MemWorld::kRounds];
  std::unique_lock<std::mutex> lock(rd.mu);
  HVD_RETURN_IF_ERROR(world_->Enter(rd, &lock, seq, MemWorld::Op::kAllgather, rank_));
  ++stats_.allgathers;
  lock.unlock();
  rd.slots[rank_] = mine;
  lock.lock();
  if (++rd.arrived == n) rd.cv.notify_all();
  HVD_RETURN_IF_ERROR(world_->Wait(
      rd, &lock, [&] { return rd.arrived == n; }, "Allgather", rank_, seq));
  lock.unlock();
  // Every slot is read-only until the last rank departs.
  all->resize(n);
  hvd::Status st = hvd::Status::Ok();
  for (int r = 0; r < n; ++r) {
    (*all)[r] = rd.slots[r];
    if (rd.slots[r].size() != mine.size() && st.ok()) {
      st = hvd::Status::Aborted("Allgather: rank " + std::to_string(r) + " sent " +
                                std::to_string(rd.slots[r].size()) + " bytes, rank " +
                                std::to_string(rank_) + " " + std::to_string(mine.size()));
    }
  }
  lock.lock();
  world_->Depart(rd);
  stats_.msgs_sent += n - 1;
  stats_.msgs_recv += n - 1;
  stats_.bytes_sent += static_cast<int64_t>(mine.size()) * (n - 1);
  stats_.bytes_recv += static_cast<int64_t>(mine.size()) * (n - 1);
  return st;
}

hvd::Status MemControlPlane::AllreduceBits(std::vector<uint64_t>* and_bits,
                                           std::vector<uint64_t>* or_bits) {
  const PlaneStats before = stats_;
  hvd::Status st = ControlPlane::AllreduceBits(and_bits, or_bits);  // via Allgather
  const int n = world_->size();
  int rounds = 0;
  while ((1 << rounds) < n) ++rounds;
  const int64_t bytes = static_cast<int64_t>(and_bits->size() + or_bits->size()) * 8;
  stats_ = before;
  ++stats_.bit_allreduces;
  stats_.msgs_sent += rounds;
  stats_.msgs_recv += rounds;
  stats_.bytes_sent += rounds * bytes;
  stats_.bytes_recv += rounds * bytes;
  return st;
}

}  // namespace hvd_test
