// pybind11 module horovod_torch._C. Holds the process's one Runtime (created by
// init, destroyed by shutdown) and the handle table that outlives it. Errors are
// returned to Python as (code, message) so horovod_torch/engine/basics.py can raise the
// right exception type (see common/status.h). Waits are in waits.cc, the gradient
// hooks in grad_hooks.cc, the store's bindings in store_bindings.cc; module_state.h is
// what they use of this file.
#include <torch/extension.h>

#include <unistd.h>

#include <atomic>
#include <functional>
#include <limits>

#include "common/config.h"
#include "common/fnv.h"
#include "common/logging.h"
#include "common/thread_annotations.h"
#include "core/gpu_backend.h"
#include "core/runtime.h"
#include "mpi/mpi_setup.h"
#include "python/c10d_backend.h"
#include "python/module_state.h"

namespace py = pybind11;

namespace hvd {
namespace {

struct Globals {
  Mutex mu;
  std::unique_ptr<Runtime> runtime HVD_GUARDED_BY(mu);
  pid_t owner HVD_GUARDED_BY(mu) = 0;  // the process that created it
  HandleTable handles;
  bool mpi_threads HVD_GUARDED_BY(mu) = false;  // MPI_THREAD_MULTIPLE granted
  std::atomic<double> wait_spin_us{0};          // HOROVOD_SPIN_US of the last init()
  std::atomic<double> stall_warn_s{60};         // HOROVOD_STALL_CHECK_TIME_SECONDS (inf: off)
  std::atomic<double> long_wait_s{0.005};       // HOROVOD_STRAGGLER_MIN_LAG_MS (inf: off)
  std::atomic<bool> native_grad_hooks{true};    // HOROVOD_NATIVE_GRAD_HOOKS of the last init()
};

Globals& G() {
  static Globals* g = new Globals();  // never destroyed: threads may outlive module teardown
  return *g;
}

// A child forked after init() (a DataLoader worker, multiprocessing) holds a copy of
// the parent's runtime without its threads: it must neither run collectives nor
// tear down what the parent shares with it (sockets, shared memory). Called with
// G().mu held.
bool ForkedChild() HVD_REQUIRES(G().mu) { return G().runtime && G().owner != getpid(); }

Status ForkedChildError() HVD_REQUIRES(G().mu) {
  return Status::InvalidArgument(
      "horovod_torch was initialised in process " + std::to_string(G().owner) + "; this process (" +
      std::to_string(getpid()) +
      ") is a child forked from it and cannot run collectives (run them in the parent, "
      "or start the child with the 'spawn' method and call hvd.init() there as a job of "
      "its own)");
}

// init() after the engine died (an error stopped its loop) brings up a fresh one,
// so one failed step or test never poisons the rest of the process. Called with
// G().mu held.
void DropStoppedRuntime() HVD_REQUIRES(G().mu) {
  if (G().runtime && !ForkedChild() && G().runtime->stopped()) G().runtime.reset();
}

// The one wording, also basics.py's (Horovod's).
constexpr const char* kNotInitialized = "Horovod has not been initialized; use hvd.init().";

// How long a caller waits before it logs where it waits (the stall check time).
double StallWarnSeconds(const Config& config) {
  return config.stall_check_disable != 0 || config.stall_check_s <= 0
             ? std::numeric_limits<double>::infinity()
             : config.stall_check_s;
}

py::tuple Err(const Status& s) { return py::make_tuple(static_cast<int>(s.code()), s.message()); }

// The one init() path. `make_world` runs under G().mu once no runtime is running,
// and gives the world and, for MPI, its communicator (null: the TCP mesh).
using WorldMaker = std::function<Status(const Config&, WorldInfo*, std::unique_ptr<Communicator>*)>;

py::tuple InitWith(const WorldMaker& make_world) {
  std::string env_error;
  Config config = Config::FromEnv(&env_error);
  SetLogLevel(config.log_level);
  SetLogHideTime(config.log_hide_time != 0);
  if (!env_error.empty()) {
    return Err(Status::InvalidArgument("bad environment setting: " + env_error));
  }
  Status st;
  {
    py::gil_scoped_release nogil;
    MutexLock lock(G().mu);
    DropStoppedRuntime();
    if (!G().runtime) {  // else already initialised: Ok
      WorldInfo w;
      std::unique_ptr<Communicator> transport;
      st = make_world(config, &w, &transport);
      std::unique_ptr<Runtime> rt;
      if (st.ok()) {
        SetLogRank(w.rank);
        st = Runtime::Create(w, config, std::move(transport), &rt);
      }
      if (st.ok()) G().runtime = std::move(rt);
      if (G().runtime) G().wait_spin_us = G().runtime->spin_us();
      G().owner = getpid();
      G().stall_warn_s = StallWarnSeconds(config);
      G().long_wait_s = config.straggler_check != 0 ? config.straggler_min_lag_ms * 1e-3
                                                    : std::numeric_limits<double>::infinity();
      G().native_grad_hooks = config.native_grad_hooks != 0;
    }
  }
  return Err(st);
}

// init() from the launcher's environment (horovodrun, elastic, torchrun, ...): the
// TCP mesh through the rendezvous store.
py::tuple Init(int rank, int size, int local_rank, int local_size, int cross_rank, int cross_size,
               const std::string& store_host, int store_port, const std::string& secret,
               const std::string& prefix) {
  return InitWith([&](const Config&, WorldInfo* w, std::unique_ptr<Communicator>*) {
    *w = WorldInfo{rank,       size,       local_rank, local_size, cross_rank,
                   cross_size, store_host, store_port, secret,     prefix};
    return Status::Ok();
  });
}

// init() under the MPI controller: rank, size and the communicator come from MPI
// (MPI_COMM_WORLD, the ranks given, or an mpi4py communicator's Fortran handle).
py::tuple InitMpi(std::vector<int> ranks, int64_t fortran_handle) {
  return InitWith([&](const Config& config, WorldInfo* w, std::unique_ptr<Communicator>* transport)
                      HVD_REQUIRES(G().mu) {
                        MpiWorld m;
                        HVD_RETURN_IF_ERROR(MpiSetup(
                            ranks, fortran_handle, config.mpi_threads_disable != 0, &m, transport));
                        G().mpi_threads = m.threads_supported;
                        w->rank = m.rank;
                        w->size = m.size;
                        w->local_rank = m.local_rank;
                        w->local_size = m.local_size;
                        w->cross_rank = m.cross_rank;
                        w->cross_size = m.cross_size;
                        w->use_mpi = true;
                        return Status::Ok();
                      });
}

void Shutdown() {
  py::gil_scoped_release nogil;
  std::unique_ptr<Runtime> rt;
  {
    MutexLock lock(G().mu);
    if (ForkedChild()) return;  // the parent's engine: not ours to stop
    rt = std::move(G().runtime);
  }
  rt.reset();  // negotiated shutdown, joins the background thread
}

// start_timeline / stop_timeline: (code, message) like init.
py::tuple ControlTimeline(bool start, const std::string& path, bool mark_cycles) {
  Status st;
  {
    py::gil_scoped_release nogil;
    MutexLock lock(G().mu);
    if (!G().runtime) {
      st = Status::InvalidArgument(kNotInitialized);
    } else if (ForkedChild()) {
      st = ForkedChildError();
    } else if (start) {
      st = G().runtime->StartTimeline(path, mark_cycles);
    } else {
      st = G().runtime->StopTimeline();
    }
  }
  return Err(st);
}

// The engine's current (possibly autotuned) setting, or None before init.
py::object TunedParamsDict() {
  TunedParams p;
  bool done = true;
  {
    MutexLock lock(G().mu);
    if (!G().runtime) return py::none();
    p = G().runtime->params(&done);
  }
  py::dict d;
  d["fusion_threshold_bytes"] = p.fusion_threshold_bytes;
  d["wake_delay_us"] = p.wake_delay_us;
  d["cache_enabled"] = p.cache_enabled;
  d["autotune_done"] = done;
  return d;
}

py::object World() {
  MutexLock lock(G().mu);
  if (!G().runtime) return py::none();
  const WorldInfo& w = G().runtime->world();
  return py::make_tuple(w.rank, w.size, w.local_rank, w.local_size, w.cross_rank, w.cross_size);
}

// Submits one op per input; a group (grouped=true) is atomic and negotiated together.
py::tuple Submit(int type, std::vector<at::Tensor> inputs,
                 std::vector<c10::optional<at::Tensor>> outputs, std::vector<std::string> names,
                 int op, int root, double prescale, double postscale, std::vector<int64_t> splits,
                 bool grouped, int process_set_id) {
  std::vector<Submission> subs(inputs.size());
  const int64_t group = grouped ? GroupId(names) : 0;
  for (size_t i = 0; i < inputs.size(); ++i) {
    Submission& s = subs[i];
    s.request.type = static_cast<OpType>(type);
    s.request.name = names[i];
    s.request.op = static_cast<ReduceOp>(op);
    s.request.root = root;
    s.request.prescale = prescale;
    s.request.postscale = postscale;
    s.request.splits = splits;
    s.request.group_id = group;
    s.request.group_size = grouped ? static_cast<int32_t>(inputs.size()) : 0;
    s.input = inputs[i];
    if (i < outputs.size() && outputs[i].has_value()) s.output = *outputs[i];
    s.process_set_id = process_set_id;
  }
  std::vector<std::shared_ptr<HandleState>> states;
  Status st = SubmitToRuntime(std::move(subs), &states);
  py::list handles;
  for (auto& s : states) handles.append(G().handles.Add(s));
  return py::make_tuple(static_cast<int>(st.code()), st.message(), handles);
}

// Submits one control op (a ControlKind): a barrier on `process_set_id`, or on the
// global set a join (`join_device`: where this rank's zeros go while it has joined),
// adding a process set of `ranks` (every rank submits it, or only its members), or
// removing process set `remove_id`.
py::tuple SubmitControl(int kind, const std::string& name, std::vector<int64_t> ranks,
                        int remove_id, int join_device, int process_set_id) {
  ControlOp c;
  c.kind = static_cast<ControlKind>(kind);
  c.ranks = std::move(ranks);
  c.process_set = remove_id;
  std::vector<Submission> subs{ControlSubmission(std::move(c), name, process_set_id)};
  subs[0].join_device = join_device;
  std::vector<std::shared_ptr<HandleState>> states;
  Status st = SubmitToRuntime(std::move(subs), &states);
  const int handle = st.ok() ? G().handles.Add(states[0]) : -1;
  return py::make_tuple(static_cast<int>(st.code()), st.message(), handle);
}

// Fast path for one op (the optimizer's per-gradient hook): no lists.
py::tuple SubmitOne(int type, const at::Tensor& input, const c10::optional<at::Tensor>& output,
                    const std::string& name, int op, int root, double prescale, double postscale,
                    int process_set_id) {
  std::vector<Submission> subs(1);
  Submission& s = subs[0];
  s.process_set_id = process_set_id;
  s.request.type = static_cast<OpType>(type);
  s.request.name = name;
  s.request.op = static_cast<ReduceOp>(op);
  s.request.root = root;
  s.request.prescale = prescale;
  s.request.postscale = postscale;
  s.input = input;
  if (output.has_value()) s.output = *output;
  std::vector<std::shared_ptr<HandleState>> states;
  Status st = SubmitToRuntime(std::move(subs), &states);
  int handle = st.ok() ? G().handles.Add(states[0]) : -1;
  return py::make_tuple(static_cast<int>(st.code()), st.message(), handle);
}

py::list Knobs() {
  py::list out;
  Config d;
#define HVD_LIST_KNOB(member, env, type, def, doc) \
  out.append(py::make_tuple(env, #type, py::cast(d.member), doc, KnobAllowed(env)));
  HVD_KNOBS(HVD_LIST_KNOB)
#undef HVD_LIST_KNOB
  return out;
}

}  // namespace

// Hands ops to the process's runtime (an error if hvd.init() has not run).
Status SubmitToRuntime(std::vector<Submission> subs,
                       std::vector<std::shared_ptr<HandleState>>* states) {
  MutexLock lock(G().mu);
  if (!G().runtime) {
    return Status::InvalidArgument(kNotInitialized);
  }
  if (ForkedChild()) return ForkedChildError();
  Status st = G().runtime->Submit(std::move(subs), states);
  G().wait_spin_us = G().runtime->spin_us();  // unset: 100 from the first CUDA tensor on
  return st;
}

namespace {

// The runtime's GPU backend, under G().mu; an error when there is none.
Status RuntimeGpu(GpuBackend** gpu) HVD_REQUIRES(G().mu) {
  if (!G().runtime) return Status::InvalidArgument(kNotInitialized);
  *gpu = G().runtime->gpu();
  if (*gpu == nullptr) {
    return Status::InvalidArgument("this build of horovod_torch has no NCCL (hvd.nccl_built())");
  }
  return Status::Ok();
}

}  // namespace

Status NewDirectCommId(std::string* id) {
  MutexLock lock(G().mu);
  GpuBackend* gpu = nullptr;
  HVD_RETURN_IF_ERROR(RuntimeGpu(&gpu));
  try {
    *id = gpu->NewCommId();
  } catch (const std::exception& e) {
    return Status::Aborted(e.what());
  }
  return Status::Ok();
}

// Under G().mu: a runtime shutting down on another thread waits until the join ends
// (every rank of the group is in it, at the same call of the group).
Status JoinDirectComm(const std::string& id, int rank, int size, int device,
                      std::shared_ptr<DirectComm>* out) {
  MutexLock lock(G().mu);
  GpuBackend* gpu = nullptr;
  HVD_RETURN_IF_ERROR(RuntimeGpu(&gpu));
  return gpu->JoinComm(id, rank, size, device, out);
}

bool C10dCudaDirect() {
  MutexLock lock(G().mu);
  return G().runtime && G().runtime->gpu() != nullptr &&
         G().runtime->config().c10d_cuda_direct != 0;
}

HandleTable& Handles() { return G().handles; }

WaitSettings CurrentWaitSettings() {
  WaitSettings w;
  w.spin_us = G().wait_spin_us.load();
  w.stall_warn_s = G().stall_warn_s.load();
  w.long_wait_s = G().long_wait_s.load();
  return w;
}

void NoteWaitSite(const std::string& name, const std::string& site) {
  MutexLock lock(G().mu);
  if (!G().runtime) return;
  if (site.empty()) {
    G().runtime->EndWait(name);
  } else {
    G().runtime->NoteWait(name, site);
  }
}

void NoteLongWaitSite(const std::string& site) {
  MutexLock lock(G().mu);
  if (G().runtime) G().runtime->NoteLongWait(site);
}

// Names in flight are unique, so two pending groups never share an id but by a 64-bit
// collision.
int64_t GroupId(const std::vector<std::string>& names) {
  Fnv1a h;  // each name followed by a 0xff
  for (const auto& name : names) h.Bytes(name).Byte(0xff);
  const auto id = static_cast<int64_t>(h.value() >> 1);
  return id == 0 ? 1 : id;
}

}  // namespace hvd

PYBIND11_MODULE(_C, m) {
  using namespace hvd;
  m.doc() = "horovod_torch C++ core";
  BindC10dBackend(m);
  m.def("init", &Init);
  m.def("shutdown", &Shutdown);
  m.def("world", &World);
  m.def("running", [] {  // initialised and its engine has not stopped
    MutexLock lock(G().mu);
    return G().runtime != nullptr && !G().runtime->stopped();
  });
  // (code, message) of the error that stopped the engine and aborted its communicators
  // ((0, "") while it runs, and after a shutdown), and
  // the CUDA devices it was given tensors on: hvd.elastic's commit fence.
  m.def("failure", [] {
    Status st;
    {
      py::gil_scoped_release nogil;
      MutexLock lock(G().mu);
      if (G().runtime) st = G().runtime->failure();
    }
    return Err(st);
  });
  m.def("gpu_devices", [] {
    MutexLock lock(G().mu);
    std::vector<int> out;
    const uint64_t mask = G().runtime ? G().runtime->gpu_devices() : 0;
    for (int d = 0; d < 64; ++d) {
      if (mask & (uint64_t{1} << d)) out.push_back(d);
    }
    return out;
  });
  m.def("submit", &Submit);
  m.def("submit_one", &SubmitOne);
  m.def("submit_control", &SubmitControl);
  m.def("knobs", &Knobs);
  m.def("start_timeline", [](const std::string& path, bool mark_cycles) {
    return ControlTimeline(true, path, mark_cycles);
  });
  m.def("stop_timeline", [] { return ControlTimeline(false, "", false); });
  m.def("tuned_params", &TunedParamsDict);
  // The straggler report as this rank last received it: (cycles, samples, step_s, threshold_s,
  // straggler, wait_site, [(host, median_s, p95_s, last_share) per rank]), or None.
  m.def("straggler_report", []() -> py::object {
    StragglerReport r;
    {
      MutexLock lock(G().mu);
      if (!G().runtime) return py::none();
      r = G().runtime->stragglers();
    }
    py::list ranks;
    for (const RankLag& l : r.ranks) {
      ranks.append(py::make_tuple(l.host, l.median_s, l.p95_s, l.last_share));
    }
    return py::make_tuple(r.cycles, r.samples, r.step_s, r.threshold_s, r.straggler, r.wait_site,
                          ranks);
  });
  // (negotiated, cached): the responses this rank took (Runtime::negotiated_ops), negotiated
  // in full or served by the response cache; None before hvd.init().
  m.def("negotiation_counts", []() -> py::object {
    MutexLock lock(G().mu);
    if (!G().runtime) return py::none();
    return py::make_tuple(G().runtime->negotiated_ops(), G().runtime->cached_ops());
  });
  m.def("process_sets", []() -> py::object {
    MutexLock lock(G().mu);
    if (!G().runtime) return py::none();
    return py::cast(G().runtime->process_sets());
  });
  m.def("nccl_built", &NcclVersionBuilt);
  m.def("init_mpi", &InitMpi);
  m.def("mpi_built", [] { return MpiBuilt(); });
  m.def("mpi_enabled", [] {
    MutexLock lock(G().mu);
    return G().runtime != nullptr && G().runtime->world().use_mpi;
  });
  m.def("mpi_threads_supported", [] {
    MutexLock lock(G().mu);
    return G().runtime != nullptr && G().runtime->world().use_mpi && G().mpi_threads;
  });
  m.def("cuda_built", [] { return NcclVersionBuilt() != 0; });
  m.def("native_grad_hooks", [] { return G().native_grad_hooks.load(); });
  BindGradHooks(m);
  m.attr("OP_ALLREDUCE") = static_cast<int>(OpType::kAllreduce);
  m.attr("OP_ALLGATHER") = static_cast<int>(OpType::kAllgather);
  m.attr("OP_BROADCAST") = static_cast<int>(OpType::kBroadcast);
  m.attr("OP_ALLTOALL") = static_cast<int>(OpType::kAlltoall);
  m.attr("OP_REDUCESCATTER") = static_cast<int>(OpType::kReducescatter);
  // The reduction ops (common/types.h's table) by Horovod's names, and the status codes
  // errors come back with (basics.raise_for_status).
  py::dict reduce_ops;
#define HVD_REDUCE_OP_ROW(name, value, text) reduce_ops[text] = value;
  HVD_REDUCE_OPS(HVD_REDUCE_OP_ROW)
#undef HVD_REDUCE_OP_ROW
  m.attr("REDUCE_OPS") = reduce_ops;
  m.attr("STATUS_OK") = static_cast<int>(StatusCode::kOk);
  m.attr("STATUS_INVALID_ARGUMENT") = static_cast<int>(StatusCode::kInvalidArgument);
  m.attr("STATUS_MISMATCH") = static_cast<int>(StatusCode::kMismatch);
  m.attr("STATUS_ABORTED") = static_cast<int>(StatusCode::kAborted);
  m.attr("CONTROL_BARRIER") = static_cast<int>(ControlKind::kBarrier);
  m.attr("CONTROL_JOIN") = static_cast<int>(ControlKind::kJoin);
  m.attr("CONTROL_ADD_PROCESS_SET") = static_cast<int>(ControlKind::kAddProcessSet);
  m.attr("CONTROL_REMOVE_PROCESS_SET") = static_cast<int>(ControlKind::kRemoveProcessSet);
  m.attr("CONTROL_ADD_PROCESS_SET_OF_MEMBERS") =
      static_cast<int>(ControlKind::kAddProcessSetOfMembers);

  BindWaits(m);
  BindStore(m);
}
