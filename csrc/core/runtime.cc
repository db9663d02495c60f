// Runtime: the wiring of the engine's parts and the background loop. Create() builds
// the transport, the executors and the controllers; Loop() negotiates each cycle and
// hands the fused batches to Execute(), which sends each to its process set's
// executor (the GPU backend, or the host executor of host_executor.cc) or, for a
// control op, to ApplyControl (runtime_control.cc). Submission (argument checks, the
// queue) is runtime_submit.cc.
#include "core/runtime.h"

#include <pthread.h>
#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <numeric>

#include <c10/core/InferenceMode.h>

#include "common/check.h"
#include "common/logging.h"
#include "core/fusion.h"
#include "transport/tcp_transport.h"

namespace hvd {
namespace {

// The TCP mesh's options from the engine's knobs (common/config.h).
TcpOptions TcpOptionsOf(const Config& config) {
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
  return opt;
}

// This rank's host for the straggler report: the launcher's name for it
// (HOROVOD_HOSTNAME, as in -H), else the host name.
std::string HostName() {
  if (const char* h = std::getenv("HOROVOD_HOSTNAME"); h != nullptr && *h != '\0') return h;
  char buf[256] = {0};
  if (gethostname(buf, sizeof(buf) - 1) != 0) return "";
  return buf;
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
                       std::unique_ptr<Communicator> comm, std::unique_ptr<Runtime>* out) {
  std::unique_ptr<Runtime> rt(new Runtime(world, config));
  // The coordinator's timeline file is opened first: a bad path fails init() on
  // rank 0 before any peer waits for it.
  if (world.rank == 0 && !config.timeline.empty() && config.timeline != "DYNAMIC") {
    HVD_RETURN_IF_ERROR(rt->timeline_.Start(config.timeline, config.timeline_mark_cycles != 0));
  }
  if (comm) {
    rt->comm_ = std::move(comm);
  } else {
    if (world.size > 1) {
      if (world.store_host.empty()) {
        return Status::InvalidArgument(
            "size > 1 but no rendezvous store address: start the job with horovodrun");
      }
      HVD_RETURN_IF_ERROR(StoreClient::Connect(world.store_host, world.store_port, world.secret,
                                               config.start_timeout_s, &rt->store_));
    }
    std::unique_ptr<TcpTransport> tcp;
    HVD_RETURN_IF_ERROR(TcpTransport::Create(rt->store_.get(), world.prefix, world.rank, world.size,
                                             world.secret, TcpOptionsOf(config), &tcp));
    rt->comm_ = std::move(tcp);
  }
  rt->gpu_ = CreateGpuBackend(
      rt->comm_.get(), world.rank, world.size, config.gpu_op_timeout_s,
      /*time_collectives=*/config.straggler_check != 0 && config.straggler_gpu_timing != 0);
  TunedParams initial{config.fusion_threshold_bytes, config.wake_delay_us,
                      config.cache_capacity > 0};
  rt->controller_ = rt->NewController(rt->comm_.get(), initial);
  rt->controller_->SetHost(HostName());
  if (config.straggler_check != 0) {
    StragglerOptions so;
    so.window = static_cast<int>(config.straggler_window);
    so.lag_fraction = config.straggler_lag;
    so.min_lag_s = config.straggler_min_lag_ms * 1e-3;
    so.share = config.straggler_share;
    rt->controller_->EnableStragglerMonitor(so);
  }
  auto global = std::make_unique<ProcessSetState>();
  global->comm = rt->comm_.get();
  global->controller = rt->controller_.get();
  global->gpu = rt->gpu_.get();
  global->host = rt->NewHostExecutor(rt->comm_.get());
  rt->sets_[0] = std::move(global);
  std::vector<int> everyone(world.size);
  std::iota(everyone.begin(), everyone.end(), 0);
  const bool autotune = world.rank == 0 && config.autotune != 0;
  if (autotune) {
    AutotuneOptions o;
    o.warmup_samples = static_cast<int>(config.autotune_warmup_samples);
    o.steps_per_sample = static_cast<int>(config.autotune_steps_per_sample);
    o.max_samples = static_cast<int>(config.autotune_bayes_opt_max_samples);
    o.noise = config.autotune_gaussian_process_noise;
    o.log_path = config.autotune_log;
    rt->controller_->EnableAutotune(std::make_unique<Autotuner>(o, initial));
  }
  {
    MutexLock lock(rt->mu_);  // no other thread yet; the lock keeps the rule simple
    rt->set_ranks_[0] = everyone;
    rt->params_snapshot_ = initial;
    if (autotune) rt->autotune_done_ = false;
  }
  HVD_LOG(kInfo) << "rank " << world.rank << " of " << world.size
                 << " ready: " << (rt->world_.use_mpi ? "MPI" : "TCP mesh")
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

TunedParams Runtime::params(bool* autotune_done) {
  MutexLock lock(mu_);
  if (autotune_done) *autotune_done = autotune_done_;
  return params_snapshot_;
}

void Runtime::Shutdown() {
  {
    MutexLock lock(mu_);
    shutdown_requested_ = true;
  }
  cv_.NotifyAll();
  if (thread_.joinable()) thread_.join();
}

void Runtime::Loop() {
  auto cycle = std::chrono::microseconds(static_cast<int64_t>(config_.cycle_time_ms * 1000));
  bool busy = false;  // the last cycle ran work
  TunedParams last_params = controller_->params();
  bool last_done = controller_->autotune_done();
  uint64_t stragglers_version = 0;
  auto next_gpu_check = std::chrono::steady_clock::now();
  while (true) {
    std::map<int32_t, std::vector<Request>> fresh;
    std::vector<TimelineCommand> timeline_commands;
    std::vector<std::string> waits;
    std::string wait_site;
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
      MutexLock lock(mu_);
      cv_.WaitFor(mu_, cycle, [this]() HVD_REQUIRES(mu_) {
        return !fresh_.empty() || shutdown_requested_ || !timeline_commands_.empty();
      });
      if (!fresh_.empty() && wake_delay_us > 0) {
        lock.Unlock();
        std::this_thread::sleep_for(std::chrono::microseconds(static_cast<int64_t>(wake_delay_us)));
        lock.Lock();
      }
      if (config_.batch_while_busy != 0) HoldWhileGpuBusy();
      fresh.swap(fresh_);
      has_fresh_.store(false, std::memory_order_release);
      want_shutdown = shutdown_requested_;
      timeline_commands.swap(timeline_commands_);
      waits.clear();
      for (const auto& kv : waits_) waits.push_back(kv.first + "\t" + kv.second);
      wait_site = wait_site_;
    }
    controller_->SetWaitSite(wait_site);
    SendGpuTotals();
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
      st = ps.controller->Cycle(std::move(fresh[ps.id]), want_shutdown && ps.id == 0, &responses,
                                &shutdown);
      if (!responses.empty() && ps.id == 0) timeline_.MarkCycle();
      if (!responses.empty()) {
        uint64_t cached = 0, negotiated = 0;
        ps.controller->DrainCounts(&cached, &negotiated);
        cached_ops_.fetch_add(cached, std::memory_order_relaxed);
        negotiated_ops_.fetch_add(negotiated, std::memory_order_relaxed);
      }
      if (ps.id == 0 && gpu_ != nullptr) gpu_->CompareTimes(!ps.controller->ranks_joined());
      if (st.ok()) st = Execute(ps, responses);
      busy = busy || !responses.empty();
    }
    if (st.ok() && std::chrono::steady_clock::now() >= next_gpu_check) {
      next_gpu_check = std::chrono::steady_clock::now() + std::chrono::milliseconds(100);
      for (auto& kv : sets_) {
        if (st.ok() && kv.second->gpu) st = kv.second->gpu->Check();
      }
    }
    timeline_.Flush();
    if (controller_->stragglers_version() != stragglers_version) {
      stragglers_version = controller_->stragglers_version();
      MutexLock lock(mu_);
      stragglers_snapshot_ = controller_->stragglers();
    }
    if (!(controller_->params() == last_params) || controller_->autotune_done() != last_done) {
      last_params = controller_->params();
      last_done = controller_->autotune_done();
      MutexLock lock(mu_);
      params_snapshot_ = last_params;
      autotune_done_ = last_done;
    }
    if (!st.ok()) {
      HVD_LOG(kError) << "background loop stopped: " << st.message();
      // The engine is marked failed before the aborts: a GPU kernel that the abort
      // ends has produced no valid result, and a caller whose wait for the GPU
      // returns then finds the failure already recorded (hvd.elastic's commit fence).
      {
        MutexLock lock(mu_);
        aborted_ = Status::Aborted(st.message());
      }
      FailAll(Status::Aborted(st.message()));
      comm_->Abort();  // the whole mesh, which process sets share
      for (auto& kv : sets_) {
        if (kv.second->gpu) kv.second->gpu->Abort();
      }
      timeline_.Stop();
      return;
    }
    if (shutdown) {
      const std::string why = "horovod_torch was shut down by rank " +
                              std::to_string(controller_->shutdown_rank()) +
                              " (it called hvd.shutdown(), or its process is exiting)";
      FailAll(Status::Aborted(why + " before this op completed"));
      // Nothing watches the torch.distributed groups' own communicators from here on,
      // and a peer that shut down will not join their pending calls.
      if (gpu_ != nullptr) gpu_->EndDirect(why);
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
// meanwhile (docs/design.md §8). Called and returns with mu_ held (it lets go of
// it while it naps).
void Runtime::HoldWhileGpuBusy() {
  constexpr auto kMaxHold = std::chrono::milliseconds(10);
  const auto start = std::chrono::steady_clock::now();
  const int64_t threshold = controller_->params().fusion_threshold_bytes;
  while (!fresh_.empty() && !shutdown_requested_ && !waiters_->Any() &&
         std::chrono::steady_clock::now() - start < kMaxHold) {
    std::vector<GpuBackend*> gpus;
    for (const auto& kv : fresh_) {
      auto it = sets_.find(kv.first);
      if (it == sets_.end() || it->second->gpu == nullptr || !WorthHolding(kv.second, threshold)) {
        return;
      }
      gpus.push_back(it->second->gpu);
    }
    mu_.unlock();
    bool busy = true;
    for (GpuBackend* g : gpus) busy = busy && g->Busy();
    // Nap rather than spin: each look at the GPU takes the driver's lock, which
    // the thread launching the backward pass's kernels needs. A caller that
    // starts waiting for its op ends the nap and the hold.
    if (busy) waiters_->Nap(std::chrono::microseconds(20));
    mu_.lock();
    if (!busy) return;
  }
}

void Runtime::Trace(const std::vector<Response>& batch, const std::string& activity) {
  TraceBatch(&timeline_, batch, activity);
}

std::unique_ptr<HostExecutor> Runtime::NewHostExecutor(Communicator* comm) {
  return std::make_unique<HostExecutor>(comm, &fusion_buffer_,
                                        world_.rank == 0 ? &timeline_ : nullptr);
}

void Runtime::TraceEnd(const std::vector<Response>& batch) {
  if (!timeline_.active()) return;
  for (const auto& r : batch) timeline_.OpEnd(r.name);
}

void Runtime::FailAll(const Status& status) {
  std::unordered_map<std::string, Entry> pending;
  {
    MutexLock lock(mu_);
    stopped_ = true;
    if (!shutdown_requested_) broken_ = status;
    pending.swap(pending_);
    fresh_.clear();
  }
  timeline_cv_.NotifyAll();
  for (auto& kv : pending) kv.second.handle->Complete(status);
}

Status Runtime::Execute(ProcessSetState& ps, const std::vector<Response>& responses) {
  // A point-to-point op runs on its two ranks; the others skip it. Its batch is one op,
  // and the fusion plan is made of the whole list, the same on every rank.
  auto elsewhere = [me = static_cast<int64_t>(ps.comm->rank())](const Response& r) {
    const auto& p = r.participants;
    return !p.empty() && std::find(p.begin(), p.end(), me) == p.end();
  };
  if (timeline_.active()) {
    for (const auto& r : responses) {
      if (!r.error.empty() || elsewhere(r)) continue;
      timeline_.OpStart(r.name, OpName(r));
      timeline_.Activity(r.name, "QUEUE");
    }
  }
  const int64_t threshold = controller_->params().fusion_threshold_bytes;
  for (const auto& batch : PlanFusion(responses, threshold, config_.disable_group_fusion != 0)) {
    if (elsewhere(responses[batch[0]])) continue;
    std::vector<Entry> entries;
    {
      MutexLock lock(mu_);
      for (size_t i : batch) {
        const Response& resp = responses[i];
        auto it = pending_.find(resp.name);
        if (it == pending_.end() && !resp.alias.empty()) {  // this rank received from any source
          it = pending_.find(resp.alias);
          if (it != pending_.end()) it->second.handle->SetSource(resp.root);
        }
        const bool not_ours =  // an error for other ranks' op (a failed group's member,
                               // an op beside a join) that this rank did not submit
            !resp.error.empty() && !resp.rank_rows.empty() &&
            std::find(resp.rank_rows.begin(), resp.rank_rows.end(), ps.comm->rank()) ==
                resp.rank_rows.end();
        if (not_ours || (it == pending_.end() && !resp.error.empty())) {
          entries.push_back(Entry{});
          continue;
        }
        if (it == pending_.end() && resp.control.kind == ControlKind::kAddProcessSetOfMembers) {
          // A non-member applies it too (every rank keeps the same registry), for nobody.
          Entry e;
          e.handle = std::make_shared<HandleState>();
          entries.push_back(std::move(e));
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
      if (first.type == OpType::kControl) {
        st = ApplyControl(ps, rs, entries[0]);
      } else if (first.on_gpu) {
        Trace(rs, std::string("NCCL_") + OpTypeName(first.type));
        st = ps.gpu->Execute(rs, entries, static_cast<size_t>(threshold));
      } else {
        st = ps.host->Execute(rs, entries, static_cast<size_t>(threshold));
      }
    } catch (const std::exception& e) {
      // A torch error on this thread: fail the ops (and the engine, as for any
      // error here) with its message; never std::terminate the user's process.
      st = Status::Aborted(std::string("'") + first.name +
                           "' failed in the background "
                           "thread: " +
                           e.what());
    }
    TraceEnd(rs);
    if (!st.ok()) {
      for (auto& e : entries) e.handle->Complete(Status::Aborted(st.message()));
      return st;
    }
  }
  return Status::Ok();
}

}  // namespace hvd
