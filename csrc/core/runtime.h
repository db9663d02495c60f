// The Runtime: everything one initialised horovod_torch process owns — config,
// store client, transport, controller, pending ops and the background thread
// (docs/design.md §3). The bindings hold at most one; shutdown() destroys it and a
// new init() creates a fresh one. Its parts, one file each: runtime.cc (wiring, the
// background loop), runtime_submit.cc (argument checks and the queue),
// runtime_control.cc (control ops: barrier, join, the process-set registry and each
// set's controller). Data ops go to an Executor (core/executor.h): the host executor
// (host_executor.cc) or the GPU backend.
//
// Threading: Submit() and RequestShutdown() are called from Python threads; the
// background thread runs Loop(), the only user of the transport and controller.
#pragma once

#include <ATen/ATen.h>

#include <atomic>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "common/config.h"
#include "common/thread_annotations.h"
#include "core/controller.h"
#include "core/entry.h"
#include "core/gpu_backend.h"
#include "core/handles.h"
#include "core/host_executor.h"
#include "core/timeline.h"
#include "rendezvous/store.h"
#include "transport/transport.h"

namespace hvd {

struct WorldInfo {
  int rank = 0;
  int size = 1;
  int local_rank = 0;
  int local_size = 1;
  int cross_rank = 0;
  int cross_size = 1;
  std::string store_host;  // empty: no store (a world of one)
  int store_port = 0;
  std::string secret;
  std::string prefix;    // rendezvous namespace, unique per init (e.g. "gen3")
  bool use_mpi = false;  // the caller passes Create MpiSetup's communicator
};

class Runtime {
 public:
  // `comm`: the world's communicator when the caller made it (MPI's, from
  // MpiSetup, or a test's); null: the TCP mesh, through the store `world` names.
  static Status Create(const WorldInfo& world, const Config& config,
                       std::unique_ptr<Communicator> comm, std::unique_ptr<Runtime>* out);
  // HOROVOD_SPIN_US, or when it is unset (-1), 100 once this process has submitted a
  // CUDA tensor and 0 before: spinning saves the thread wake-ups that dominate a
  // small GPU op's latency (docs/benchmarks.md), and CPU-only processes keep their
  // cores. Decided by the ops rather than by asking the CUDA driver at init: its
  // first call costs each process about 0.1 s, serialised across the host, so 128
  // local ranks waited about 15 s in hvd.init() for it.
  double spin_us() const {
    if (config_.spin_us >= 0) return config_.spin_us;
    return gpu_seen_.load(std::memory_order_relaxed) ? 100.0 : 0.0;
  }
  // A thread has waited a while for op `name` in the Python caller `site`
  // ("file:line"), until EndWait(): the coordinator's stall report says so.
  void NoteWait(const std::string& name, const std::string& site) {
    MutexLock lock(mu_);
    waits_[name] = site;
  }
  void EndWait(const std::string& name) {
    MutexLock lock(mu_);
    waits_.erase(name);
  }
  // A thread's wait for an op took a while (at least HOROVOD_STRAGGLER_MIN_LAG_MS) in the
  // Python caller `site`: the straggler report says where the ranks wait.
  void NoteLongWait(const std::string& site) {
    MutexLock lock(mu_);
    wait_site_ = site;
  }
  // The coordinator's latest straggler report, as this rank last received it
  // (samples 0: none yet).
  StragglerReport stragglers() {
    MutexLock lock(mu_);
    return stragglers_snapshot_;
  }
  ~Runtime();

  const WorldInfo& world() const { return world_; }
  const Config& config() const { return config_; }
  // The GPU data plane (null: this build has none), for communicators of a
  // torch.distributed group's own (core/gpu_backend.h's JoinComm).
  GpuBackend* gpu() const { return gpu_.get(); }

  // Validates and queues the ops (all of them or none: a group is atomic).
  Status Submit(std::vector<Submission> subs, std::vector<std::shared_ptr<HandleState>>* handles);

  // Negotiated shutdown: blocks until the background thread has stopped.
  void Shutdown();
  // True once the background loop has ended (shut down, or an error stopped it):
  // no op will run any more.
  bool stopped() {
    MutexLock lock(mu_);
    return stopped_;
  }
  // The error that stopped the engine's loop and aborted its communicators, recorded
  // before the abort (see Loop()); Ok while it runs, and after a shutdown (this rank's
  // or another's), which aborts nothing.
  Status failure() {
    MutexLock lock(mu_);
    return aborted_;
  }
  // The CUDA devices of the tensors this process submitted (bit d: cuda:d, d < 64).
  uint64_t gpu_devices() const { return gpu_devices_.load(std::memory_order_relaxed); }

  // hvd.start_timeline / stop_timeline: applied by the background thread between
  // cycles; returns once applied. Only the coordinator writes a file.
  Status StartTimeline(const std::string& path, bool mark_cycles);
  Status StopTimeline();
  // The setting in use (autotune may change it); done: the search has ended.
  TunedParams params(bool* autotune_done);
  // Registered process sets: id -> global ranks (0: every rank).
  std::map<int32_t, std::vector<int>> process_sets();
  // Responses this rank has taken, over every process set (errors included, also those
  // for other ranks' ops): served by the response cache without negotiation, and
  // negotiated in full.
  uint64_t cached_ops() const { return cached_ops_.load(std::memory_order_relaxed); }
  uint64_t negotiated_ops() const { return negotiated_ops_.load(std::memory_order_relaxed); }

 private:
  Runtime(WorldInfo world, Config config) : world_(std::move(world)), config_(std::move(config)) {}
  // One communicator the background thread negotiates and runs ops on: the
  // global set (id 0) or a process set this rank belongs to.
  struct ProcessSetState {
    int32_t id = 0;
    Communicator* comm = nullptr;            // its communicator
    std::unique_ptr<Communicator> own_comm;  // a subset of the world's (not for id 0)
    Controller* controller = nullptr;
    std::unique_ptr<Controller> own_controller;
    GpuBackend* gpu = nullptr;
    std::unique_ptr<GpuBackend> own_gpu;
    std::unique_ptr<HostExecutor> host;  // CPU ops over `comm`
  };
  void Loop();
  void HoldWhileGpuBusy() HVD_REQUIRES(mu_);
  // Hands the global set's controller this rank's GPU collectives' totals, for the
  // straggler report's GPU signal (core/straggler.h).
  void SendGpuTotals();
  Status Execute(ProcessSetState& ps, const std::vector<Response>& responses);
  // A control op (kControl): barrier and join complete here; process-set changes
  // go to ChangeProcessSets.
  Status ApplyControl(ProcessSetState& ps, const std::vector<Response>& batch, Entry& e);
  // A host executor for `comm`, sharing this runtime's fusion buffer.
  std::unique_ptr<HostExecutor> NewHostExecutor(Communicator* comm);
  // Adding or removing a process set, run identically by every rank.
  Status ChangeProcessSets(const ControlOp& c, Entry& e);
  std::unique_ptr<Controller> NewController(Communicator* comm, const TunedParams& params);
  void FailAll(const Status& status);
  Status CheckLocal(const Submission& s, const std::vector<int>* set_ranks) const;
  Status CheckControl(const Submission& s) const;
  // The stand-in a joined rank runs for a response it never submitted: zeros.
  Entry JoinedEntry(const Response& r);
  struct TimelineCommand {
    bool start = false;
    std::string path;
    bool mark_cycles = false;
  };
  Status ControlTimeline(TimelineCommand command);
  void ApplyTimelineCommands(std::vector<TimelineCommand> commands);
  // Timeline spans of one fused batch (coordinator only; no-op when inactive).
  void Trace(const std::vector<Response>& batch, const std::string& activity);
  void TraceEnd(const std::vector<Response>& batch);

  WorldInfo world_;
  Config config_;
  std::unique_ptr<StoreClient> store_;
  std::unique_ptr<Communicator> comm_;  // the TCP mesh or MPI
  std::unique_ptr<Controller> controller_;
  std::unique_ptr<GpuBackend> gpu_;  // after comm_: destroyed before it
  std::vector<char> fusion_buffer_;  // background thread only: the host executors'
  Timeline timeline_;                // background thread only (coordinator)
  // Background thread only: the global set and the process sets this rank is in,
  // by id; cycles run in id order on every rank.
  std::map<int32_t, std::unique_ptr<ProcessSetState>> sets_;
  int32_t next_set_id_ = 1;  // background thread only; same on every rank
  std::thread thread_;

  Mutex mu_;
  CondVar cv_;
  std::map<int32_t, std::vector<Request>> fresh_ HVD_GUARDED_BY(mu_);  // by process set
  std::map<int32_t, std::vector<int>> set_ranks_ HVD_GUARDED_BY(mu_);  // registered sets
  std::atomic<bool> has_fresh_{false};                                 // hint for the spinning loop
  std::atomic<bool> gpu_seen_{false};     // a CUDA tensor was submitted
  std::atomic<uint64_t> gpu_devices_{0};  // gpu_devices()
  std::atomic<uint64_t> cached_ops_{0}, negotiated_ops_{0};
  // Callers blocked waiting for their ops; shared with their handles.
  const std::shared_ptr<Waiters> waiters_ = std::make_shared<Waiters>();
  // Names of ops whose handles are held; shared with the handles, which release them.
  const std::shared_ptr<NameReservations> names_ = std::make_shared<NameReservations>();
  std::unordered_map<std::string, Entry> pending_ HVD_GUARDED_BY(mu_);
  std::map<std::string, std::string> waits_ HVD_GUARDED_BY(mu_);  // name -> caller
  std::string wait_site_ HVD_GUARDED_BY(mu_);                     // NoteLongWait()
  StragglerReport stragglers_snapshot_ HVD_GUARDED_BY(mu_);
  bool shutdown_requested_ HVD_GUARDED_BY(mu_) = false;
  bool joined_ HVD_GUARDED_BY(mu_) = false;  // hvd.join() pending; zeros stand in for ops
  // The CUDA device of those zeros: hvd.join's, else that of the last CUDA tensor this
  // rank submitted (never the background thread's current device, which is GPU 0 and
  // would give this rank a second NCCL communicator that its peers never create).
  int32_t join_device_ HVD_GUARDED_BY(mu_) = -1;
  int32_t last_gpu_device_ HVD_GUARDED_BY(mu_) = -1;
  bool stopped_ HVD_GUARDED_BY(mu_) = false;
  Status broken_ HVD_GUARDED_BY(mu_);
  Status aborted_ HVD_GUARDED_BY(mu_);  // failure()
  std::vector<TimelineCommand> timeline_commands_ HVD_GUARDED_BY(mu_);
  uint64_t timeline_requested_ HVD_GUARDED_BY(mu_) = 0;
  uint64_t timeline_applied_ HVD_GUARDED_BY(mu_) = 0;
  Status timeline_status_ HVD_GUARDED_BY(mu_);
  CondVar timeline_cv_;
  TunedParams params_snapshot_ HVD_GUARDED_BY(mu_);
  bool autotune_done_ HVD_GUARDED_BY(mu_) = true;
};

}  // namespace hvd
