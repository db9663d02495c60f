// Runtime, submission: the argument checks a caller's ops get before they are queued
// (CheckLocal) and the queue the background loop takes them from (Submit).
#include "core/runtime.h"

#include <algorithm>

#include "common/check.h"
#include "common/logging.h"
#include "core/torch_types.h"

namespace hvd {

Status Runtime::CheckControl(const Submission& s) const {
  const ControlOp& c = s.request.control;
  if (c.kind == ControlKind::kNone ||
      static_cast<int>(c.kind) > static_cast<int>(ControlKind::kAddProcessSetOfMembers)) {
    return Status::InvalidArgument("internal: control kind " +
                                   std::to_string(static_cast<int>(c.kind)) + " of '" +
                                   s.request.name + "' is not a control op");
  }
  const char* op = ControlKindName(c.kind);
  if (c.kind != ControlKind::kBarrier && s.process_set_id != 0) {
    return Status::InvalidArgument(std::string(op) + " runs on the global process set only");
  }
  switch (c.kind) {
    case ControlKind::kAddProcessSet:
    case ControlKind::kAddProcessSetOfMembers:
      if (c.ranks.empty()) {
        return Status::InvalidArgument(std::string(op) + ": a process set needs at least one rank");
      }
      for (size_t i = 0; i < c.ranks.size(); ++i) {
        if (c.ranks[i] < 0 || c.ranks[i] >= world_.size ||
            (i > 0 && c.ranks[i] <= c.ranks[i - 1])) {
          return Status::InvalidArgument(std::string(op) + ": ranks must be ascending and in [0, " +
                                         std::to_string(world_.size) + "); got rank " +
                                         std::to_string(c.ranks[i]));
        }
      }
      // Only members submit it: the coordinator waits for exactly these ranks.
      if (c.kind == ControlKind::kAddProcessSetOfMembers &&
          std::find(c.ranks.begin(), c.ranks.end(), world_.rank) == c.ranks.end()) {
        return Status::InvalidArgument(std::string(op) + ": rank " + std::to_string(world_.rank) +
                                       " is not one of the set's ranks; only members submit it");
      }
      return Status::Ok();
    case ControlKind::kRemoveProcessSet:
      if (c.process_set == 0) {
        return Status::InvalidArgument("the global process set cannot be removed");
      }
      return Status::Ok();
    case ControlKind::kBarrier:
    case ControlKind::kJoin:
      return Status::Ok();
    case ControlKind::kNone:
      break;
  }
  return Status::InvalidArgument("internal: a control op of no kind ('" + s.request.name + "')");
}

Status Runtime::CheckLocal(const Submission& s, const std::vector<int>* set_ranks) const {
  const Request& r = s.request;
  if (static_cast<int>(r.type) > static_cast<int>(OpType::kControl)) {
    return Status::InvalidArgument("internal: op type " + std::to_string(static_cast<int>(r.type)) +
                                   " of '" + r.name + "' is not an op");
  }
  const char* op = OpName(r);
  if (set_ranks == nullptr) {
    return Status::InvalidArgument(std::string(op) + " of '" + r.name + "': process set " +
                                   std::to_string(s.process_set_id) +
                                   " is not registered (removed, or never added on this rank)");
  }
  if (std::find(set_ranks->begin(), set_ranks->end(), world_.rank) == set_ranks->end()) {
    return Status::InvalidArgument(std::string(op) + " of '" + r.name + "': rank " +
                                   std::to_string(world_.rank) + " is not in process set " +
                                   std::to_string(s.process_set_id) +
                                   "; only its members may call collectives on it");
  }
  const int set_size = static_cast<int>(set_ranks->size());
  if (r.type == OpType::kControl) return CheckControl(s);
  if (!r.participants.empty()) {
    // A send/recv: a broadcast between two ranks of the set, from its root.
    const auto& p = r.participants;
    const int64_t me =
        std::find(set_ranks->begin(), set_ranks->end(), world_.rank) - set_ranks->begin();
    const bool any = IsAnyRecv(r) && p[0] == me;  // a receive from any source
    if (!any &&
        (r.type != OpType::kBroadcast || p.size() != 2 || p[0] < 0 || p[0] >= p[1] ||
         p[1] >= set_size || (me != p[0] && me != p[1]) || (r.root != p[0] && r.root != p[1]))) {
      return Status::InvalidArgument(
          "internal: a point-to-point op is a broadcast between two distinct ranks of the "
          "set, this rank one of them ('" +
          r.name + "')");
    }
  }
  if (!s.input.defined()) return Status::InvalidArgument(std::string(op) + ": tensor is undefined");
  if (s.input.is_cuda() && gpu_ == nullptr) {
    return Status::InvalidArgument(std::string(op) + " of '" + r.name + "': tensor is on " +
                                   s.input.device().str() +
                                   ", but this build of horovod_torch has no NCCL support; "
                                   "move the tensor to the CPU or rebuild with CUDA and NCCL");
  }
  if (!s.input.is_cuda() && !s.input.device().is_cpu()) {
    return Status::InvalidArgument(std::string(op) + " of '" + r.name + "': tensors on " +
                                   s.input.device().str() + " are not supported");
  }
  if (s.output.defined() && s.output.device() != s.input.device()) {
    return Status::InvalidArgument(std::string(op) + " of '" + r.name +
                                   "': output and input are on different devices");
  }
  DataType dt;
  if (!ToDataType(s.input.scalar_type(), &dt)) {
    return Status::InvalidArgument(std::string(op) + " of '" + r.name + "': dtype " +
                                   std::string(c10::toString(s.input.scalar_type())) +
                                   " is not supported (use uint8, int8, int16, int32, int64, "
                                   "float16, bfloat16, float32, float64 or bool)");
  }
  if (s.wire && (r.type != OpType::kAllreduce || !s.input.is_cuda() ||
                 !at::isFloatingType(s.input.scalar_type()) || !at::isFloatingType(*s.wire))) {
    return Status::InvalidArgument(
        "internal: a wire dtype is for allreduces of CUDA "
        "floating-point tensors only ('" +
        r.name + "')");
  }
  if (!s.input.is_contiguous() || (s.output.defined() && !s.output.is_contiguous())) {
    return Status::InvalidArgument(std::string(op) + " of '" + r.name +
                                   "': in-place ops need a contiguous tensor; call "
                                   ".contiguous() first or use the out-of-place variant");
  }
  // The executors write these ops' results into `output` (which may alias the input);
  // the others allocate theirs.
  if ((r.type == OpType::kAllreduce || r.type == OpType::kBroadcast) &&
      (!s.output.defined() || s.output.scalar_type() != s.input.scalar_type() ||
       s.output.sizes() != s.input.sizes())) {
    return Status::InvalidArgument(std::string("internal: ") + op + " of '" + r.name +
                                   "' needs an output tensor of its input's dtype and shape");
  }
  bool reduces = r.type == OpType::kAllreduce || r.type == OpType::kReducescatter;
  if (reduces && static_cast<int>(r.op) >= kNumReduceOps) {
    return Status::InvalidArgument(std::string(op) + " of '" + r.name + "': op " +
                                   std::to_string(static_cast<int>(r.op)) +
                                   " is not a reduction op (Average, Sum, Min, Max, Product)");
  }
  if (reduces && r.op == ReduceOp::kAdasum) {
    return Status::InvalidArgument(std::string(op) + " of '" + r.name +
                                   "': op=Adasum is not supported by this engine yet; use Sum or "
                                   "Average");
  }
  if (dt == DataType::kBool &&
      (r.op == ReduceOp::kAverage || r.prescale != 1.0 || r.postscale != 1.0) && reduces) {
    return Status::InvalidArgument(std::string(op) + " of '" + r.name +
                                   "': bool tensors cannot be averaged or scaled; use Sum (logical "
                                   "or), Min or Max");
  }
  // An out-of-range root_rank is refused by the coordinator, on every rank: refusing
  // it here would leave the ranks that gave a valid one waiting.
  bool needs_rows = r.type == OpType::kAllgather || r.type == OpType::kAlltoall ||
                    r.type == OpType::kReducescatter;
  if (needs_rows && s.input.dim() == 0) {
    return Status::InvalidArgument(std::string(op) + " of '" + r.name +
                                   "': needs a tensor with at least one dimension");
  }
  // Alltoall's splits are the rows sent to each rank; a reduce-scatter's (optional)
  // the rows of the result each rank keeps.
  if (r.type == OpType::kAlltoall || (r.type == OpType::kReducescatter && !r.splits.empty())) {
    if (static_cast<int>(r.splits.size()) != set_size) {
      return Status::InvalidArgument(std::string(op) + " of '" + r.name + "': splits has " +
                                     std::to_string(r.splits.size()) + " entries, but there are " +
                                     std::to_string(set_size) + " ranks; give one count per rank");
    }
    int64_t sum = 0;
    for (int64_t x : r.splits) {
      if (x < 0) {
        return Status::InvalidArgument(std::string(op) + " of '" + r.name +
                                       "': splits must be >= 0");
      }
      sum += x;
    }
    if (sum != s.input.size(0)) {
      return Status::InvalidArgument(std::string(op) + " of '" + r.name + "': splits sum to " +
                                     std::to_string(sum) + " but the first dimension is " +
                                     std::to_string(s.input.size(0)));
    }
  }
  return Status::Ok();
}

Status Runtime::Submit(std::vector<Submission> subs,
                       std::vector<std::shared_ptr<HandleState>>* handles) {
  std::map<int32_t, std::vector<int>> sets;
  {
    MutexLock lock(mu_);
    for (const auto& s : subs) {
      auto it = set_ranks_.find(s.process_set_id);
      if (it != set_ranks_.end()) sets[s.process_set_id] = it->second;
    }
  }
  for (auto& s : subs) {
    Request& r = s.request;
    if (s.process_set_id != subs[0].process_set_id) {
      return Status::InvalidArgument("grouped ops must all use the same process set");
    }
    auto it = sets.find(s.process_set_id);
    // Within a process set, ranks are numbered by position in its rank list.
    const std::vector<int>* ranks = it == sets.end() ? nullptr : &it->second;
    r.rank = 0;
    if (ranks != nullptr) {
      r.rank = static_cast<int32_t>(std::find(ranks->begin(), ranks->end(), world_.rank) -
                                    ranks->begin());
    }
    if (s.input.defined()) {
      ToDataType(s.wire.value_or(s.input.scalar_type()), &r.dtype);
      r.shape.assign(s.input.sizes().begin(), s.input.sizes().end());
      r.device = s.input.is_cuda() ? s.input.device().index() : -1;
    }
    HVD_RETURN_IF_ERROR(CheckLocal(s, ranks));
    // A group is executed as one batch on one device (RuntimeError, as in Horovod).
    if (r.group_id != 0 && s.input.device() != subs[0].input.device()) {
      return Status::Mismatch(std::string(OpName(r)) + " of '" + r.name +
                              "': a group's tensors must all be on one device; '" +
                              subs[0].request.name + "' is on " + subs[0].input.device().str() +
                              " and '" + r.name + "' on " + s.input.device().str());
    }
  }
  // Ready events are recorded on the caller's stream, before the op is queued.
  std::vector<std::shared_ptr<GpuEvent>> ready(subs.size());
  for (size_t i = 0; i < subs.size(); ++i) {
    if (subs[i].input.defined() && subs[i].input.is_cuda()) {
      gpu_seen_.store(true, std::memory_order_relaxed);  // spin from now on (spin_us())
      const int device = subs[i].input.device().index();
      if (device >= 0 && device < 64) gpu_devices_.fetch_or(uint64_t{1} << device);
      ready[i] = gpu_->RecordReady(subs[i].input);
    }
  }
  MutexLock lock(mu_);
  if (!broken_.ok()) return broken_;
  if (stopped_ || shutdown_requested_) {
    return Status::Aborted("horovod_torch has been shut down; call hvd.init() again");
  }
  std::vector<std::string> names;
  for (const auto& s : subs) names.push_back(s.request.name);
  std::string taken;
  if (!names_->Reserve(names, &taken)) {
    return Status::InvalidArgument(
        "a collective named '" + taken +
        "' is already in flight (its handle has not been synchronized); wait for it "
        "(hvd.synchronize) or give each concurrent op a unique name");
  }
  handles->clear();
  for (const auto& s : subs) {
    if (s.request.control.kind == ControlKind::kJoin) {
      joined_ = true;
      join_device_ = s.join_device;
    }
    if (s.input.defined() && s.input.is_cuda()) last_gpu_device_ = s.input.device().index();
  }
  for (size_t i = 0; i < subs.size(); ++i) {
    auto h = std::make_shared<HandleState>(waiters_, names_, subs[i].request.name);
    handles->push_back(h);
    fresh_[subs[i].process_set_id].push_back(subs[i].request);
    std::string name = subs[i].request.name;
    pending_.emplace(std::move(name), Entry{std::move(subs[i]), h, std::move(ready[i])});
  }
  has_fresh_.store(true, std::memory_order_release);
  cv_.NotifyOne();
  return Status::Ok();
}

// The background loop (docs/design.md §3): sleep until work arrives or the cycle time
// passes, negotiate, execute. Any transport error ends the loop and fails every
// pending and future op; the sockets are shut so peers notice at once too.
}  // namespace hvd
