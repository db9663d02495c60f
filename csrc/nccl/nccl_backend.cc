#include "nccl/nccl_backend.h"

#include <c10/core/GradMode.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstring>
#include <numeric>
#include <stdexcept>
#include <string>
#include <unordered_map>

#include "core/fusion.h"
#include "nccl/nccl_event.h"
#include "nccl/nccl_reduce.h"

namespace hvd {

#define HVD_NCCL(call, comm)                                                                     \
  do {                                                                                           \
    ncclResult_t _r = (call);                                                                    \
    if (_r != ncclSuccess) {                                                                     \
      return Status::Aborted(std::string("NCCL error in " #call ": ") + ncclGetErrorString(_r) + \
                             " (" + ncclGetLastError(comm) + ")");                               \
    }                                                                                            \
  } while (0)

NcclBackend::~NcclBackend() {
  for (auto& kv : devices_) {
    if (kv.second.comm != nullptr) ncclCommDestroy(kv.second.comm);
  }
}

bool NcclBackend::Busy() {
  // Busy while the oldest unfinished op moves data. While it still waits for the
  // backward pass to compute its inputs, new gradients are better sent on their
  // own than merged with later ones and made to wait for them.
  for (auto& kv : devices_) {
    Device& d = kv.second;
    DropDone(d.in_flight, &times_);
    if (!d.in_flight.empty() && d.in_flight.front().start->Ready()) return true;
  }
  return false;
}

void NcclBackend::Abort() {
  for (auto& kv : devices_) {
    if (kv.second.comm != nullptr) ncclCommAbort(kv.second.comm);
    kv.second.comm = nullptr;
  }
  for (const auto& d : Directs()) d->Abort("the engine failed (a peer was lost or an op failed)");
}

std::vector<std::shared_ptr<NcclDirect>> NcclBackend::Directs() {
  MutexLock lock(direct_mu_);
  std::vector<std::shared_ptr<NcclDirect>> live;
  for (auto it = direct_.begin(); it != direct_.end();) {
    if (auto d = it->lock()) {
      live.push_back(std::move(d));
      ++it;
    } else {
      it = direct_.erase(it);
    }
  }
  return live;
}

void NcclBackend::EndDirect(const std::string& why) {
  for (const auto& d : Directs()) d->End(why, 1.0);
}

void NcclBackend::CollectiveTotals(uint64_t* ops, uint64_t* took_ns) {
  // Called every loop pass: without timing (zeros) it queries no event.
  if (time_collectives_) {
    for (auto& kv : devices_) DropDone(kv.second.in_flight, &times_);
  }
  *ops = times_.ops;
  *took_ns = times_.took_ns;
}

std::string NcclBackend::NewCommId() {
  ncclUniqueId id;
  const ncclResult_t r = ncclGetUniqueId(&id);
  if (r != ncclSuccess) {
    throw std::runtime_error(std::string("NCCL error in ncclGetUniqueId: ") +
                             ncclGetErrorString(r));
  }
  return std::string(reinterpret_cast<const char*>(&id), sizeof(id));
}

Status NcclBackend::JoinComm(const std::string& id, int rank, int size, int device,
                             std::shared_ptr<DirectComm>* out) {
  Status st = Status::Ok();
  auto d = std::make_shared<NcclDirect>(id, rank, size, device, &st);
  HVD_RETURN_IF_ERROR(st);
  {
    MutexLock lock(direct_mu_);
    direct_.push_back(d);
  }
  *out = std::move(d);
  return Status::Ok();
}

Status NcclBackend::Check() {
  for (auto& kv : devices_) {
    Device& d = kv.second;
    if (d.comm == nullptr) continue;
    HVD_RETURN_IF_ERROR(AsyncError(d.comm, kv.first));
    HVD_RETURN_IF_ERROR(CheckInFlight(d.in_flight, op_timeout_s_, kv.first, &times_));
  }
  for (const auto& d : Directs()) HVD_RETURN_IF_ERROR(d->Check(op_timeout_s_));
  return Status::Ok();
}

std::shared_ptr<GpuEvent> NcclBackend::RecordReady(const at::Tensor& tensor) {
  int device = tensor.device().index();
  auto ev = std::make_shared<NcclEvent>(device);
  const std::string error = ev->Record(c10::cuda::getCurrentCUDAStream(device));
  if (!error.empty()) throw std::runtime_error(error);
  return ev;
}

Status NcclBackend::Ensure(int device, Device** out) {
  Device& d = devices_[device];
  if (d.comm == nullptr) {
    std::string id_bytes;
    ncclUniqueId id;
    if (rank_ == 0) {
      HVD_NCCL(ncclGetUniqueId(&id), nullptr);
      id_bytes.assign(reinterpret_cast<const char*>(&id), sizeof(id));
    }
    HVD_RETURN_IF_ERROR(control_->Bcast(&id_bytes));
    if (id_bytes.size() != sizeof(id)) return Status::Aborted("bad NCCL unique id from rank 0");
    std::memcpy(&id, id_bytes.data(), sizeof(id));
    c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
    HVD_NCCL(ncclCommInitRank(&d.comm, size_, id, rank_), nullptr);
    d.stream = c10::cuda::getStreamFromPool(/*isHighPriority=*/true,
                                            static_cast<c10::DeviceIndex>(device));
  }
  *out = &d;
  return Status::Ok();
}

Status NcclBackend::Execute(const std::vector<Response>& batch, std::vector<Entry>& entries,
                            size_t fusion_bytes) {
  const int device = entries[0].sub.input.device().index();
  Device* d = nullptr;
  HVD_RETURN_IF_ERROR(Ensure(device, &d));
  c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
  // Inputs may require grad (hvd.allreduce of a leaf, say): the packing kernels
  // (cat_out) refuse that with autograd on, and this thread records no graph.
  c10::NoGradGuard no_grad;
  const c10::cuda::CUDAStream& stream = *d->stream;
  std::string error;
  for (auto& e : entries) {
    if (error.empty()) error = static_cast<NcclEvent*>(e.ready.get())->Block(stream);
  }
  const Response& r = batch[0];
  // Timed: what the straggler report compares across ranks (CollectiveTotals).
  const bool timed = time_collectives_ && compare_times_ && r.type == OpType::kAllreduce;
  auto start = std::make_shared<NcclEvent>(device, timed);
  if (error.empty()) error = start->Record(stream);
  if (!error.empty()) return Status::Aborted(error);
  c10::cuda::CUDAStreamGuard stream_guard(stream);

  std::vector<at::Tensor> outs(entries.size());
  at::Tensor splits;
  switch (r.type) {
    case OpType::kAllreduce:
      HVD_RETURN_IF_ERROR(Allreduce(*d, batch, entries, fusion_bytes));
      for (size_t i = 0; i < entries.size(); ++i) outs[i] = entries[i].sub.output;
      break;
    case OpType::kAllgather:
      HVD_RETURN_IF_ERROR(Allgather(*d, r, entries[0], &outs[0]));
      break;
    case OpType::kBroadcast:
      HVD_RETURN_IF_ERROR(Broadcast(*d, r, entries[0], &outs[0]));
      break;
    case OpType::kAlltoall:
      HVD_RETURN_IF_ERROR(Alltoall(*d, r, entries[0], &outs[0], &splits));
      break;
    case OpType::kReducescatter:
      HVD_RETURN_IF_ERROR(Reducescatter(*d, batch, entries, &outs));
      break;
    case OpType::kControl:
      return Status::Aborted(std::string("internal: ") + OpTypeName(r.type) +
                             " sent to the GPU backend");
  }
  auto done = std::make_shared<NcclEvent>(device, timed);
  error = done->Record(stream);
  if (!error.empty()) return Status::Aborted(error);
  DropDone(d->in_flight, &times_);
  const int64_t seq = timed ? static_cast<int64_t>(next_seq_++) : -1;
  d->in_flight.push_back(InFlight{std::move(start), done, r.name, {}, seq});
  for (size_t i = 0; i < entries.size(); ++i) {
    // Memory used on our stream must not be reused before that work finishes: an
    // input apart from the output is the allocator's to guard; the output (and an
    // input reduced in place) the handle's, until the stream that made the input
    // waits for the op (HandleState::Complete).
    const at::Tensor& in = entries[i].sub.input;
    const std::shared_ptr<GpuEvent>& made_on = entries[i].ready;
    if (made_on == nullptr || !outs[i].defined() || !in.storage().is_alias_of(outs[i].storage())) {
      c10::cuda::CUDACachingAllocator::recordStream(in.storage().data_ptr(), stream);
    }
    entries[i].handle->Complete(Status::Ok(), outs[i], i == 0 ? splits : at::Tensor(), done,
                                made_on);
  }
  return Status::Ok();
}

Status NcclBackend::ReduceInPlace(Device& d, at::Tensor buf, const Response& r) {
  at::Tensor work = Reducible(buf);
  FoldedOp op(r, buf.scalar_type(), d.comm, size_);
  HVD_RETURN_IF_ERROR(op.status());
  Scale(work, op.pre());
  HVD_NCCL(ncclAllReduce(work.data_ptr(), work.data_ptr(), work.numel(),
                         NcclType(work.scalar_type()), op.op(), d.comm, *d.stream),
           d.comm);
  Scale(work, op.post());
  if (!work.is_same(buf) && work.data_ptr() != buf.data_ptr()) buf.copy_(work);
  return Status::Ok();
}

Status NcclBackend::Allreduce(Device& d, const std::vector<Response>& batch,
                              std::vector<Entry>& entries, size_t fusion_bytes) {
  const Response& r = batch[0];
  // The dtype on the wire: the tensor's own, or the one a compressor asked for.
  // It is the requests' dtype, so the same for the whole batch.
  const at::ScalarType wire = entries[0].sub.wire.value_or(entries[0].sub.input.scalar_type());
  if (entries.size() == 1) {
    Entry& e = entries[0];
    at::Tensor& out = e.sub.output;
    if (wire != e.sub.input.scalar_type()) {
      at::Tensor w = e.sub.input.to(wire);  // on our stream, freed in its order
      HVD_RETURN_IF_ERROR(ReduceInPlace(d, w.view(-1), r));
      out.copy_(w);
      return Status::Ok();
    }
    if (!out.is_same(e.sub.input)) out.copy_(e.sub.input);
    return ReduceInPlace(d, out.view(-1), r);
  }
  // Fused: one kernel packs (a cat, or a multi-tensor copy that also casts to the
  // wire dtype), one reduction, one multi-tensor copy unpacks (and casts back).
  const int64_t esize = c10::elementSize(wire);
  size_t bytes = 0;
  std::vector<at::Tensor> flat_in, flat_out;
  std::vector<int64_t> numels;
  bool cast = false;
  for (auto& e : entries) {
    cast = cast || e.sub.input.scalar_type() != wire;
    bytes += static_cast<size_t>(e.sub.input.numel() * esize);
    flat_in.push_back(e.sub.input.view(-1));
    flat_out.push_back(e.sub.output.view(-1));
    numels.push_back(e.sub.input.numel());
  }
  size_t want = std::max<size_t>(bytes, fusion_bytes);
  if (!d.fusion.defined() || d.fusion.nbytes() < bytes) {
    d.fusion =
        at::empty({static_cast<int64_t>(want)}, entries[0].sub.input.options().dtype(at::kByte));
  }
  at::Tensor buf = d.fusion.narrow(0, 0, static_cast<int64_t>(bytes)).view(wire);
  std::vector<at::Tensor> parts = buf.split_with_sizes(numels);
  if (cast) {
    at::_foreach_copy_(parts, flat_in);
  } else {
    at::cat_out(buf, flat_in, 0);
  }
  HVD_RETURN_IF_ERROR(ReduceInPlace(d, buf, r));
  at::_foreach_copy_(flat_out, parts);
  return Status::Ok();
}

Status NcclBackend::Allgather(Device& d, const Response& r, Entry& e, at::Tensor* out) {
  const at::Tensor& in = e.sub.input;
  const int64_t row = RowBytes(in);
  std::vector<int64_t> shape(in.sizes().begin(), in.sizes().end());
  shape[0] = std::accumulate(r.rank_rows.begin(), r.rank_rows.end(), int64_t{0});
  *out = at::empty(shape, in.options());
  char* dst = static_cast<char*>(out->data_ptr());
  bool even = std::all_of(r.rank_rows.begin(), r.rank_rows.end(),
                          [&](int64_t x) { return x == r.rank_rows[0]; });
  if (even) {
    HVD_NCCL(ncclAllGather(in.data_ptr(), dst, r.rank_rows[0] * row, ncclUint8, d.comm, *d.stream),
             d.comm);
    return Status::Ok();
  }
  // Uneven first dimensions: each rank broadcasts its block into place.
  HVD_NCCL(ncclGroupStart(), d.comm);
  int64_t off = 0;
  for (int p = 0; p < size_; ++p) {
    int64_t n = r.rank_rows[p] * row;
    if (n > 0) {
      ncclBroadcast(p == rank_ ? in.data_ptr() : dst + off, dst + off, n, ncclUint8, p, d.comm,
                    *d.stream);
    }
    off += n;
  }
  HVD_NCCL(ncclGroupEnd(), d.comm);
  return Status::Ok();
}

Status NcclBackend::Broadcast(Device& d, const Response& r, Entry& e, at::Tensor* out) {
  *out = e.sub.output;
  if (rank_ == r.root && !out->is_same(e.sub.input)) out->copy_(e.sub.input);
  HVD_NCCL(ncclBroadcast(out->data_ptr(), out->data_ptr(), out->nbytes(), ncclUint8, r.root, d.comm,
                         *d.stream),
           d.comm);
  return Status::Ok();
}

Status NcclBackend::Alltoall(Device& d, const Response& r, Entry& e, at::Tensor* out,
                             at::Tensor* splits) {
  const at::Tensor& in = e.sub.input;
  const int64_t row = RowBytes(in);
  *splits = at::empty({size_}, at::kInt);
  int64_t rows = 0;
  for (int p = 0; p < size_; ++p) {
    splits->data_ptr<int32_t>()[p] = static_cast<int32_t>(r.rank_rows[p * size_ + rank_]);
    rows += r.rank_rows[p * size_ + rank_];
  }
  std::vector<int64_t> shape(in.sizes().begin(), in.sizes().end());
  shape[0] = rows;
  *out = at::empty(shape, in.options());
  char* src = static_cast<char*>(in.data_ptr());
  char* dst = static_cast<char*>(out->data_ptr());
  HVD_NCCL(ncclGroupStart(), d.comm);
  int64_t soff = 0, roff = 0;
  for (int p = 0; p < size_; ++p) {
    int64_t sn = r.rank_rows[rank_ * size_ + p] * row;
    int64_t rn = r.rank_rows[p * size_ + rank_] * row;
    if (sn > 0) ncclSend(src + soff, sn, ncclUint8, p, d.comm, *d.stream);
    if (rn > 0) ncclRecv(dst + roff, rn, ncclUint8, p, d.comm, *d.stream);
    soff += sn;
    roff += rn;
  }
  HVD_NCCL(ncclGroupEnd(), d.comm);
  return Status::Ok();
}

// One reduce-scatter for the batch: the inputs' parts for each rank are packed
// together (PlanReducescatter), reduced once, and each entry's output is copied out
// of this rank's part (one multi-tensor copy). Uneven parts are padded to the largest for one
// ncclReduceScatter when that moves less data over each link of a ring than one
// ncclReduce per part ((N-1) x the largest part against the total; always on 2
// ranks); else they go as one reduce per part, rooted at the rank that keeps it.
Status NcclBackend::Reducescatter(Device& d, const std::vector<Response>& batch,
                                  std::vector<Entry>& entries, std::vector<at::Tensor>* outs) {
  const Response& r = batch[0];
  const ScatterLayout l = PlanReducescatter(batch, size_);
  const at::Tensor& in0 = entries[0].sub.input;
  const size_t most = *std::max_element(l.counts.begin(), l.counts.end());
  const bool even =
      std::all_of(l.counts.begin(), l.counts.end(), [&](size_t c) { return c == l.counts[0]; });
  const bool pad = !even && static_cast<size_t>(size_ - 1) * most <= static_cast<size_t>(l.total);
  at::Tensor fused;
  if (entries.size() == 1 && !pad) {
    fused = in0.view(-1);
  } else {
    fused = at::empty({pad ? static_cast<int64_t>(most) * size_ : l.total}, in0.options());
    std::vector<at::Tensor> all;
    for (int p = 0; p < size_; ++p) {
      std::vector<at::Tensor> pieces;
      for (size_t i = 0; i < entries.size(); ++i) {
        if (l.elems[i][p] == 0) continue;
        pieces.push_back(
            entries[i].sub.input.view(-1).narrow(0, l.src_offset[i][p], l.elems[i][p]));
      }
      if (!pad) {
        all.insert(all.end(), pieces.begin(), pieces.end());
      } else if (!pieces.empty()) {
        at::Tensor dst =
            fused.narrow(0, static_cast<int64_t>(most) * p, static_cast<int64_t>(l.counts[p]));
        at::cat_out(dst, pieces, 0);
      }
    }
    if (!all.empty()) at::cat_out(fused, all, 0);
  }
  at::Tensor work = Reducible(fused);
  FoldedOp fop(r, fused.scalar_type(), d.comm, size_);
  HVD_RETURN_IF_ERROR(fop.status());
  if (fop.pre() != 1.0) {
    if (work.data_ptr() == in0.data_ptr()) work = work.clone();
    Scale(work, fop.pre());
  }
  // One input, not padded: NCCL writes its output in place. Else the entries'
  // outputs are copied out of this rank's part, each its own tensor (a view of one
  // buffer would share its version counter and storage, and autograd refuses
  // in-place ops on views returned by hvd.reducescatter's Function).
  const bool direct = entries.size() == 1 && !pad;
  std::vector<int64_t> shape0 = batch[0].shape;
  shape0[0] = ReducescatterRows(batch[0], size_)[rank_];
  at::Tensor out_work =
      direct ? at::empty(shape0, work.options())
             : at::empty({static_cast<int64_t>(pad ? most : l.counts[rank_])}, work.options());
  const size_t esize = work.element_size();
  const ncclDataType_t dt = NcclType(work.scalar_type());
  if (l.total == 0) {
    // nothing to reduce
  } else if (even || pad) {
    HVD_NCCL(ncclReduceScatter(work.data_ptr(), out_work.data_ptr(), even ? l.counts[0] : most, dt,
                               fop.op(), d.comm, *d.stream),
             d.comm);
    if (pad) out_work = out_work.narrow(0, 0, static_cast<int64_t>(l.counts[rank_]));
  } else {
    HVD_NCCL(ncclGroupStart(), d.comm);
    size_t off = 0;
    for (int p = 0; p < size_; ++p) {
      if (l.counts[p] > 0) {
        ncclReduce(static_cast<char*>(work.data_ptr()) + off * esize, out_work.data_ptr(),
                   l.counts[p], dt, fop.op(), p, d.comm, *d.stream);
      }
      off += l.counts[p];
    }
    HVD_NCCL(ncclGroupEnd(), d.comm);
  }
  Scale(out_work, fop.post());
  at::Tensor out = out_work;
  if (out.scalar_type() != fused.scalar_type()) {
    out = fused.scalar_type() == at::kBool ? out.view(at::kBool) : out.to(fused.scalar_type());
  }
  if (direct) {
    (*outs)[0] = out;
    return Status::Ok();
  }
  std::vector<at::Tensor> dst, src;
  for (size_t i = 0; i < entries.size(); ++i) {
    std::vector<int64_t> shape = batch[i].shape;
    shape[0] = ReducescatterRows(batch[i], size_)[rank_];
    (*outs)[i] = at::empty(shape, entries[i].sub.input.options());
    if (l.elems[i][rank_] == 0) continue;
    dst.push_back((*outs)[i].view(-1));
    src.push_back(
        out.narrow(0, l.dst_offset[i][rank_] - l.dst_offset[0][rank_], l.elems[i][rank_]));
  }
  if (!dst.empty()) at::_foreach_copy_(dst, src);
  return Status::Ok();
}

}  // namespace hvd
