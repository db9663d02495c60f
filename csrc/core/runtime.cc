#include "core/runtime.h"

#include <pthread.h>
#include <sched.h>

#include <chrono>
#include <cstring>
#include <limits>
#include <numeric>

#include <c10/core/InferenceMode.h>

#include "common/check.h"
#include "common/logging.h"
#include "core/fusion.h"

namespace hvd {
namespace {

bool ToDataType(at::ScalarType t, DataType* out) {
  switch (t) {
    case at::kByte: *out = DataType::kUInt8; return true;
    case at::kChar: *out = DataType::kInt8; return true;
    case at::kShort: *out = DataType::kInt16; return true;
    case at::kInt: *out = DataType::kInt32; return true;
    case at::kLong: *out = DataType::kInt64; return true;
    case at::kHalf: *out = DataType::kFloat16; return true;
    case at::kBFloat16: *out = DataType::kBFloat16; return true;
    case at::kFloat: *out = DataType::kFloat32; return true;
    case at::kDouble: *out = DataType::kFloat64; return true;
    case at::kBool: *out = DataType::kBool; return true;
    default: return false;
  }
}

size_t Bytes(const at::Tensor& t) { return static_cast<size_t>(t.numel()) * t.element_size(); }

int64_t RowElems(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (size_t i = 1; i < shape.size(); ++i) n *= shape[i];
  return n;
}

}  // namespace

namespace {

StallOptions StallOptionsOf(const Config& config) {
  if (config.stall_check_disable != 0) {
    return StallOptions{std::numeric_limits<double>::infinity(), 0.0};
  }
  return StallOptions{config.stall_check_s, config.stall_shutdown_s};
}

// HOROVOD_THREAD_AFFINITY: the core of this rank's background thread, or -1.
int AffinityCore(const std::string& spec, int local_rank) {
  std::vector<int> cores;
  for (size_t start = 0; start < spec.size();) {  // comma-separated, no iostreams
    size_t end = spec.find(',', start);
    if (end == std::string::npos) end = spec.size();
    const std::string item = spec.substr(start, end - start);
    start = end + 1;
    try {
      cores.push_back(std::stoi(item));
    } catch (const std::exception&) {
      HVD_LOG(kWarning) << "HOROVOD_THREAD_AFFINITY='" << spec << "' is not a list of cores";
      return -1;
    }
  }
  if (cores.empty()) return -1;
  if (cores.size() == 1) return cores[0];
  if (local_rank >= static_cast<int>(cores.size())) {
    HVD_LOG(kWarning) << "HOROVOD_THREAD_AFFINITY lists " << cores.size()
                      << " cores, none for local rank " << local_rank;
    return -1;
  }
  return cores[local_rank];
}

}  // namespace

Status Runtime::Create(const WorldInfo& world, const Config& config,
                       std::unique_ptr<Runtime>* out) {
  std::unique_ptr<Runtime> rt(new Runtime(world, config));
  // The coordinator's timeline file is opened first: a bad path fails init() on
  // rank 0 before any peer waits for it.
  if (world.rank == 0 && !config.timeline.empty() && config.timeline != "DYNAMIC") {
    HVD_RETURN_IF_ERROR(rt->timeline_.Start(config.timeline, config.timeline_mark_cycles != 0));
  }
  TcpOptions opt;
  opt.connect_timeout_s = config.start_timeout_s;
  opt.io_timeout_s = config.tcp_timeout_s;
  opt.small_allreduce_bytes = static_cast<size_t>(config.small_allreduce_bytes);
  opt.ring_chunk_bytes = static_cast<size_t>(std::max<int64_t>(4096, config.ring_chunk_bytes));
  opt.hierarchical_allreduce = static_cast<int>(config.hierarchical_allreduce);
  opt.hierarchical_allgather = static_cast<int>(config.hierarchical_allgather);
  opt.shm_control = static_cast<int>(config.shm_control);
  opt.shm_threads = static_cast<int>(config.shm_threads);
  opt.settings = config.ProtocolSettings();
  if (world.size > 1 && !world.use_mpi) {
    if (world.store_host.empty()) {
      return Status::InvalidArgument(
          "size > 1 but no rendezvous store address: start the job with horovodrun");
    }
    HVD_RETURN_IF_ERROR(StoreClient::Connect(world.store_host, world.store_port, world.secret,
                                             config.start_timeout_s, &rt->store_));
  }
  if (world.use_mpi) {
    HVD_RETURN_IF_ERROR(CreateMpiCommunicator(&rt->transport_));
  } else {
    std::unique_ptr<TcpTransport> tcp;
    HVD_RETURN_IF_ERROR(TcpTransport::Create(rt->store_.get(), world.prefix, world.rank,
                                             world.size, world.secret, opt, &tcp));
    rt->transport_ = std::move(tcp);
  }
  rt->gpu_ = CreateGpuBackend(rt->transport_.get(), world.rank, world.size, config);
  rt->controller_ = std::make_unique<Controller>(
      rt->transport_.get(), static_cast<size_t>(std::max<int64_t>(0, config.cache_capacity)),
      StallOptionsOf(config));
  rt->controller_->SetSteadyExchange(config.steady_exchange != 0);
  TunedParams initial{config.fusion_threshold_bytes, config.wake_delay_us,
                      config.cache_capacity > 0};
  rt->controller_->SetInitialParams(initial);
  auto global = std::make_unique<ProcessSetState>();
  global->transport = rt->transport_.get();
  global->controller = rt->controller_.get();
  global->gpu = rt->gpu_.get();
  rt->sets_[0] = std::move(global);
  std::vector<int> everyone(world.size);
  std::iota(everyone.begin(), everyone.end(), 0);
  rt->set_ranks_[0] = everyone;
  rt->params_snapshot_ = initial;
  if (world.rank == 0) {
    rt->controller_->SetTimeline(&rt->timeline_);
    if (config.autotune != 0) {
      AutotuneOptions o;
      o.warmup_samples = static_cast<int>(config.autotune_warmup_samples);
      o.steps_per_sample = static_cast<int>(config.autotune_steps_per_sample);
      o.max_samples = static_cast<int>(config.autotune_bayes_opt_max_samples);
      o.noise = config.autotune_gaussian_process_noise;
      o.log_path = config.autotune_log;
      rt->controller_->EnableAutotune(std::make_unique<Autotuner>(o, initial));
      rt->autotune_done_ = false;
    }
  }
  HVD_LOG(kInfo) << "rank " << world.rank << " of " << world.size << " ready: "
                 << (world.use_mpi ? "MPI" : "TCP mesh")
                 << (rt->gpu_ ? " and NCCL" : "") << ", fusion threshold "
                 << config.fusion_threshold_bytes << " bytes, response cache "
                 << config.cache_capacity << " entries"
                 << (config.autotune != 0 && world.rank == 0 ? ", autotune on" : "")
                 << (rt->timeline_.active() ? ", timeline " + config.timeline : std::string());
  rt->thread_ = std::thread([r = rt.get()] { r->Loop(); });
  // Pinned here rather than by the thread itself: pinned before init() returns.
  if (int core = AffinityCore(config.thread_affinity, world.local_rank); core >= 0) {
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(core, &set);
    if (pthread_setaffinity_np(rt->thread_.native_handle(), sizeof(set), &set) != 0) {
      HVD_LOG(kWarning) << "could not pin the background thread to core " << core;
    }
  }
  *out = std::move(rt);
  return Status::Ok();
}

Runtime::~Runtime() { Shutdown(); }

Status Runtime::StartTimeline(const std::string& path, bool mark_cycles) {
  if (path.empty()) {
    return Status::InvalidArgument("start_timeline: give the path of the JSON file to write");
  }
  return ControlTimeline(TimelineCommand{true, path, mark_cycles});
}

Status Runtime::StopTimeline() { return ControlTimeline(TimelineCommand{}); }

Status Runtime::ControlTimeline(TimelineCommand command) {
  if (world_.rank != 0) return Status::Ok();  // only the coordinator writes
  std::unique_lock<std::mutex> lock(mu_);
  if (stopped_ || shutdown_requested_) {
    return Status::Aborted("horovod_torch has been shut down; call hvd.init() again");
  }
  timeline_commands_.push_back(std::move(command));
  uint64_t seq = ++timeline_requested_;
  cv_.notify_all();
  timeline_cv_.wait(lock, [&] { return timeline_applied_ >= seq || stopped_; });
  if (timeline_applied_ < seq) return Status::Aborted("horovod_torch stopped before the timeline "
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
    std::lock_guard<std::mutex> lock(mu_);
    timeline_status_ = st;
    timeline_applied_ += commands.size();
  }
  timeline_cv_.notify_all();
}

TunedParams Runtime::params(bool* autotune_done) {
  std::lock_guard<std::mutex> lock(mu_);
  if (autotune_done) *autotune_done = autotune_done_;
  return params_snapshot_;
}

void Runtime::Shutdown() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    shutdown_requested_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
}

Status Runtime::CheckLocal(const Submission& s, const std::vector<int>* set_ranks) const {
  const Request& r = s.request;
  const char* op = OpTypeName(r.type);
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
  const bool global_only = r.type == OpType::kJoin || r.type == OpType::kAddProcessSet ||
                           r.type == OpType::kRemoveProcessSet;
  if (global_only && s.process_set_id != 0) {
    return Status::InvalidArgument(std::string(op) + " runs on the global process set only");
  }
  if (r.type == OpType::kAddProcessSet) {
    if (r.splits.empty()) {
      return Status::InvalidArgument("add_process_set: a process set needs at least one rank");
    }
    for (size_t i = 0; i < r.splits.size(); ++i) {
      if (r.splits[i] < 0 || r.splits[i] >= world_.size || (i > 0 && r.splits[i] <= r.splits[i - 1])) {
        return Status::InvalidArgument(
            "add_process_set: ranks must be distinct and in [0, " + std::to_string(world_.size) +
            "); got rank " + std::to_string(r.splits[i]));
      }
    }
    return Status::Ok();
  }
  if (r.type == OpType::kRemoveProcessSet) {
    if (r.root == 0) return Status::InvalidArgument("the global process set cannot be removed");
    return Status::Ok();
  }
  if (r.type == OpType::kBarrier || r.type == OpType::kJoin) return Status::Ok();
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
    return Status::InvalidArgument("internal: a wire dtype is for allreduces of CUDA "
                                   "floating-point tensors only ('" + r.name + "')");
  }
  if (!s.input.is_contiguous() || (s.output.defined() && !s.output.is_contiguous())) {
    return Status::InvalidArgument(std::string(op) + " of '" + r.name +
                                   "': in-place ops need a contiguous tensor; call "
                                   ".contiguous() first or use the out-of-place variant");
  }
  bool reduces = r.type == OpType::kAllreduce || r.type == OpType::kReducescatter;
  if (reduces && static_cast<int>(r.op) > static_cast<int>(ReduceOp::kProduct)) {
    return Status::InvalidArgument(std::string(op) + " of '" + r.name + "': op " +
                                   std::to_string(static_cast<int>(r.op)) +
                                   " is not a reduction op (Average, Sum, Min, Max, Product)");
  }
  if (reduces && r.op == ReduceOp::kAdasum) {
    return Status::InvalidArgument(std::string(op) + " of '" + r.name +
                                   "': op=Adasum is not supported by this engine yet; use Sum or "
                                   "Average");
  }
  if (dt == DataType::kBool && (r.op == ReduceOp::kAverage || r.prescale != 1.0 ||
                                r.postscale != 1.0) && reduces) {
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
  if (r.type == OpType::kAlltoall) {
    if (static_cast<int>(r.splits.size()) != set_size) {
      return Status::InvalidArgument("alltoall of '" + r.name + "': splits has " +
                                     std::to_string(r.splits.size()) +
                                     " entries, but there are " + std::to_string(set_size) +
                                     " ranks; give one count per rank");
    }
    int64_t sum = 0;
    for (int64_t x : r.splits) {
      if (x < 0) return Status::InvalidArgument("alltoall of '" + r.name + "': splits must be >= 0");
      sum += x;
    }
    if (sum != s.input.size(0)) {
      return Status::InvalidArgument("alltoall of '" + r.name + "': splits sum to " +
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
    std::lock_guard<std::mutex> lock(mu_);
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
  }
  // Ready events are recorded on the caller's stream, before the op is queued.
  std::vector<std::shared_ptr<GpuEvent>> ready(subs.size());
  for (size_t i = 0; i < subs.size(); ++i) {
    if (subs[i].input.defined() && subs[i].input.is_cuda()) {
      gpu_seen_.store(true, std::memory_order_relaxed);  // spin from now on (spin_us())
      ready[i] = gpu_->RecordReady(subs[i].input);
    }
  }
  std::lock_guard<std::mutex> lock(mu_);
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
  for (const auto& s : subs) joined_ = joined_ || s.request.type == OpType::kJoin;
  for (size_t i = 0; i < subs.size(); ++i) {
    auto h = std::make_shared<HandleState>(waiters_, names_, subs[i].request.name);
    handles->push_back(h);
    fresh_[subs[i].process_set_id].push_back(subs[i].request);
    std::string name = subs[i].request.name;
    pending_.emplace(std::move(name), Entry{std::move(subs[i]), h, std::move(ready[i])});
  }
  has_fresh_.store(true, std::memory_order_release);
  cv_.notify_one();
  return Status::Ok();
}

// The background loop (DESIGN.md §3): sleep until work arrives or the cycle time
// passes, negotiate, execute. Any transport error ends the loop and fails every
// pending and future op; the sockets are shut so peers notice at once too.
void Runtime::Loop() {
  auto cycle = std::chrono::microseconds(static_cast<int64_t>(config_.cycle_time_ms * 1000));
  bool busy = false;  // the last cycle ran work
  TunedParams last_params = controller_->params();
  bool last_done = controller_->autotune_done();
  while (true) {
    std::map<int32_t, std::vector<Request>> fresh;
    std::vector<TimelineCommand> timeline_commands;
    std::vector<std::string> waits;
    bool want_shutdown;
    const double wake_delay_us = controller_->params().wake_delay_us;
    const auto spin = std::chrono::microseconds(static_cast<int64_t>(spin_us()));
    if (busy && spin.count() > 0) {
      auto until = std::chrono::steady_clock::now() + spin;
      while (!has_fresh_.load(std::memory_order_acquire) &&
             std::chrono::steady_clock::now() < until) {
        std::this_thread::yield();
      }
    }
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait_for(lock, cycle, [this] {
        return !fresh_.empty() || shutdown_requested_ || !timeline_commands_.empty();
      });
      if (!fresh_.empty() && wake_delay_us > 0) {
        lock.unlock();
        std::this_thread::sleep_for(
            std::chrono::microseconds(static_cast<int64_t>(wake_delay_us)));
        lock.lock();
      }
      if (config_.batch_while_busy != 0) HoldWhileGpuBusy(lock);
      fresh.swap(fresh_);
      has_fresh_.store(false, std::memory_order_release);
      want_shutdown = shutdown_requested_;
      timeline_commands.swap(timeline_commands_);
      waits.clear();
      for (const auto& kv : waits_) waits.push_back(kv.first + "\t" + kv.second);
    }
    if (!timeline_commands.empty()) ApplyTimelineCommands(std::move(timeline_commands));
    // One cycle per process set this rank is in, in id order (the same order on
    // every rank, so members of a set meet in its cycle). Shutdown is negotiated
    // on the global set only; sets added by this cycle's ops run in it already.
    bool shutdown = false;
    Status st;
    busy = false;
    for (int32_t id = 0; st.ok() && !shutdown;) {
      auto it = sets_.lower_bound(id);
      if (it == sets_.end()) break;
      id = it->first + 1;
      ProcessSetState& ps = *it->second;
      std::vector<Response> responses;
      ps.controller->SetWaits(waits);
      st = ps.controller->Cycle(std::move(fresh[ps.id]), want_shutdown && ps.id == 0,
                                &responses, &shutdown);
      if (!responses.empty() && ps.id == 0) timeline_.MarkCycle();
      if (st.ok()) st = Execute(ps, responses);
      busy = busy || !responses.empty();
    }
    timeline_.Flush();
    if (!(controller_->params() == last_params) || controller_->autotune_done() != last_done) {
      last_params = controller_->params();
      last_done = controller_->autotune_done();
      std::lock_guard<std::mutex> lock(mu_);
      params_snapshot_ = last_params;
      autotune_done_ = last_done;
    }
    if (!st.ok()) {
      HVD_LOG(kError) << "background loop stopped: " << st.message();
      transport_->Abort();  // the whole mesh, which process sets share
      for (auto& kv : sets_) {
        if (kv.second->gpu) kv.second->gpu->Abort();
      }
      FailAll(Status::Aborted(st.message()));
      timeline_.Stop();
      return;
    }
    if (shutdown) {
      FailAll(Status::Aborted("horovod_torch was shut down by rank " +
                              std::to_string(controller_->shutdown_rank()) +
                              " (it called hvd.shutdown(), or its process is exiting) "
                              "before this op completed"));
      timeline_.Stop();
      return;
    }
  }
}

// While this rank's NCCL stream moves data, new GPU allreduces would only queue
// behind it: let them wait (looking again every few tens of microseconds) so
// that those arriving meanwhile join them. Where the link is slow this turns a
// stream of small collectives into a few large ones; where it is fast the stream
// is idle, or waiting for the backward pass, when the next gradient arrives and
// nothing waits. No hold while a caller waits for an op: it sends nothing more
// meanwhile (docs/design.md §8). Called and returns with mu_ held.
void Runtime::HoldWhileGpuBusy(std::unique_lock<std::mutex>& lock) {
  constexpr auto kMaxHold = std::chrono::milliseconds(10);
  const auto start = std::chrono::steady_clock::now();
  const int64_t threshold = controller_->params().fusion_threshold_bytes;
  while (!fresh_.empty() && !shutdown_requested_ && !waiters_->Any() &&
         std::chrono::steady_clock::now() - start < kMaxHold) {
    std::vector<GpuBackend*> gpus;
    for (const auto& kv : fresh_) {
      auto it = sets_.find(kv.first);
      if (it == sets_.end() || it->second->gpu == nullptr ||
          !WorthHolding(kv.second, threshold)) {
        return;
      }
      gpus.push_back(it->second->gpu);
    }
    lock.unlock();
    bool busy = true;
    for (GpuBackend* g : gpus) busy = busy && g->Busy();
    // Nap rather than spin: each look at the GPU takes the driver's lock, which
    // the thread launching the backward pass's kernels needs. A caller that
    // starts waiting for its op ends the nap and the hold.
    if (busy) waiters_->Nap(std::chrono::microseconds(20));
    lock.lock();
    if (!busy) return;
  }
}

void Runtime::Trace(const std::vector<Response>& batch, const std::string& activity) {
  if (!timeline_.active()) return;
  for (const auto& r : batch) timeline_.Activity(r.name, activity);
}

void Runtime::TraceEnd(const std::vector<Response>& batch) {
  if (!timeline_.active()) return;
  for (const auto& r : batch) timeline_.OpEnd(r.name);
}

void Runtime::FailAll(const Status& status) {
  std::unordered_map<std::string, Entry> pending;
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopped_ = true;
    if (!shutdown_requested_) broken_ = status;
    pending.swap(pending_);
    fresh_.clear();
  }
  timeline_cv_.notify_all();
  for (auto& kv : pending) kv.second.handle->Complete(status);
}

Status Runtime::Execute(ProcessSetState& ps, const std::vector<Response>& responses) {
  if (timeline_.active()) {
    for (const auto& r : responses) {
      if (!r.error.empty()) continue;
      timeline_.OpStart(r.name, OpTypeName(r.type));
      timeline_.Activity(r.name, "QUEUE");
    }
  }
  for (const auto& batch :
       PlanFusion(responses, controller_->params().fusion_threshold_bytes,
                  config_.disable_group_fusion != 0)) {
    std::vector<Entry> entries;
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (size_t i : batch) {
        const Response& resp = responses[i];
        auto it = pending_.find(resp.name);
        const bool not_ours =  // a failed group's member this rank did not submit
            !resp.error.empty() && !resp.rank_rows.empty() &&
            std::find(resp.rank_rows.begin(), resp.rank_rows.end(), ps.transport->rank()) ==
                resp.rank_rows.end();
        if (not_ours || (it == pending_.end() && !resp.error.empty())) {
          entries.push_back(Entry{});
          continue;
        }
        if (it == pending_.end()) {
          // Only a rank that joined runs ops it did not submit: with zeros.
          HVD_CHECK(joined_);
          entries.push_back(Entry{});
          continue;
        }
        entries.push_back(std::move(it->second));
        pending_.erase(it);
      }
    }
    const Response& first = responses[batch[0]];
    if (!first.error.empty()) {  // errors are batches of one
      if (entries[0].handle) entries[0].handle->Complete(Status::Mismatch(first.error));
      continue;
    }
    for (size_t k = 0; k < batch.size(); ++k) {
      if (!entries[k].handle) entries[k] = JoinedEntry(responses[batch[k]]);
    }
    Status st;
    std::vector<Response> rs;
    for (size_t i : batch) rs.push_back(responses[i]);
    // A tensor made under torch.inference_mode() may only be written in place under
    // it: the batch runs in inference mode when one of its tensors is such a tensor
    // (what it allocates is then an inference tensor too, as the caller's own ops
    // would make it).
    auto inference = [](const at::Tensor& t) { return t.defined() && t.is_inference(); };
    bool any_inference = false;
    for (const auto& e : entries) {
      any_inference = any_inference || inference(e.sub.input) || inference(e.sub.output);
    }
    try {
      c10::InferenceMode inference_guard(any_inference);
      if (first.on_gpu) {
        Trace(rs, std::string("NCCL_") + OpTypeName(first.type));
        st = ps.gpu->Execute(rs, entries);
      } else if (first.type == OpType::kAllreduce) {
        st = RunAllreduce(ps, rs, entries);
      } else if (first.type == OpType::kAddProcessSet ||
                 first.type == OpType::kRemoveProcessSet) {
        st = ChangeProcessSets(first, entries[0]);
      } else {
        Trace(rs, std::string(ps.transport->name()) + "_" + OpTypeName(first.type));
        st = RunOne(ps, first, entries[0]);
      }
    } catch (const std::exception& e) {
      // A torch error on this thread: fail the ops (and the engine, as for any
      // error here) with its message; never std::terminate the user's process.
      st = Status::Aborted(std::string("'") + first.name + "' failed in the background "
                           "thread: " + e.what());
    }
    TraceEnd(rs);
    if (!st.ok()) {
      for (auto& e : entries) e.handle->Complete(Status::Aborted(st.message()));
      return st;
    }
  }
  return Status::Ok();
}

Status Runtime::ChangeProcessSets(const Response& r, Entry& e) {
  if (r.type == OpType::kRemoveProcessSet) {
    const int32_t id = r.root;
    std::vector<Entry> orphans;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (set_ranks_.erase(id) == 0) {
        e.handle->Complete(Status::InvalidArgument(
            "remove_process_set: no process set with id " + std::to_string(id)));
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
  std::vector<int> ranks(r.rank_rows.begin(), r.rank_rows.end());
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (const auto& kv : set_ranks_) {
      if (kv.second == ranks) {
        e.handle->Complete(Status::InvalidArgument(
            "add_process_set: process set " + std::to_string(kv.first) +
            " already has exactly these ranks; use it, or remove it first"));
        return Status::Ok();
      }
    }
  }
  const int32_t id = next_set_id_++;
  std::unique_ptr<Communicator> view;
  HVD_RETURN_IF_ERROR(transport_->Subset(ranks, &view));  // collective for MPI
  if (view) {
    auto ps = std::make_unique<ProcessSetState>();
    ps->id = id;
    ps->own_transport = std::move(view);
    ps->transport = ps->own_transport.get();
    ps->own_controller = std::make_unique<Controller>(
        ps->transport, static_cast<size_t>(std::max<int64_t>(0, config_.cache_capacity)),
        StallOptionsOf(config_));
    ps->controller = ps->own_controller.get();
    ps->controller->SetSteadyExchange(config_.steady_exchange != 0);
    ps->controller->SetInitialParams(controller_->params());
    if (world_.rank == 0) ps->controller->SetTimeline(&timeline_);
    ps->own_gpu = CreateGpuBackend(ps->transport, ps->transport->rank(), ps->transport->size(),
                                   config_);
    ps->gpu = ps->own_gpu.get();
    sets_[id] = std::move(ps);
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    set_ranks_[id] = ranks;
  }
  e.handle->Complete(Status::Ok(), at::full({1}, id, at::kInt));
  return Status::Ok();
}

std::map<int32_t, std::vector<int>> Runtime::process_sets() {
  std::lock_guard<std::mutex> lock(mu_);
  return set_ranks_;
}

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
