// The host executor (host_executor.h): CPU ops of one fused batch over the
// transport. Allreduce and reduce-scatter go through the fusion buffer; the other
// collectives run one at a time.
#include "core/host_executor.h"

#include <cstring>

#include "common/check.h"
#include "core/fusion.h"

namespace hvd {
namespace {

int64_t RowElems(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (size_t i = 1; i < shape.size(); ++i) n *= shape[i];
  return n;
}

}  // namespace

// The host buffer grows to the largest batch seen, not to the fusion threshold:
// with many ranks per host, a threshold-sized buffer each would add up.
char* HostExecutor::Buffer(size_t bytes) {
  if (fusion_buffer_->size() < bytes) fusion_buffer_->resize(bytes);
  return fusion_buffer_->data();
}

Status HostExecutor::Execute(const std::vector<Response>& batch, std::vector<Entry>& entries,
                             size_t /*fusion_bytes*/) {
  const Response& r = batch[0];
  if (r.type == OpType::kAllreduce) return Allreduce(batch, entries);
  if (r.type == OpType::kReducescatter) return Reducescatter(batch, entries);
  return RunOne(batch, entries[0]);
}

// The collective's span, named by the path the communicator takes for `bytes`
// (Communicator::PathName): e.g. SHM_ALLREDUCE, TCP_ALLGATHER, MPI_BROADCAST.
void HostExecutor::TraceCollective(const std::vector<Response>& batch, size_t bytes) {
  if (timeline_ == nullptr || !timeline_->active()) return;
  const OpType op = batch[0].type;
  TraceBatch(timeline_, batch, std::string(comm_->PathName(op, bytes)) + "_" + OpTypeName(op));
}

Status HostExecutor::Allreduce(const std::vector<Response>& batch, std::vector<Entry>& entries) {
  const Response& r = batch[0];
  const FoldedReduction f = FoldAverage(r.op, r.prescale, r.postscale, comm_->size());
  if (entries.size() == 1) {
    Entry& e = entries[0];
    at::Tensor& out = e.sub.output;
    if (!out.is_same(e.sub.input)) out.copy_(e.sub.input);
    size_t count = static_cast<size_t>(out.numel());
    ScaleBuffer(out.data_ptr(), count, r.dtype, f.pre);
    TraceCollective(batch, out.nbytes());
    HVD_RETURN_IF_ERROR(comm_->Allreduce(out.data_ptr(), count, r.dtype, f.op));
    ScaleBuffer(out.data_ptr(), count, r.dtype, f.post);
    e.handle->Complete(Status::Ok(), out);
    return Status::Ok();
  }
  // Fused: pack every input into one buffer, reduce once, unpack.
  size_t total = 0;
  for (auto& e : entries) total += e.sub.input.nbytes();
  char* buf = Buffer(total);
  size_t off = 0;
  TraceBatch(timeline_, batch, "MEMCPY_IN_FUSION_BUFFER");
  for (auto& e : entries) {
    std::memcpy(buf + off, e.sub.input.data_ptr(), e.sub.input.nbytes());
    off += e.sub.input.nbytes();
  }
  size_t count = total / DataTypeSize(r.dtype);
  ScaleBuffer(buf, count, r.dtype, f.pre);
  TraceCollective(batch, total);
  HVD_RETURN_IF_ERROR(comm_->Allreduce(buf, count, r.dtype, f.op));
  ScaleBuffer(buf, count, r.dtype, f.post);
  TraceBatch(timeline_, batch, "MEMCPY_OUT_FUSION_BUFFER");
  off = 0;
  for (auto& e : entries) {
    std::memcpy(e.sub.output.data_ptr(), buf + off, e.sub.input.nbytes());
    off += e.sub.input.nbytes();
    e.handle->Complete(Status::Ok(), e.sub.output);
  }
  return Status::Ok();
}

// One reduce-scatter for the batch: each input's part for rank p is packed next to
// the other inputs' parts for p (PlanReducescatter), so one collective gives this
// rank its part of every input, which is then cut into the entries' outputs.
Status HostExecutor::Reducescatter(const std::vector<Response>& batch,
                                   std::vector<Entry>& entries) {
  const Response& r = batch[0];
  const int size = comm_->size(), me = comm_->rank();
  const size_t esize = DataTypeSize(r.dtype);
  const ScatterLayout l = PlanReducescatter(batch, size);
  const size_t in_bytes = static_cast<size_t>(l.total) * esize;
  char* buf = Buffer(in_bytes + l.counts[me] * esize);
  char* out = buf + in_bytes;
  if (entries.size() > 1) TraceBatch(timeline_, batch, "MEMCPY_IN_FUSION_BUFFER");
  for (size_t i = 0; i < entries.size(); ++i) {
    const char* in = static_cast<const char*>(entries[i].sub.input.data_ptr());
    for (int p = 0; p < size; ++p) {
      if (l.elems[i][p] == 0) continue;  // (an empty tensor's data may be null)
      std::memcpy(buf + l.dst_offset[i][p] * esize, in + l.src_offset[i][p] * esize,
                  static_cast<size_t>(l.elems[i][p]) * esize);
    }
  }
  const FoldedReduction f = FoldAverage(r.op, r.prescale, r.postscale, size);
  ScaleBuffer(buf, static_cast<size_t>(l.total), r.dtype, f.pre);
  TraceCollective(batch, in_bytes);
  HVD_RETURN_IF_ERROR(comm_->Reducescatter(buf, l.counts, r.dtype, f.op, out));
  ScaleBuffer(out, l.counts[me], r.dtype, f.post);
  for (size_t i = 0; i < entries.size(); ++i) {
    Entry& e = entries[i];
    std::vector<int64_t> shape = batch[i].shape;
    shape[0] = ReducescatterRows(batch[i], size)[me];
    at::Tensor o = at::empty(shape, e.sub.input.options());
    if (l.elems[i][me] > 0) {
      std::memcpy(o.data_ptr(), out + (l.dst_offset[i][me] - l.dst_offset[0][me]) * esize,
                  static_cast<size_t>(l.elems[i][me]) * esize);
    }
    e.handle->Complete(Status::Ok(), o);
  }
  return Status::Ok();
}

Status HostExecutor::RunOne(const std::vector<Response>& batch, Entry& e) {
  const Response& r = batch[0];
  Communicator* comm = comm_;
  const int size = comm->size(), me = comm->rank();
  const at::Tensor& in = e.sub.input;
  const size_t esize = DataTypeSize(r.dtype);
  switch (r.type) {
    case OpType::kAllreduce:
    case OpType::kReducescatter:
    case OpType::kControl:
      return Status::Aborted(std::string("internal: ") + OpTypeName(r.type) +
                             " sent to the host executor's RunOne");
    case OpType::kBroadcast: {
      at::Tensor& out = e.sub.output;
      TraceCollective(batch, out.nbytes());
      if (me == r.root && !out.is_same(in)) out.copy_(in);
      if (r.participants.empty()) {
        HVD_RETURN_IF_ERROR(comm->Broadcast(out.data_ptr(), out.nbytes(), r.root));
      } else {  // a send from the root to the other participant
        const int to =
            static_cast<int>(r.participants[0] == r.root ? r.participants[1] : r.participants[0]);
        HVD_RETURN_IF_ERROR(comm->Transfer(out.data_ptr(), out.nbytes(), r.root, to));
      }
      e.handle->Complete(Status::Ok(), out);
      return Status::Ok();
    }
    case OpType::kAllgather: {
      const int64_t row = RowElems(e.sub.request.shape);
      std::vector<size_t> bytes(size);
      int64_t rows = 0;
      for (int p = 0; p < size; ++p) {
        bytes[p] = static_cast<size_t>(r.rank_rows[p] * row) * esize;
        rows += r.rank_rows[p];
      }
      std::vector<int64_t> shape = e.sub.request.shape;
      shape[0] = rows;
      at::Tensor out = at::empty(shape, in.options());
      TraceCollective(batch, out.nbytes());
      HVD_RETURN_IF_ERROR(comm->Allgatherv(in.data_ptr(), out.data_ptr(), bytes));
      e.handle->Complete(Status::Ok(), out);
      return Status::Ok();
    }
    case OpType::kAlltoall: {
      const size_t row_bytes = static_cast<size_t>(RowElems(e.sub.request.shape)) * esize;
      std::vector<size_t> send(size), recv(size);
      at::Tensor splits = at::empty({size}, at::kInt);
      int64_t rows = 0;
      for (int p = 0; p < size; ++p) {
        send[p] = static_cast<size_t>(r.rank_rows[me * size + p]) * row_bytes;
        int64_t from_p = r.rank_rows[p * size + me];
        recv[p] = static_cast<size_t>(from_p) * row_bytes;
        splits.data_ptr<int32_t>()[p] = static_cast<int32_t>(from_p);
        rows += from_p;
      }
      std::vector<int64_t> shape = e.sub.request.shape;
      shape[0] = rows;
      at::Tensor out = at::empty(shape, in.options());
      TraceCollective(batch, out.nbytes());
      HVD_RETURN_IF_ERROR(comm->Alltoallv(in.data_ptr(), send, out.data_ptr(), recv));
      e.handle->Complete(Status::Ok(), out, splits);
      return Status::Ok();
    }
  }
  return Status::Ok();
}

}  // namespace hvd
