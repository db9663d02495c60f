// Runtime, host executor: a fused batch of CPU ops run over the transport (TCP mesh,
// shared memory or MPI): allreduce through the fusion buffer, the other collectives
// one at a time, and the zeros a joined rank runs for ops it never submitted.
#include "core/runtime.h"

#include <cstring>

#include "common/check.h"
#include "common/logging.h"

namespace hvd {
namespace {

size_t Bytes(const at::Tensor& t) { return static_cast<size_t>(t.numel()) * t.element_size(); }

int64_t RowElems(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (size_t i = 1; i < shape.size(); ++i) n *= shape[i];
  return n;
}

}  // namespace

Entry Runtime::JoinedEntry(const Response& r) {
  static const at::ScalarType kTypes[] = {at::kByte,     at::kChar,  at::kShort,
                                          at::kInt,      at::kLong,  at::kHalf,
                                          at::kBFloat16, at::kFloat, at::kDouble,
                                          at::kBool};
  auto options = at::TensorOptions().dtype(kTypes[static_cast<int>(r.dtype)]);
  if (r.on_gpu) options = options.device(at::kCUDA);  // the current CUDA device
  Entry e;
  e.sub.request.name = r.name;
  e.sub.input = at::zeros(r.shape, options);
  e.sub.output = e.sub.input;
  e.handle = std::make_shared<HandleState>();  // nobody waits for it
  if (r.on_gpu) e.ready = gpu_->RecordReady(e.sub.input);
  return e;
}

Status Runtime::RunAllreduce(ProcessSetState& ps, const std::vector<Response>& batch,
                             std::vector<Entry>& entries) {
  const Response& r = batch[0];
  Communicator* transport = ps.transport;
  const std::string coll = std::string(transport->name()) + "_ALLREDUCE";
  ReduceOp op = r.op == ReduceOp::kAverage ? ReduceOp::kSum : r.op;
  double post = r.postscale * (r.op == ReduceOp::kAverage ? 1.0 / transport->size() : 1.0);
  if (entries.size() == 1) {
    Entry& e = entries[0];
    at::Tensor& out = e.sub.output;
    if (!out.is_same(e.sub.input)) out.copy_(e.sub.input);
    size_t count = static_cast<size_t>(out.numel());
    ScaleBuffer(out.data_ptr(), count, r.dtype, r.prescale);
    Trace(batch, coll);
    HVD_RETURN_IF_ERROR(transport->Allreduce(out.data_ptr(), count, r.dtype, op));
    ScaleBuffer(out.data_ptr(), count, r.dtype, post);
    e.handle->Complete(Status::Ok(), out);
    return Status::Ok();
  }
  // Fused: pack every input into one buffer, reduce once, unpack.
  size_t total = 0;
  for (auto& e : entries) total += Bytes(e.sub.input);
  if (fusion_buffer_.size() < total) fusion_buffer_.resize(total);
  char* buf = fusion_buffer_.data();
  size_t off = 0;
  Trace(batch, "MEMCPY_IN_FUSION_BUFFER");
  for (auto& e : entries) {
    std::memcpy(buf + off, e.sub.input.data_ptr(), Bytes(e.sub.input));
    off += Bytes(e.sub.input);
  }
  size_t count = total / DataTypeSize(r.dtype);
  ScaleBuffer(buf, count, r.dtype, r.prescale);
  Trace(batch, coll);
  HVD_RETURN_IF_ERROR(transport->Allreduce(buf, count, r.dtype, op));
  ScaleBuffer(buf, count, r.dtype, post);
  Trace(batch, "MEMCPY_OUT_FUSION_BUFFER");
  off = 0;
  for (auto& e : entries) {
    std::memcpy(e.sub.output.data_ptr(), buf + off, Bytes(e.sub.input));
    off += Bytes(e.sub.input);
    e.handle->Complete(Status::Ok(), e.sub.output);
  }
  return Status::Ok();
}

Status Runtime::RunOne(ProcessSetState& ps, const Response& r, Entry& e) {
  Communicator* transport = ps.transport;
  const int size = transport->size(), me = transport->rank();
  const at::Tensor& in = e.sub.input;
  const size_t esize = DataTypeSize(r.dtype);
  switch (r.type) {
    case OpType::kAllreduce:
      HVD_CHECK(false && "allreduce goes through RunAllreduce");
      break;
    case OpType::kBarrier:
      e.handle->Complete(Status::Ok());
      return Status::Ok();
    case OpType::kAddProcessSet:
    case OpType::kRemoveProcessSet:
      HVD_CHECK(false && "process set changes go through ChangeProcessSets");
      break;
    case OpType::kJoin: {
      {
        std::lock_guard<std::mutex> lock(mu_);
        joined_ = false;
      }
      at::Tensor last = at::full({1}, r.root, at::kInt);
      e.handle->Complete(Status::Ok(), last);
      return Status::Ok();
    }
    case OpType::kBroadcast: {
      at::Tensor& out = e.sub.output;
      if (me == r.root && !out.is_same(in)) out.copy_(in);
      HVD_RETURN_IF_ERROR(transport->Broadcast(out.data_ptr(), Bytes(out), r.root));
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
      HVD_RETURN_IF_ERROR(transport->Allgatherv(in.data_ptr(), out.data_ptr(), bytes));
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
      HVD_RETURN_IF_ERROR(transport->Alltoallv(in.data_ptr(), send, out.data_ptr(), recv));
      e.handle->Complete(Status::Ok(), out, splits);
      return Status::Ok();
    }
    case OpType::kReducescatter: {
      const int64_t dim0 = r.shape[0], row = RowElems(r.shape);
      std::vector<size_t> counts(size);
      for (int p = 0; p < size; ++p) {
        counts[p] = static_cast<size_t>((dim0 / size + (p < dim0 % size ? 1 : 0)) * row);
      }
      std::vector<int64_t> shape = r.shape;
      shape[0] = dim0 / size + (me < dim0 % size ? 1 : 0);
      at::Tensor out = at::empty(shape, in.options());
      if (fusion_buffer_.size() < Bytes(in)) fusion_buffer_.resize(Bytes(in));
      char* buf = fusion_buffer_.data();
      std::memcpy(buf, in.data_ptr(), Bytes(in));
      ReduceOp op = r.op == ReduceOp::kAverage ? ReduceOp::kSum : r.op;
      double post = r.postscale * (r.op == ReduceOp::kAverage ? 1.0 / size : 1.0);
      ScaleBuffer(buf, static_cast<size_t>(in.numel()), r.dtype, r.prescale);
      HVD_RETURN_IF_ERROR(transport->Reducescatter(buf, counts, r.dtype, op, out.data_ptr()));
      ScaleBuffer(out.data_ptr(), static_cast<size_t>(out.numel()), r.dtype, post);
      e.handle->Complete(Status::Ok(), out);
      return Status::Ok();
    }
  }
  return Status::Ok();
}

}  // namespace hvd
