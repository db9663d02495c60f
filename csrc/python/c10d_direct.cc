#include "python/c10d_direct.h"

#include <ATen/core/ivalue.h>

#include <algorithm>

namespace hvd {
namespace {

constexpr size_t kIdBytes = 128;  // NCCL_UNIQUE_ID_BYTES

class DirectWork : public c10d::Work {
 public:
  DirectWork(c10d::OpType type, std::string what, std::shared_ptr<GpuEvent> done,
             std::shared_ptr<DirectComm> comm, std::vector<at::Tensor> outputs,
             c10::intrusive_ptr<c10::ivalue::Future> future)
      : c10d::Work(-1, type),
        what_(std::move(what)),
        done_(std::move(done)),
        comm_(std::move(comm)),
        outputs_(std::move(outputs)),
        future_(std::move(future)) {}
  bool isCompleted() override { return !comm_->Broken().empty() || done_->Ready(); }
  bool isSuccess() const override { return comm_->Broken().empty() && done_->Ready(); }
  std::exception_ptr exception() const override {
    const std::string broken = comm_->Broken();
    if (broken.empty()) return nullptr;
    try {
      Fail(what_ + " failed: " + broken);
    } catch (...) {
      return std::current_exception();
    }
  }
  std::vector<at::Tensor> result() override { return outputs_; }
  // The caller's current stream waits for the call on the GPU; the host does not.
  bool wait(std::chrono::milliseconds) override {
    if (auto e = exception()) std::rethrow_exception(e);
    bool first = true;
    for (const auto& t : outputs_) {
      done_->BlockCurrentStream(t, first);
      first = false;
    }
    if (first) done_->BlockCurrentStream(at::Tensor(), true);
    return true;
  }
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override { return future_; }

 private:
  const std::string what_;
  const std::shared_ptr<GpuEvent> done_;
  const std::shared_ptr<DirectComm> comm_;
  const std::vector<at::Tensor> outputs_;
  const c10::intrusive_ptr<c10::ivalue::Future> future_;
};

}  // namespace

bool C10dDirect::Takes(const std::vector<at::Tensor>& tensors, const ReduceOp* op) {
  if (!enabled_ || tensors.empty()) return false;
  for (const auto& t : tensors) {
    if (!t.defined() || !t.is_cuda() || t.layout() != at::kStrided || !t.is_contiguous() ||
        t.device() != tensors[0].device()) {
      return false;
    }
    if (op != nullptr && !DirectReducible(t.scalar_type(), *op)) return false;
  }
  return true;
}

std::vector<DirectOp> C10dDirect::InPlace(DirectOp::Kind kind,
                                          const std::vector<at::Tensor>& tensors, ReduceOp op,
                                          int root) {
  std::vector<DirectOp> ops;
  for (const auto& t : tensors) {
    DirectOp o;
    o.kind = kind;
    o.input = t;
    o.output = t;
    o.op = op;
    o.root = root;
    ops.push_back(std::move(o));
  }
  return ops;
}

bool C10dDirect::Pairs(DirectOp::Kind kind, const std::vector<at::Tensor>& inputs,
                       const std::vector<at::Tensor>& outputs, const ReduceOp* op,
                       std::vector<DirectOp>* ops) {
  std::vector<at::Tensor> all = inputs;
  all.insert(all.end(), outputs.begin(), outputs.end());
  if (inputs.size() != outputs.size() || !Takes(all, op)) return false;
  for (size_t i = 0; i < inputs.size(); ++i) {
    if (inputs[i].scalar_type() != outputs[i].scalar_type()) return false;
  }
  for (size_t i = 0; i < inputs.size(); ++i) {
    DirectOp o;
    o.kind = kind;
    o.input = inputs[i];
    o.output = outputs[i];
    if (op != nullptr) o.op = *op;
    ops->push_back(std::move(o));
  }
  return true;
}

std::shared_ptr<DirectComm> C10dDirect::Comm(int device, const char* what) {
  auto it = comms_.find(device);
  if (it != comms_.end()) return it->second;
  // Rank 0's id, broadcast as the group's next engine call (a CPU tensor): a byte that
  // says whether rank 0 made one, then the id. A rank 0 that could not make it still
  // takes part, so that every rank fails at once instead of waiting for it.
  std::string id, why;
  if (rank_ == 0) {
    Status st = NewDirectCommId(&id);
    if (!st.ok()) why = st.message();
    if (st.ok() && id.size() != kIdBytes) why = "NCCL's unique id is not 128 bytes";
  }
  at::Tensor bytes = at::zeros({static_cast<int64_t>(1 + kIdBytes)}, at::kByte);
  char* data = static_cast<char*>(bytes.data_ptr());
  if (rank_ == 0 && why.empty()) {
    data[0] = 1;
    std::copy(id.begin(), id.end(), data + 1);
  }
  Submission s;
  s.process_set_id = process_set_id_;
  s.request.type = OpType::kBroadcast;
  s.request.root = 0;
  s.input = bytes;
  s.output = bytes;
  auto work = calls_->Run(c10d::OpType::BROADCAST, "nccl_id", {std::move(s)}, {bytes}, nullptr);
  work->wait();
  if (data[0] != 1) {
    Fail(std::string(what) + ": rank 0 of the group could not make its NCCL communicator's id" +
         (why.empty() ? " (rank 0's error says why)" : ": " + why));
  }
  std::shared_ptr<DirectComm> comm;
  Status st = JoinDirectComm(std::string(data + 1, kIdBytes), rank_, size_, device, &comm);
  if (!st.ok())
    Fail(std::string(what) + ": joining the group's NCCL communicator: " + st.message());
  comms_[device] = comm;
  return comm;
}

c10::intrusive_ptr<c10d::Work> C10dDirect::Run(c10d::OpType type, const char* what,
                                               std::vector<DirectOp> ops,
                                               std::vector<at::Tensor> outputs) {
  const c10::Device device = ops[0].input.device();
  auto future = c10::make_intrusive<c10::ivalue::Future>(
      c10::ListType::create(c10::TensorType::get()), std::vector<c10::Device>{device});
  std::shared_ptr<DirectComm> comm;
  std::shared_ptr<GpuEvent> done;
  {
    MutexLock lock(mu_);
    comm = Comm(device.index(), what);
    try {
      done = comm->Enqueue(ops, what);
    } catch (const std::exception& e) {
      Fail(std::string(what) + " failed: " + e.what());
    }
  }
  // Complete for the GPU: consumers' streams wait for the call, the host does not.
  done->RunAfter([&] { future->markCompleted(c10::IValue(outputs)); });
  return c10::make_intrusive<DirectWork>(type, what, std::move(done), std::move(comm),
                                         std::move(outputs), std::move(future));
}

}  // namespace hvd
