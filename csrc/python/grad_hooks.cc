// GradHooks: DistributedOptimizer's gradient hooks in C++ (see grad_hooks.h).
#include "python/grad_hooks.h"

#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/version.h>
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 9)
#include <torch/csrc/PyInterpreter.h>
#include <torch/csrc/dynamo/compiled_autograd.h>
#endif

#include "common/thread_annotations.h"
#include "python/module_state.h"
#include "python/pass_counter.h"

namespace py = pybind11;

namespace hvd {

struct GradHooks::State {
  struct Slot {
    std::shared_ptr<HandleState> handle;  // until Take()
    at::Tensor wire_tensor;
  };

  std::vector<at::Tensor> params;
  std::vector<std::string> names;
  int op = 0;
  double prescale = 1, postscale = 1;
  int process_set_id = 0;
  c10::optional<at::ScalarType> wire;
  std::vector<int64_t> owners;  // empty: allreduce every gradient
  int rank = 0;                 // this rank's place in the process set
  int set_size = 0;             // and the set's size
  Mutex mu;
  PassCounter counter HVD_GUARDED_BY(mu){0, 1};
  std::vector<Slot> slots HVD_GUARDED_BY(mu);

  void Fire(size_t i) {
    std::string extra;  // a pass too many: raise after unlocking mu
    {
      MutexLock lock(mu);
      switch (counter.Count(i)) {
        case PassCounter::Hit::kWait:
          return;
        case PassCounter::Hit::kExtra:
          extra = counter.ExtraPassMessage();
          break;
        case PassCounter::Hit::kStart:
          Start(i);
          return;
      }
    }
    // As the Python hook: an AssertionError out of backward().
    pybind11::gil_scoped_acquire gil;
    PyErr_SetString(PyExc_AssertionError, extra.c_str());
    ::python_error e;
    e.persist();
    throw e;
  }
  // Submits the reduction of parameter i's gradient (its last pass of the step).
  void Start(size_t i) HVD_REQUIRES(mu) {
    Slot& slot = slots[i];
    const at::Tensor grad = params[i].grad();
    if (!grad.defined() || grad.layout() != at::kStrided || !grad.is_contiguous()) {
      return;  // synchronize() starts it from Python
    }
    const bool scatter = !owners.empty();
    at::Tensor w = grad;
    std::vector<Submission> subs(1);
    Submission& sub = subs[0];
    if (wire && at::isFloatingType(grad.scalar_type()) && grad.scalar_type() != *wire) {
      if (grad.is_cuda() && !scatter) {
        sub.wire = *wire;  // the GPU backend casts while packing, off this thread
      } else {
        w = grad.to(*wire);
      }
    }
    sub.process_set_id = process_set_id;
    sub.request.type = scatter ? OpType::kReducescatter : OpType::kAllreduce;
    sub.request.name = names[i];
    sub.request.op = static_cast<ReduceOp>(op);
    sub.request.prescale = prescale;
    sub.request.postscale = postscale;
    if (scatter) {
      w = w.view(-1);
      sub.request.splits.assign(static_cast<size_t>(set_size), 0);
      sub.request.splits[static_cast<size_t>(owners[i])] = w.numel();
      sub.input = w;
    } else {
      sub.input = w;
      sub.output = w;
    }
    std::vector<std::shared_ptr<HandleState>> states;
    Status st = SubmitToRuntime(std::move(subs), &states);
    if (st.ok()) {
      slot.handle = std::move(states[0]);
    } else {  // raised by synchronize(), with the exception type of its code
      slot.handle = std::make_shared<HandleState>();
      slot.handle->Complete(st);
    }
    counter.MarkStarted(i);
    if (scatter && owners[i] != rank) {
      params[i].mutable_grad().reset();  // another rank's gradient: the runtime holds it
    } else {
      slot.wire_tensor = std::move(w);
    }
  }
};

struct GradHooks::Hook : torch::autograd::FunctionPostHook {
  Hook(std::weak_ptr<State> state, size_t index) : state(std::move(state)), index(index) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& outputs,
                                            const torch::autograd::variable_list&) override {
    if (auto s = state.lock()) s->Fire(index);
    return outputs;
  }
  // Compiled autograd (torch._dynamo.compiled_autograd) runs no C++ hooks: it
  // asks each for a Python callable to put in the graph it builds. Ours runs
  // Fire() there; Dynamo cannot trace it, so the graph breaks and it runs as is,
  // after the gradient was accumulated, as in the eager engine.
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 9)
  // (Older torch declares this hook method differently; there compiled autograd
  // raises NotImplementedError, and HOROVOD_NATIVE_GRAD_HOOKS=0 is the way out.)
  void compiled_args(torch::dynamo::autograd::CompiledNodeArgs& args) const override {
    py::gil_scoped_acquire gil;
    std::weak_ptr<State> st = state;
    const size_t i = index;
    py::object fn = py::cpp_function([st, i](py::args) {
      try {
        if (auto s = st.lock()) s->Fire(i);
      } catch (::python_error& e) {  // the extra-pass AssertionError
        e.restore();
        throw py::error_already_set();
      }
    });
    args.add_post_hook(c10::SafePyObject(fn.release().ptr(), getPyInterpreter()));
  }
#endif
  std::weak_ptr<State> state;
  size_t index;
};

GradHooks::GradHooks(std::vector<at::Tensor> params, std::vector<std::string> names, int op,
                     double prescale, double postscale, int process_set_id, int passes_per_step,
                     const std::string& wire, std::vector<int64_t> owners, int rank, int set_size)
    : state_(std::make_shared<State>()) {
  if (params.size() != names.size()) throw py::value_error("GradHooks: one name per parameter");
  if (!owners.empty() && owners.size() != params.size()) {
    throw py::value_error("GradHooks: one owner per parameter");
  }
  for (int64_t o : owners) {
    if (o < 0 || o >= set_size) throw py::value_error("GradHooks: an owner out of range");
  }
  State& s = *state_;
  s.owners = std::move(owners);
  s.rank = rank;
  s.set_size = set_size;
  s.params = std::move(params);
  s.names = std::move(names);
  s.op = op;
  s.prescale = prescale;
  s.postscale = postscale;
  s.process_set_id = process_set_id;
  if (wire == "float16") {
    s.wire = at::kHalf;
  } else if (wire == "bfloat16") {
    s.wire = at::kBFloat16;
  } else if (!wire.empty()) {
    throw py::value_error("GradHooks: unknown wire dtype '" + wire + "'");
  }
  {
    MutexLock lock(s.mu);  // no hook runs yet; the lock keeps the rule simple
    s.counter = PassCounter(s.params.size(), passes_per_step);
    s.slots.resize(s.params.size());
  }
  for (size_t i = 0; i < s.params.size(); ++i) {
    auto acc = torch::autograd::impl::grad_accumulator(s.params[i]);
    if (!acc) throw py::value_error("GradHooks: parameter " + s.names[i] + " is not a leaf");
    keys_.push_back(acc->add_post_hook(std::make_unique<Hook>(state_, i)));
    accs_.push_back(std::move(acc));  // keeps the accumulator (and our hook) alive
  }
}

GradHooks::~GradHooks() {
  for (size_t i = 0; i < accs_.size(); ++i) accs_[i]->del_post_hook(keys_[i]);
}

py::list GradHooks::Take() {
  py::list out;
  MutexLock lock(state_->mu);
  for (size_t i = 0; i < state_->slots.size(); ++i) {
    State::Slot& slot = state_->slots[i];
    if (!slot.handle) continue;
    int h = Handles().Add(std::move(slot.handle));
    slot.handle = nullptr;
    out.append(py::make_tuple(i, h, slot.wire_tensor));
    slot.wire_tensor = at::Tensor();
  }
  return out;
}

py::object GradHooks::WaitAll() {
  State& s = *state_;
  std::vector<std::shared_ptr<HandleState>> hs(s.params.size());
  std::vector<at::Tensor> wires(s.params.size());
  {
    MutexLock lock(s.mu);
    if (!s.owners.empty()) return py::none();
    for (const State::Slot& slot : s.slots) {
      if (!slot.handle) return py::none();
    }
    for (size_t i = 0; i < s.slots.size(); ++i) {
      hs[i] = std::move(s.slots[i].handle);
      wires[i] = std::move(s.slots[i].wire_tensor);
      s.slots[i] = State::Slot();
    }
  }
  WaitForAll(hs);
  std::vector<at::Tensor> dst, src;
  for (size_t i = 0; i < hs.size(); ++i) {
    const Status& st = hs[i]->status();
    if (!st.ok()) return py::make_tuple(static_cast<int>(st.code()), st.message());
    const at::Tensor& out = wires[i];
    at::Tensor& grad = s.params[i].mutable_grad();
    if (!grad.defined()) {  // dropped since its hook ran: the result becomes .grad
      grad = out.to(s.params[i].scalar_type());
    } else if (out.data_ptr() != grad.data_ptr()) {
      dst.push_back(grad);
      src.push_back(out.view_as(grad));
    }
  }
  if (!dst.empty()) {
    py::gil_scoped_release nogil;
    at::_foreach_copy_(dst, src);
  }
  return py::make_tuple(0, "");
}

void GradHooks::Reset() {
  MutexLock lock(state_->mu);
  for (State::Slot& slot : state_->slots) slot = State::Slot();
  state_->counter.Reset();
}

bool GradHooks::InFlight() {
  MutexLock lock(state_->mu);
  return state_->counter.AnyStarted();
}

void GradHooks::SetPassesPerStep(int n) {
  MutexLock lock(state_->mu);
  state_->counter.set_passes_per_step(n);
}

// _C.GradHooks, and _C.PassCounter: the Python hooks' pass counting, the same
// PassCounter as GradHooks'.
void BindGradHooks(pybind11::module_& m) {
  namespace py = pybind11;
  py::class_<GradHooks>(m, "GradHooks")
      .def(py::init<std::vector<at::Tensor>, std::vector<std::string>, int, double, double, int,
                    int, const std::string&, std::vector<int64_t>, int, int>(),
           py::arg("params"), py::arg("names"), py::arg("op"), py::arg("prescale"),
           py::arg("postscale"), py::arg("process_set_id"), py::arg("passes_per_step"),
           py::arg("wire"), py::arg("owners") = std::vector<int64_t>(), py::arg("rank") = 0,
           py::arg("set_size") = 0)
      .def("take", &GradHooks::Take)
      .def("wait_all", &GradHooks::WaitAll)
      .def("reset", &GradHooks::Reset)
      .def("in_flight", &GradHooks::InFlight)
      .def("set_passes_per_step", &GradHooks::SetPassesPerStep);
  py::class_<PassCounter>(m, "PassCounter")
      .def(py::init<size_t, int>())
      .def("count",  // True: start the allreduce now; a pass too many: AssertionError
           [](PassCounter& c, size_t i) {
             if (i >= c.size())
               throw py::index_error("PassCounter: no parameter " + std::to_string(i));
             switch (c.Count(i)) {
               case PassCounter::Hit::kWait:
                 return false;
               case PassCounter::Hit::kStart:
                 return true;
               case PassCounter::Hit::kExtra:
                 break;
             }
             PyErr_SetString(PyExc_AssertionError, c.ExtraPassMessage().c_str());
             throw py::error_already_set();
           })
      .def("mark_started",
           [](PassCounter& c, size_t i) {
             if (i >= c.size())
               throw py::index_error("PassCounter: no parameter " + std::to_string(i));
             c.MarkStarted(i);
           })
      .def("reset", &PassCounter::Reset)
      .def("set_passes_per_step", &PassCounter::set_passes_per_step);
}

}  // namespace hvd
