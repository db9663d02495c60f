// The torch.distributed backend "hvd" (docs/torch_distributed.md). Every call of
// torch.distributed becomes one op, or one atomic group of ops, of the runtime that
// hvd.init() (or horovod_torch/integrations/torch_distributed.py) created: the same negotiation,
// fusion, transports, NCCL, timeline and stall report as hvd.* calls, with which it
// may be mixed.
//
// Naming and submission: c10d_calls.h; completion: c10d_work.h; dist.monitored_barrier:
// c10d_monitored.h.
//
// Groups: the default group runs on the runtime's global process set; a group over a
// subset of ranks (new_group) on a process set that its members registered when torch
// created it (horovod_torch/integrations/torch_distributed.py).
//
// CUDA tensors: all-reduce, broadcast, all-gather into a tensor and reduce-scatter
// from one go to the group's own NCCL communicator (c10d_direct.h) unless
// HOROVOD_C10D_CUDA_DIRECT=0; the other calls, and tensors NCCL cannot reduce, run as
// ops of the runtime.
#include "python/c10d_backend.h"

#include <torch/csrc/distributed/c10d/Backend.hpp>

#include <algorithm>
#include <chrono>

#include "python/c10d_calls.h"
#include "python/c10d_direct.h"
#include "python/c10d_monitored.h"
#include "python/module_state.h"

namespace hvd {
namespace {

void CheckDense(const at::Tensor& t, const char* what) {
  if (!t.defined()) Fail(std::string(what) + ": a tensor is undefined");
  if (t.layout() != at::kStrided) Fail(std::string(what) + ": only dense tensors are supported");
  if (!t.is_contiguous()) Fail(std::string(what) + ": tensors must be contiguous");
}

// `t` as one row: [1, numel].
at::Tensor Row(const at::Tensor& t) { return t.reshape({1, t.numel()}); }

// Row r of an allgather of Row()s into outs[r] (none: a rank that keeps nothing).
void CopyRows(const at::Tensor& gathered, const std::vector<at::Tensor>& outs) {
  for (size_t r = 0; r < outs.size(); ++r) {
    outs[r].copy_(gathered[static_cast<int64_t>(r)].view(outs[r].sizes()));
  }
}

class HvdBackend : public c10d::Backend {
 public:
  HvdBackend(int rank, int size, std::chrono::milliseconds timeout, int32_t process_set_id,
             std::string group)
      : c10d::Backend(rank, size),
        process_set_id_(process_set_id),
        timeout_(timeout),
        calls_(timeout, group),
        direct_(rank, size, process_set_id, &calls_) {}
  const std::string getBackendName() const override { return "hvd"; }

  c10::intrusive_ptr<c10d::Work> broadcast(std::vector<at::Tensor>& tensors,
                                           const c10d::BroadcastOptions& opts) override {
    if (direct_.Takes(tensors, nullptr)) {
      return direct_.Run(c10d::OpType::BROADCAST, "broadcast",
                         C10dDirect::InPlace(DirectOp::Kind::kBroadcast, tensors, ReduceOp::kSum,
                                             static_cast<int>(opts.rootRank)),
                         tensors);
    }
    return Run(c10d::OpType::BROADCAST, "broadcast",
               EachTensor(OpType::kBroadcast, "broadcast", tensors, {ReduceOp::kSum},
                          static_cast<int32_t>(opts.rootRank), false),
               tensors, nullptr);
  }

  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& tensors,
                                           const c10d::AllreduceOptions& opts) override {
    return Allreduce(c10d::OpType::ALLREDUCE, "allreduce", tensors, opts.reduceOp);
  }

  c10::intrusive_ptr<c10d::Work> allreduce_coalesced(
      std::vector<at::Tensor>& tensors, const c10d::AllreduceCoalescedOptions& opts) override {
    return Allreduce(c10d::OpType::ALLREDUCE_COALESCED, "allreduce_coalesced", tensors,
                     opts.reduceOp);
  }

  c10::intrusive_ptr<c10d::Work> reduce(std::vector<at::Tensor>& tensors,
                                        const c10d::ReduceOptions& opts) override {
    // An allreduce whose result only the root keeps.
    return Run(c10d::OpType::REDUCE, "reduce",
               EachTensor(OpType::kAllreduce, "reduce", tensors, OurOp(opts.reduceOp, "reduce"), 0,
                          opts.rootRank != getRank()),
               tensors, nullptr);
  }

  c10::intrusive_ptr<c10d::Work> allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                           std::vector<at::Tensor>& inputs,
                                           const c10d::AllgatherOptions&) override {
    if (inputs.size() != 1 || outputs.size() != 1 ||
        outputs[0].size() != static_cast<size_t>(getSize())) {
      Fail("allgather takes one input and a list of one output per rank");
    }
    CheckDense(inputs[0], "allgather");
    std::vector<at::Tensor> outs = outputs[0];
    return Run(c10d::OpType::ALLGATHER, "allgather", {Sub(OpType::kAllgather, Row(inputs[0]))},
               outs, [outs](const auto& h) { CopyRows(h[0]->output(), outs); });
  }

  // all_gather_coalesced: one allgather per input, as one atomic group; outputs[r][i]
  // gets rank r's inputs[i].
  c10::intrusive_ptr<c10d::Work> allgather_coalesced(std::vector<std::vector<at::Tensor>>& outputs,
                                                     std::vector<at::Tensor>& inputs,
                                                     const c10d::AllgatherOptions&) override {
    if (outputs.size() != static_cast<size_t>(getSize())) {
      Fail("all_gather_coalesced: one output list per rank");
    }
    std::vector<Submission> subs;
    std::vector<std::vector<at::Tensor>> by_input(inputs.size());
    for (size_t i = 0; i < inputs.size(); ++i) {
      CheckDense(inputs[i], "all_gather_coalesced");
      subs.push_back(Sub(OpType::kAllgather, Row(inputs[i])));
    }
    std::vector<at::Tensor> flat_outputs;
    for (const auto& list : outputs) {
      if (list.size() != inputs.size()) {
        Fail("all_gather_coalesced: each output list needs one tensor per input");
      }
      for (size_t i = 0; i < list.size(); ++i) by_input[i].push_back(list[i]);
      flat_outputs.insert(flat_outputs.end(), list.begin(), list.end());
    }
    return Run(c10d::OpType::ALLGATHER_COALESCED, "all_gather_coalesced", std::move(subs),
               flat_outputs, [by_input](const auto& h) {
                 for (size_t i = 0; i < by_input.size(); ++i) CopyRows(h[i]->output(), by_input[i]);
               });
  }

  c10::intrusive_ptr<c10d::Work> _allgather_base(at::Tensor& output, at::Tensor& input,
                                                 const c10d::AllgatherOptions&) override {
    std::vector<at::Tensor> outs{output}, ins{input};
    return AllgatherInto(c10d::OpType::_ALLGATHER_BASE, "all_gather_into_tensor", outs, ins);
  }

  c10::intrusive_ptr<c10d::Work> allgather_into_tensor_coalesced(
      std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
      const c10d::AllgatherOptions&) override {
    return AllgatherInto(c10d::OpType::COALESCED, "allgather_into_tensor_coalesced", outputs,
                         inputs);
  }

  c10::intrusive_ptr<c10d::Work> gather(std::vector<std::vector<at::Tensor>>& outputs,
                                        std::vector<at::Tensor>& inputs,
                                        const c10d::GatherOptions& opts) override {
    const bool root = opts.rootRank == getRank();
    if (inputs.size() != 1 ||
        (root ? outputs.size() != 1 || outputs[0].size() != static_cast<size_t>(getSize())
              : !outputs.empty() && !outputs[0].empty())) {
      Fail("gather takes one input, and on the root a list of one output per rank");
    }
    CheckDense(inputs[0], "gather");
    std::vector<at::Tensor> outs = root ? outputs[0] : std::vector<at::Tensor>{};
    return Run(c10d::OpType::GATHER, "gather", {Sub(OpType::kAllgather, Row(inputs[0]))}, outs,
               [outs](const auto& h) { CopyRows(h[0]->output(), outs); });
  }

  c10::intrusive_ptr<c10d::Work> scatter(std::vector<at::Tensor>& outputs,
                                         std::vector<std::vector<at::Tensor>>& inputs,
                                         const c10d::ScatterOptions& opts) override {
    // An alltoall in which only the root sends: rank r gets the root's r-th tensor.
    const bool root = opts.rootRank == getRank();
    if (outputs.size() != 1 ||
        (root ? inputs.size() != 1 || inputs[0].size() != static_cast<size_t>(getSize())
              : !inputs.empty() && !inputs[0].empty())) {
      Fail("scatter takes one output, and on the root a list of one input per rank");
    }
    at::Tensor out = outputs[0];
    CheckDense(out, "scatter");
    std::vector<int64_t> splits(static_cast<size_t>(getSize()), 0);
    at::Tensor send;
    if (root) {
      std::vector<at::Tensor> flat;
      for (size_t r = 0; r < inputs[0].size(); ++r) {
        flat.push_back(inputs[0][r].reshape({-1}));
        splits[r] = flat.back().numel();
      }
      send = at::cat(flat);
    } else {
      send = at::empty({0}, out.options());
    }
    Submission s = Sub(OpType::kAlltoall, send);
    s.request.splits = splits;
    return Run(c10d::OpType::SCATTER, "scatter", {std::move(s)}, outputs,
               [out](const auto& h) mutable { out.view({-1}).copy_(h[0]->output()); });
  }

  c10::intrusive_ptr<c10d::Work> reduce_scatter(std::vector<at::Tensor>& outputs,
                                                std::vector<std::vector<at::Tensor>>& inputs,
                                                const c10d::ReduceScatterOptions& opts) override {
    if (outputs.size() != 1 || inputs.size() != 1 ||
        inputs[0].size() != static_cast<size_t>(getSize())) {
      Fail("reduce_scatter takes one output and a list of one input per rank");
    }
    CheckDense(outputs[0], "reduce_scatter");
    std::vector<at::Tensor> flat;
    for (auto& t : inputs[0]) {
      if (t.numel() != outputs[0].numel()) {
        Fail("reduce_scatter: every input must have as many elements as the output");
      }
      flat.push_back(t.reshape({-1}));
    }
    at::Tensor out = outputs[0];
    Submission s = Sub(OpType::kReducescatter, at::cat(flat));
    const Reduction r = OurOp(opts.reduceOp, "reduce_scatter");
    s.request.op = r.op;
    s.request.prescale = r.prescale;
    return Run(c10d::OpType::REDUCE_SCATTER, "reduce_scatter", {std::move(s)}, outputs,
               [out](const auto& h) mutable { out.view({-1}).copy_(h[0]->output().view({-1})); });
  }

  c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(
      at::Tensor& output, at::Tensor& input, const c10d::ReduceScatterOptions& opts) override {
    std::vector<at::Tensor> outs{output}, ins{input};
    return ReduceScatterInto(c10d::OpType::_REDUCE_SCATTER_BASE, "reduce_scatter_tensor", outs, ins,
                             opts);
  }

  c10::intrusive_ptr<c10d::Work> reduce_scatter_tensor_coalesced(
      std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
      const c10d::ReduceScatterOptions& opts) override {
    return ReduceScatterInto(c10d::OpType::COALESCED, "reduce_scatter_tensor_coalesced", outputs,
                             inputs, opts);
  }

  c10::intrusive_ptr<c10d::Work> alltoall_base(at::Tensor& output, at::Tensor& input,
                                               std::vector<int64_t>& output_splits,
                                               std::vector<int64_t>& input_splits,
                                               const c10d::AllToAllOptions&) override {
    CheckDense(input, "all_to_all_single");
    CheckDense(output, "all_to_all_single");
    const int64_t n = getSize();
    std::vector<int64_t> splits = input_splits;
    if (splits.empty()) {
      if (input.dim() == 0 || input.size(0) % n != 0) {
        Fail(
            "all_to_all_single: without split sizes the input's first dimension must divide "
            "by the group size");
      }
      splits.assign(static_cast<size_t>(n), input.size(0) / n);
    }
    if (static_cast<int64_t>(splits.size()) != n ||
        (!output_splits.empty() && static_cast<int64_t>(output_splits.size()) != n)) {
      Fail("all_to_all_single: split sizes need one entry per rank");
    }
    Submission s = Sub(OpType::kAlltoall, input);
    s.request.splits = splits;
    at::Tensor out = output;
    return Run(c10d::OpType::ALLTOALL_BASE, "all_to_all_single", {std::move(s)}, {output},
               [out](const auto& h) mutable {
                 const at::Tensor& got = h[0]->output();
                 if (got.numel() != out.numel()) {
                   throw std::runtime_error("received " + std::to_string(got.numel()) +
                                            " elements for an output of " +
                                            std::to_string(out.numel()));
                 }
                 out.copy_(got.view(out.sizes()));
               });
  }

  c10::intrusive_ptr<c10d::Work> alltoall(std::vector<at::Tensor>& outputs,
                                          std::vector<at::Tensor>& inputs,
                                          const c10d::AllToAllOptions&) override {
    const auto n = static_cast<size_t>(getSize());
    if (inputs.size() != n || outputs.size() != n) {
      Fail("all_to_all takes one input and one output per rank");
    }
    std::vector<at::Tensor> flat;
    std::vector<int64_t> splits;
    for (auto& t : inputs) {
      CheckDense(t, "all_to_all");
      flat.push_back(t.reshape({-1}));
      splits.push_back(t.numel());
    }
    Submission s = Sub(OpType::kAlltoall, at::cat(flat));
    s.request.splits = splits;
    std::vector<at::Tensor> outs = outputs;
    return Run(c10d::OpType::ALLTOALL, "all_to_all", {std::move(s)}, outputs,
               [outs](const auto& h) {
                 const at::Tensor& got = h[0]->output();
                 int64_t offset = 0;
                 for (auto& o : outs) {
                   if (offset + o.numel() > got.numel()) {
                     throw std::runtime_error("received fewer elements than the outputs hold");
                   }
                   o.view({-1}).copy_(got.narrow(0, offset, o.numel()));
                   offset += o.numel();
                 }
               });
  }

  c10::intrusive_ptr<c10d::Work> send(std::vector<at::Tensor>& tensors, int dst, int tag) override {
    return PointToPoint(c10d::OpType::SEND, "send", tensors, getRank(), dst, tag);
  }

  c10::intrusive_ptr<c10d::Work> recv(std::vector<at::Tensor>& tensors, int src, int tag) override {
    return PointToPoint(c10d::OpType::RECV, "recv", tensors, src, getRank(), tag);
  }

  // Paired by the coordinator with a send to this rank with `tag` (core/c10d_names.h);
  // the Work's sourceRank() says from whom.
  c10::intrusive_ptr<c10d::Work> recvAnysource(std::vector<at::Tensor>& tensors, int tag) override {
    return PointToPoint(c10d::OpType::RECVANYSOURCE, "recv", tensors, -1, getRank(), tag);
  }

  void monitoredBarrier(const c10d::BarrierOptions& opts, bool wait_all_ranks) override {
    MonitoredBarrier(*this, opts.timeout.count() >= 0 ? opts.timeout : timeout_, monitored_++,
                     wait_all_ranks);
  }

  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions&) override {
    ControlOp barrier;
    barrier.kind = ControlKind::kBarrier;
    return Run(c10d::OpType::BARRIER, "barrier", {ControlSubmission(barrier, "", process_set_id_)},
               {}, nullptr);
  }

 private:
  Submission Sub(OpType type, at::Tensor input) const {
    Submission s;
    s.process_set_id = process_set_id_;
    s.request.type = type;
    s.input = std::move(input);
    return s;
  }

  c10::intrusive_ptr<c10d::Work> Allreduce(c10d::OpType type, const char* what,
                                           std::vector<at::Tensor>& tensors,
                                           const c10d::ReduceOp& op) {
    const Reduction ours = OurOp(op, what);
    if (ours.prescale == 1.0 && direct_.Takes(tensors, &ours.op)) {
      return direct_.Run(type, what,
                         C10dDirect::InPlace(DirectOp::Kind::kAllreduce, tensors, ours.op, 0),
                         tensors);
    }
    return Run(type, what, EachTensor(OpType::kAllreduce, what, tensors, ours, 0, false), tensors,
               nullptr);
  }

  // One op per tensor, its result written back into the tensor (discard_result: into a
  // scratch tensor, the tensor left as it was).
  std::vector<Submission> EachTensor(OpType type, const char* what,
                                     const std::vector<at::Tensor>& tensors, Reduction op,
                                     int32_t root, bool discard_result) const {
    std::vector<Submission> subs;
    for (const auto& t : tensors) {
      CheckDense(t, what);
      Submission s = Sub(type, t);
      s.request.op = op.op;
      s.request.prescale = op.prescale;
      s.request.root = root;
      s.output = discard_result ? at::empty_like(t) : t;
      subs.push_back(std::move(s));
    }
    return subs;
  }

  c10::intrusive_ptr<c10d::Work> AllgatherInto(c10d::OpType type, const char* what,
                                               std::vector<at::Tensor>& outputs,
                                               std::vector<at::Tensor>& inputs) {
    if (outputs.size() != inputs.size()) Fail(std::string(what) + ": one output per input");
    std::vector<Submission> subs;
    for (size_t i = 0; i < inputs.size(); ++i) {
      CheckDense(inputs[i], what);
      CheckDense(outputs[i], what);
      if (outputs[i].numel() != inputs[i].numel() * getSize()) {
        Fail(std::string(what) + ": the output must hold the group size times the input");
      }
      subs.push_back(Sub(OpType::kAllgather, Row(inputs[i])));
    }
    std::vector<DirectOp> ops;
    if (direct_.Pairs(DirectOp::Kind::kAllgather, inputs, outputs, nullptr, &ops)) {
      return direct_.Run(type, what, std::move(ops), outputs);
    }
    std::vector<at::Tensor> outs = outputs;
    return Run(type, what, std::move(subs), outputs, [outs](const auto& h) {
      for (size_t i = 0; i < outs.size(); ++i) {
        outs[i].view({-1}).copy_(h[i]->output().view({-1}));
      }
    });
  }

  c10::intrusive_ptr<c10d::Work> ReduceScatterInto(c10d::OpType type, const char* what,
                                                   std::vector<at::Tensor>& outputs,
                                                   std::vector<at::Tensor>& inputs,
                                                   const c10d::ReduceScatterOptions& opts) {
    if (outputs.size() != inputs.size()) Fail(std::string(what) + ": one output per input");
    const Reduction op = OurOp(opts.reduceOp, what);
    std::vector<Submission> subs;
    for (size_t i = 0; i < inputs.size(); ++i) {
      CheckDense(inputs[i], what);
      CheckDense(outputs[i], what);
      if (inputs[i].numel() != outputs[i].numel() * getSize()) {
        Fail(std::string(what) + ": the input must hold the group size times the output");
      }
      Submission s = Sub(OpType::kReducescatter, inputs[i].view({-1}));
      s.request.op = op.op;
      s.request.prescale = op.prescale;
      subs.push_back(std::move(s));
    }
    std::vector<DirectOp> ops;
    if (op.prescale == 1.0 &&
        direct_.Pairs(DirectOp::Kind::kReducescatter, inputs, outputs, &op.op, &ops)) {
      return direct_.Run(type, what, std::move(ops), outputs);
    }
    std::vector<at::Tensor> outs = outputs;
    return Run(type, what, std::move(subs), outputs, [outs](const auto& h) {
      for (size_t i = 0; i < outs.size(); ++i) {
        outs[i].view({-1}).copy_(h[i]->output().view({-1}));
      }
    });
  }

  // A send from group rank `from` to `to`: a broadcast in which only these two take
  // part. The k-th send from `from` to `to` with `tag` meets the k-th such recv, as in
  // MPI; the engine runs both at the same point of its op order on the two ranks.
  // RECVANYSOURCE (`from` -1): a receive from any source, whose only participant is `to`
  // (IsAnyRecv).
  c10::intrusive_ptr<c10d::Work> PointToPoint(c10d::OpType type, const char* what,
                                              std::vector<at::Tensor>& tensors, int from, int to,
                                              int tag) {
    if (tensors.size() != 1) Fail(std::string(what) + " takes one tensor");
    CheckDense(tensors[0], what);
    const bool any = type == c10d::OpType::RECVANYSOURCE;
    if (!any && (from == to || from < 0 || to < 0 || from >= getSize() || to >= getSize())) {
      Fail(std::string(what) + ": the peer must be another rank of the group (got " +
           std::to_string(getRank() == from ? to : from) + ")");
    }
    Submission s = Sub(OpType::kBroadcast, tensors[0].view({-1}));
    s.output = s.input;
    s.request.root = from;
    s.request.participants = any ? std::vector<int64_t>{to}
                                 : std::vector<int64_t>{std::min(from, to), std::max(from, to)};
    P2pName p2p;
    p2p.from = from;
    p2p.to = to;
    p2p.tag = tag;
    return Run(type, what, {std::move(s)}, tensors, nullptr, &p2p);
  }

  c10::intrusive_ptr<c10d::Work> Run(c10d::OpType type, const char* what,
                                     std::vector<Submission> subs, std::vector<at::Tensor> outputs,
                                     Finish finish, const P2pName* p2p = nullptr) {
    return calls_.Run(type, what, std::move(subs), std::move(outputs), std::move(finish), p2p);
  }

  const int32_t process_set_id_;             // 0: the global set
  const std::chrono::milliseconds timeout_;  // the group's
  uint64_t monitored_ = 0;                   // monitored barriers called so far
  C10dCalls calls_;
  C10dDirect direct_;  // CUDA calls enqueued by the caller
};

}  // namespace

void BindC10dBackend(pybind11::module_& m) {
  m.def(
      "c10d_backend",
      [](int rank, int size, double timeout_s, int process_set_id,
         const std::string& group) -> c10::intrusive_ptr<c10d::Backend> {
        return c10::make_intrusive<HvdBackend>(
            rank, size, std::chrono::milliseconds(static_cast<int64_t>(timeout_s * 1000)),
            process_set_id, group);
      },
      pybind11::arg("rank"), pybind11::arg("size"), pybind11::arg("timeout_s"),
      pybind11::arg("process_set_id"), pybind11::arg("group"));
}

}  // namespace hvd
