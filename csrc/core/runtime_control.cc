// Runtime, control ops: barrier and join, and the registry of process sets (added and
// removed identically by every rank, as control ops of the global set; one that only
// its members submit, too), with the controller each set negotiates with; the
// timeline's start and stop, applied between cycles; the GPU totals for the straggler
// report.
#include "core/runtime.h"

#include <limits>

#include "common/check.h"
#include "core/torch_types.h"

namespace hvd {
namespace {

StallOptions StallOptionsOf(const Config& config) {
  if (config.stall_check_disable != 0) {
    return StallOptions{std::numeric_limits<double>::infinity(), 0.0};
  }
  return StallOptions{config.stall_check_s, config.stall_shutdown_s};
}

}  // namespace

// A controller for `comm`, configured as every process set's: cache, stall
// options, steady exchange, the current tuned parameters, the coordinator's timeline.
std::unique_ptr<Controller> Runtime::NewController(Communicator* comm, const TunedParams& params) {
  auto c = std::make_unique<Controller>(
      comm, static_cast<size_t>(std::max<int64_t>(0, config_.cache_capacity)),
      StallOptionsOf(config_));
  c->SetSteadyExchange(config_.steady_exchange != 0);
  c->SetInitialParams(params);
  if (world_.rank == 0) c->SetTimeline(&timeline_);
  return c;
}

Status Runtime::ApplyControl(ProcessSetState& ps, const std::vector<Response>& batch, Entry& e) {
  const ControlOp& c = batch[0].control;
  switch (c.kind) {
    case ControlKind::kAddProcessSet:
    case ControlKind::kAddProcessSetOfMembers:
    case ControlKind::kRemoveProcessSet:
      return ChangeProcessSets(c, e);
    case ControlKind::kJoin: {
      Trace(batch, std::string(ps.comm->PathName(OpType::kControl, 0)) + "_" + OpName(batch[0]));
      {
        MutexLock lock(mu_);
        joined_ = false;
      }
      e.handle->Complete(Status::Ok(), at::full({1}, c.last_joined, at::kInt));
      return Status::Ok();
    }
    case ControlKind::kBarrier:
      Trace(batch, std::string(ps.comm->PathName(OpType::kControl, 0)) + "_" + OpName(batch[0]));
      e.handle->Complete(Status::Ok());  // negotiated means every rank is here
      return Status::Ok();
    case ControlKind::kNone:
      break;
  }
  return Status::Aborted("internal: a control op of no kind ('" + batch[0].name + "')");
}

Status Runtime::ChangeProcessSets(const ControlOp& c, Entry& e) {
  if (c.kind == ControlKind::kRemoveProcessSet) {
    const int32_t id = c.process_set;
    std::vector<Entry> orphans;
    {
      MutexLock lock(mu_);
      if (set_ranks_.erase(id) == 0) {
        e.handle->Complete(Status::InvalidArgument("remove_process_set: no process set with id " +
                                                   std::to_string(id)));
        return Status::Ok();
      }
      fresh_.erase(id);
      for (auto it = pending_.begin(); it != pending_.end();) {
        if (it->second.sub.process_set_id == id) {
          orphans.push_back(std::move(it->second));
          it = pending_.erase(it);
        } else {
          ++it;
        }
      }
    }
    sets_.erase(id);  // no-op on non-members
    for (auto& o : orphans) {
      o.handle->Complete(Status::InvalidArgument("process set " + std::to_string(id) +
                                                 " was removed while this op was pending"));
    }
    e.handle->Complete(Status::Ok(), at::full({1}, id, at::kInt));
    return Status::Ok();
  }
  std::vector<int> ranks(c.ranks.begin(), c.ranks.end());
  {
    MutexLock lock(mu_);
    for (const auto& kv : set_ranks_) {
      if (kv.second != ranks) continue;
      if (c.kind == ControlKind::kAddProcessSetOfMembers) {
        e.handle->Complete(Status::Ok(), at::full({1}, kv.first, at::kInt));  // shared
      } else {
        e.handle->Complete(Status::InvalidArgument(
            "add_process_set: process set " + std::to_string(kv.first) +
            " already has exactly these ranks; use it, or remove it first"));
      }
      return Status::Ok();
    }
  }
  const int32_t id = next_set_id_++;
  std::unique_ptr<Communicator> view;
  HVD_RETURN_IF_ERROR(comm_->Subset(ranks, &view));  // collective for MPI
  if (view) {
    auto ps = std::make_unique<ProcessSetState>();
    ps->id = id;
    ps->own_comm = std::move(view);
    ps->comm = ps->own_comm.get();
    ps->own_controller = NewController(ps->comm, controller_->params());
    ps->controller = ps->own_controller.get();
    ps->own_gpu =
        CreateGpuBackend(ps->comm, ps->comm->rank(), ps->comm->size(), config_.gpu_op_timeout_s,
                         /*time_collectives=*/false);  // the global set's only
    ps->gpu = ps->own_gpu.get();
    ps->host = NewHostExecutor(ps->comm);
    sets_[id] = std::move(ps);
  }
  {
    MutexLock lock(mu_);
    set_ranks_[id] = ranks;
  }
  e.handle->Complete(Status::Ok(), at::full({1}, id, at::kInt));
  return Status::Ok();
}

Entry Runtime::JoinedEntry(const Response& r) {
  auto options = at::TensorOptions().dtype(TorchType(r.dtype));
  if (r.on_gpu) {
    int32_t device;
    {
      MutexLock lock(mu_);
      device = join_device_ >= 0 ? join_device_ : last_gpu_device_;
    }
    if (device < 0) device = 0;  // no CUDA op from this rank yet: its first GPU
    options = options.device(at::Device(at::kCUDA, static_cast<c10::DeviceIndex>(device)));
  }
  Entry e;
  e.sub.request.name = r.name;
  e.sub.input = at::zeros(r.shape, options);
  e.sub.output = e.sub.input;
  e.handle = std::make_shared<HandleState>();  // nobody waits for it
  if (r.on_gpu) e.ready = gpu_->RecordReady(e.sub.input);
  return e;
}

std::map<int32_t, std::vector<int>> Runtime::process_sets() {
  MutexLock lock(mu_);
  return set_ranks_;
}

void Runtime::SendGpuTotals() {
  if (gpu_ == nullptr) return;
  uint64_t ops = 0, took_ns = 0;
  gpu_->CollectiveTotals(&ops, &took_ns);
  controller_->SetGpuTotals(ops, took_ns);
}

Status Runtime::StartTimeline(const std::string& path, bool mark_cycles) {
  if (path.empty()) {
    return Status::InvalidArgument("start_timeline: give the path of the JSON file to write");
  }
  return ControlTimeline(TimelineCommand{true, path, mark_cycles});
}

Status Runtime::StopTimeline() { return ControlTimeline(TimelineCommand{}); }

Status Runtime::ControlTimeline(TimelineCommand command) {
  if (world_.rank != 0) return Status::Ok();  // only the coordinator writes
  MutexLock lock(mu_);
  if (stopped_ || shutdown_requested_) {
    return Status::Aborted("horovod_torch has been shut down; call hvd.init() again");
  }
  timeline_commands_.push_back(std::move(command));
  uint64_t seq = ++timeline_requested_;
  cv_.NotifyAll();
  timeline_cv_.Wait(mu_, [&]() HVD_REQUIRES(mu_) { return timeline_applied_ >= seq || stopped_; });
  if (timeline_applied_ < seq)
    return Status::Aborted(
        "horovod_torch stopped before the timeline "
        "command ran");
  return timeline_status_;
}

void Runtime::ApplyTimelineCommands(std::vector<TimelineCommand> commands) {
  Status st;
  for (auto& c : commands) {
    if (c.start) {
      st = timeline_.Start(c.path, c.mark_cycles);
    } else {
      timeline_.Stop();
      st = Status::Ok();
    }
  }
  {
    MutexLock lock(mu_);
    timeline_status_ = st;
    timeline_applied_ += commands.size();
  }
  timeline_cv_.NotifyAll();
}

}  // namespace hvd
