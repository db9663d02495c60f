// The shared-memory group's collectives (docs/design.md §5): the reduce and copy
// pipelines through the ranks' slots, and allreduce, reduce-scatter, allgather,
// broadcast, barrier and the control-message exchange built on them. The group's
// set-up, helper threads and barrier are in shm.cc.
#include <algorithm>
#include <cstring>
#include <memory>
#include <string>
#include <system_error>
#include <vector>

#include "common/fnv.h"
#include "common/logging.h"
#include "transport/shm.h"
#include "transport/shm_helpers.h"
#include "transport/shm_segment.h"

namespace hvd {

using namespace shm;  // NOLINT: this file implements the segment's protocol

namespace {

constexpr size_t kReduceBlock = 8192;   // bytes reduced over all ranks at a time
constexpr size_t kExchangeHeader = 64;  // a control message's length, then its bytes

void Copy(char* dst, const char* src, size_t n) {
  if (n > 0) std::memcpy(dst, src, n);
}

uint64_t HashSizes(const std::vector<size_t>& v) {
  Fnv1a h;
  for (size_t x : v) h.Int(x);
  return h.value();
}

}  // namespace

template <typename Fn>
void ShmGroup::Parallel(size_t bytes, const Fn& fn) {
  // Smaller parts cost more to hand out than they save.
  const int parts = static_cast<int>(
      std::min<size_t>(threads_, bytes / std::max<size_t>(1, options_.min_part_bytes)));
  if (parts <= 1) {
    fn(0, 1);
    return;
  }
  if (!helpers_) {
    try {
      helpers_ = std::make_unique<Helpers>(threads_ - 1, spin_ns_);
    } catch (const std::system_error& e) {
      HVD_LOG(kWarning) << "shared memory: could not start " << threads_ - 1 << " helper threads ("
                        << e.what() << "); copying on one thread";
      threads_ = 1;
      fn(0, 1);
      return;
    }
  }
  helpers_->Run(parts, [&](int part) { fn(part, parts); });
}

// ---------------------------------------------------------------------------
// Pipelines. A step is the work between two barriers. Buffer b is reused for
// the chunk three allocations later, i.e. at least three steps later, and a
// chunk's data is dead two steps after it was written: so no barrier beyond the
// one per step is needed, also from one call to the next.

// Chunk c (up to slot_bytes per rank) of the elements is split into `size`
// shares; rank r reduces share r:
//   step c:   every rank copies its chunk, except its own share, into its slot;
//   step c+1: each rank reduces its share over the ranks in rank order (its own
//             data straight from its buffer) and writes the result into its own
//             buffer and into its slot, where its own share would have been;
//   step c+2: every rank copies the other shares' results (the parts of them
//             inside [out_begin, out_end)) from the other slots.
// So each rank writes only its own slot, and each result line has one writer.
Status ShmGroup::ReducePipeline(const shm::Descriptor& d, char* buf, size_t out_begin,
                                size_t out_end) {
  const DataType dtype = static_cast<DataType>(d.dtype);
  const ReduceOp op = static_cast<ReduceOp>(d.op);
  const size_t count = d.count;
  const size_t es = DataTypeSize(dtype);
  const size_t per = options_.slot_bytes / es;  // elements per chunk
  const size_t chunks = (count + per - 1) / per;
  // Shares are whole cache lines, so that two ranks never write one line.
  const size_t align = std::max<size_t>(1, 64 / es);
  // Elements [*lo, *hi) of the stream are share r of chunk c.
  auto share = [&](size_t c, int r, size_t* lo, size_t* hi) {
    const size_t begin = c * per, end = std::min(count, begin + per);
    const size_t n = RoundUp((end - begin + size_ - 1) / size_, align);
    *lo = std::min(end, begin + r * n);
    *hi = std::min(end, *lo + n);
  };
  // Where element i of chunk c lives in rank r's slot.
  auto at = [&](size_t c, int r, size_t i) { return Slot(next_set_ + c, r) + (i - c * per) * es; };
  // Part `part` of `parts` of elements [lo, hi), cut at cache lines.
  auto cut = [&](size_t lo, size_t hi, int part, int parts, size_t* a, size_t* b) {
    const size_t n = RoundUp((hi - lo + parts - 1) / parts, align);
    *a = std::min(hi, lo + part * n);
    *b = std::min(hi, *a + n);
  };
  // Step j: copy out the other ranks' shares of chunk j - 2, reduce this rank's
  // share of chunk j - 1, copy chunk j (but this rank's share) in. Each part of
  // the step takes its fraction of every one of these ranges.
  auto step = [&](size_t j, int part, int parts) {
    size_t lo, hi, a, b;
    if (j >= 2) {
      for (int r = 0; r < size_; ++r) {
        share(j - 2, r, &lo, &hi);
        lo = std::max(lo, out_begin);
        hi = std::min(hi, out_end);
        if (r == rank_ || lo >= hi) continue;
        cut(lo, hi, part, parts, &a, &b);
        Copy(buf + a * es, at(j - 2, r, a), (b - a) * es);
      }
    }
    if (j >= 1 && j <= chunks) {
      const size_t c = j - 1;
      share(c, rank_, &lo, &hi);
      cut(lo, hi, part, parts, &lo, &hi);
      // Block by block, in an accumulator that stays in the L1 cache while the
      // ranks' data streams past it.
      alignas(64) char acc[kReduceBlock];
      for (size_t b_lo = lo; b_lo < hi; b_lo += kReduceBlock / es) {
        const size_t n = std::min(hi, b_lo + kReduceBlock / es) - b_lo;
        for (int r = 0; r < size_; ++r) {
          const char* x = r == rank_ ? buf + b_lo * es : at(c, r, b_lo);
          if (r == 0) {
            std::memcpy(acc, x, n * es);
          } else {
            ReduceInto(acc, x, n, dtype, op);
          }
        }
        std::memcpy(at(c, rank_, b_lo), acc, n * es);
        const size_t x = std::max(b_lo, out_begin), y = std::min(b_lo + n, out_end);
        if (x < y) Copy(buf + x * es, acc + (x - b_lo) * es, (y - x) * es);
      }
    }
    if (j < chunks) {
      share(j, rank_, &lo, &hi);
      const size_t begin = j * per, end = std::min(count, begin + per);
      cut(begin, lo, part, parts, &a, &b);
      Copy(at(j, rank_, a), buf + a * es, (b - a) * es);
      cut(hi, end, part, parts, &a, &b);
      Copy(at(j, rank_, a), buf + a * es, (b - a) * es);
    }
  };
  for (size_t j = 0; j <= chunks + 1; ++j) {
    Parallel(std::min(count, per) * es, [&](int part, int parts) { step(j, part, parts); });
    if (j == 0) {
      HVD_RETURN_IF_ERROR(FirstSync(d));
    } else if (j <= chunks) {
      HVD_RETURN_IF_ERROR(Sync());
    }
  }
  next_set_ += chunks;
  return Status::Ok();
}

// Window c (one whole buffer, size * slot_bytes, of the byte stream buf[0,
// total)): step c, every rank copies the part of the window inside its own range
// [mine_begin, mine_end) in; step c+1, every rank copies the rest of it out.
Status ShmGroup::CopyPipeline(const shm::Descriptor& d, char* buf, size_t mine_begin,
                              size_t mine_end) {
  const size_t total = d.count;
  const size_t window = size_ * options_.slot_bytes;
  const size_t chunks = (total + window - 1) / window;
  for (size_t j = 0; j <= chunks; ++j) {
    if (j >= 1) {
      const size_t lo = (j - 1) * window, hi = std::min(total, lo + window);
      const char* src = Set(next_set_ + j - 1);
      const size_t a = std::min(hi, mine_begin), b = std::max(lo, mine_end);
      if (lo < a) Copy(buf + lo, src, a - lo);
      if (b < hi) Copy(buf + b, src + (b - lo), hi - b);
    }
    if (j < chunks) {
      const size_t lo = j * window, hi = std::min(total, lo + window);
      const size_t a = std::max(lo, mine_begin), b = std::min(hi, mine_end);
      if (a < b) Copy(Set(next_set_ + j) + (a - lo), buf + a, b - a);
    }
    if (j == 0) {
      HVD_RETURN_IF_ERROR(FirstSync(d));
    } else if (j < chunks) {
      HVD_RETURN_IF_ERROR(Sync());
    }
  }
  next_set_ += chunks;
  return Status::Ok();
}

// ---------------------------------------------------------------------------
// Collectives.

namespace {
Status CheckReduceOp(ReduceOp op) {
  if (op == ReduceOp::kSum || op == ReduceOp::kMin || op == ReduceOp::kMax ||
      op == ReduceOp::kProduct) {
    return Status::Ok();
  }
  return Status::InvalidArgument(std::string("shared-memory reductions support Sum, Min, Max ") +
                                 "and Product, not " + ReduceOpName(op));
}
}  // namespace

Status ShmGroup::Allreduce(void* buf, size_t count, DataType dtype, ReduceOp op) {
  HVD_RETURN_IF_ERROR(CheckReduceOp(op));
  HVD_RETURN_IF_ERROR(Ready());
  if (size_ == 1) return Status::Ok();
  Descriptor d;
  d.kind = kAllreduceCall;
  d.dtype = static_cast<uint64_t>(dtype);
  d.op = static_cast<uint64_t>(op);
  d.count = count;
  return Finish(ReducePipeline(d, static_cast<char*>(buf), 0, count));
}

Status ShmGroup::ReduceScatter(void* buf, const std::vector<size_t>& counts, DataType dtype,
                               ReduceOp op) {
  HVD_RETURN_IF_ERROR(CheckReduceOp(op));
  if (counts.size() != static_cast<size_t>(size_)) {
    return Status::InvalidArgument("ShmGroup::ReduceScatter: " + std::to_string(counts.size()) +
                                   " counts for " + std::to_string(size_) + " local ranks");
  }
  HVD_RETURN_IF_ERROR(Ready());
  if (size_ == 1) return Status::Ok();
  Descriptor d;
  d.kind = kReduceScatterCall;
  d.dtype = static_cast<uint64_t>(dtype);
  d.op = static_cast<uint64_t>(op);
  size_t begin = 0;
  for (int r = 0; r < size_; ++r) {
    if (r == rank_) begin = d.count;
    d.count += counts[r];
  }
  d.layout = HashSizes(counts);
  return Finish(ReducePipeline(d, static_cast<char*>(buf), begin, begin + counts[rank_]));
}

Status ShmGroup::Allgather(void* buf, const std::vector<size_t>& bytes) {
  if (bytes.size() != static_cast<size_t>(size_)) {
    return Status::InvalidArgument("ShmGroup::Allgather: " + std::to_string(bytes.size()) +
                                   " sizes for " + std::to_string(size_) + " local ranks");
  }
  HVD_RETURN_IF_ERROR(Ready());
  if (size_ == 1) return Status::Ok();
  Descriptor d;
  d.kind = kAllgatherCall;
  size_t begin = 0;
  for (int r = 0; r < size_; ++r) {
    if (r == rank_) begin = d.count;
    d.count += bytes[r];
  }
  d.layout = HashSizes(bytes);
  return Finish(CopyPipeline(d, static_cast<char*>(buf), begin, begin + bytes[rank_]));
}

Status ShmGroup::Broadcast(void* buf, size_t bytes, int root) {
  if (root < 0 || root >= size_) {
    return Status::InvalidArgument("ShmGroup::Broadcast: root " + std::to_string(root) +
                                   " is not a local rank (local size " + std::to_string(size_) +
                                   ")");
  }
  HVD_RETURN_IF_ERROR(Ready());
  if (size_ == 1) return Status::Ok();
  Descriptor d;
  d.kind = kBroadcastCall;
  d.count = bytes;
  d.root = static_cast<uint64_t>(root);
  const size_t mine = rank_ == root ? bytes : 0;
  return Finish(CopyPipeline(d, static_cast<char*>(buf), 0, mine));
}

Status ShmGroup::Barrier() {
  HVD_RETURN_IF_ERROR(Ready());
  Descriptor d;
  d.kind = kBarrierCall;
  return Finish(FirstSync(d));
}

// Control messages. Step k: each contributing rank writes its message's length
// and bytes [k * cap, (k + 1) * cap) into its slot of a fresh buffer; after the
// barrier the receivers copy them out. The first step tells every rank the
// longest length, hence the number of steps. Buffers rotate as in the pipelines.
Status ShmGroup::Exchange(uint64_t tag, const std::string* mine, std::vector<std::string>* all) {
  HVD_RETURN_IF_ERROR(Ready());
  if (all != nullptr) all->assign(size_, std::string());
  const size_t cap = options_.slot_bytes - kExchangeHeader;
  const uint64_t len = mine != nullptr ? mine->size() : 0;
  Descriptor d;
  d.kind = kExchangeCall;
  d.op = tag;
  size_t steps = 1;
  std::vector<uint64_t> lens(size_, 0);
  for (size_t k = 0; k < steps; ++k) {
    char* slot = Slot(next_set_ + k, rank_);
    std::memcpy(slot, &len, sizeof(len));
    if (k * cap < len) {
      Copy(slot + kExchangeHeader, mine->data() + k * cap, std::min<uint64_t>(cap, len - k * cap));
    }
    Status st = k == 0 ? FirstSync(d) : Sync();
    if (!st.ok()) {
      next_set_ += k + 1;
      return Finish(st);
    }
    if (k == 0) {
      uint64_t longest = 0;
      for (int r = 0; r < size_; ++r) {
        std::memcpy(&lens[r], Slot(next_set_, r), sizeof(uint64_t));
        longest = std::max(longest, lens[r]);
        if (all != nullptr) (*all)[r].reserve(lens[r]);
      }
      steps = std::max<size_t>(1, (longest + cap - 1) / cap);
    }
    if (all == nullptr) continue;
    for (int r = 0; r < size_; ++r) {
      if (k * cap < lens[r]) {
        (*all)[r].append(Slot(next_set_ + k, r) + kExchangeHeader,
                         std::min<uint64_t>(cap, lens[r] - k * cap));
      }
    }
  }
  next_set_ += steps;
  return Status::Ok();
}

}  // namespace hvd
