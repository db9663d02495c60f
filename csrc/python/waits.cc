// Waiting for ops from Python: interruptible waits (Ctrl-C and test timeouts reach a
// collective that never completes), the Python caller of a long wait for the stall and
// straggler reports, and the results handed back to Python. Bound as _C.poll, _C.wait
// and _C.wait_many.
#include <torch/extension.h>

#include <chrono>
#include <unordered_set>

#include "common/logging.h"
#include "core/gpu_backend.h"
#include "core/handles.h"
#include "python/module_state.h"

namespace py = pybind11;

namespace hvd {
namespace {

py::object Poll(int handle) {
  auto h = Handles().Find(handle);
  if (!h) return py::none();
  return py::bool_(h->Poll());
}

// (code, message, output or None, received splits or None) of a finished op.
py::tuple Result(const HandleState& h) {
  const Status& st = h.status();
  py::object out = h.output().defined() ? py::cast(h.output()) : py::none();
  py::object splits = h.splits().defined() ? py::cast(h.splits()) : py::none();
  return py::make_tuple(static_cast<int>(st.code()), st.message(), out, splits);
}

// "file:line in function" of the innermost Python frame outside horovod_torch and
// torch (the user's call: `optimizer.step()`, not torch's wrapper of it), or
// "(unknown)". Walks the frames without reading source lines. Needs the GIL.
std::string PythonCaller() {
  try {
    auto dir_of = [](const char* module) {
      return py::module_::import("os.path")
                 .attr("dirname")(py::module_::import(module).attr("__file__"))
                 .cast<std::string>() +
             "/";
    };
    // Not function-local statics: their first initialisation would run Python (which
    // may hand the GIL to another thread) under the static's guard, a deadlock if that
    // thread reaches the same guard. Both modules are loaded: a dictionary lookup each.
    const std::string ours = dir_of("horovod_torch");
    const std::string torch_dir = dir_of("torch");
    py::object frame = py::module_::import("sys").attr("_getframe")(0);
    for (; !frame.is_none(); frame = frame.attr("f_back")) {
      py::object code = frame.attr("f_code");
      const std::string file = code.attr("co_filename").cast<std::string>();
      if (file.rfind(ours, 0) == 0 || file.rfind(torch_dir, 0) == 0) continue;
      return file + ":" + std::to_string(frame.attr("f_lineno").cast<int>()) + " in " +
             code.attr("co_name").cast<std::string>();
    }
  } catch (const py::error_already_set&) {
  }
  return "(unknown)";
}

// Waits for `h` with the GIL released (called with it held). Every 100 ms it looks
// at Python's signals, so that Ctrl-C, or a test runner's timeout, interrupts a
// collective that never completes as it interrupts any other call: it then throws
// py::error_already_set (the op goes on; its name is freed once it completes).
// A wait longer than half a second (or half the stall check time) reads the Python
// file and line of the caller (only then, so a short wait costs nothing) and hands
// it to the runtime, which sends it with its next full cycle: the coordinator's
// stall report then says, in one message, where each rank waits. A wait longer than
// the stall check time also logs it on this rank, once.
void WaitInterruptibly(HandleState& h, double spin_us) {
  constexpr std::chrono::milliseconds kSignalCheck(100);
  bool done = h.done();
  if (done) {
    h.ReleaseName();
    return;
  }
  const auto start = std::chrono::steady_clock::now();
  {
    py::gil_scoped_release nogil;
    done = h.Wait(spin_us, kSignalCheck);
  }
  bool told = false;
  std::string noted;        // the Python caller, read after half a second
  bool registered = false;  // ... and handed to the runtime for the stall report
  while (!done) {
    if (PyErr_CheckSignals() != 0) {
      if (registered) {
        py::gil_scoped_release nogil;
        NoteWaitSite(h.name(), "");
      }
      throw py::error_already_set();
    }
    const double waited =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    const double warn_s = CurrentWaitSettings().stall_warn_s;
    if (noted.empty() && waited >= std::min(0.5, warn_s / 2)) noted = PythonCaller();
    if (!told && waited >= warn_s) {
      told = true;
      HVD_LOG(kWarning) << "this rank has waited " << static_cast<int>(waited) << " s for '"
                        << h.name() << "' at " << noted
                        << " (see the coordinator's stall report for the missing ranks)";
    }
    py::gil_scoped_release nogil;
    if (!noted.empty() && !registered) {
      NoteWaitSite(h.name(), noted);
      registered = true;
    }
    done = h.Wait(0, kSignalCheck);
  }
  if (registered) {
    py::gil_scoped_release nogil;
    NoteWaitSite(h.name(), "");
  }
  h.ReleaseName();
  // A wait as long as a straggler's lag: where the ranks wait, for the straggler
  // report (a frame walk per such wait, far below the wait itself).
  if (std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() >=
      CurrentWaitSettings().long_wait_s) {
    if (noted.empty()) noted = PythonCaller();
    py::gil_scoped_release nogil;
    NoteLongWaitSite(noted);
  }
}

// Waits, releases the handle and returns (code, message, output or None, received
// splits or None), or None for an unknown handle.
py::object Wait(int handle) {
  auto h = Handles().Find(handle);
  if (!h) return py::none();
  Handles().Release(handle);
  WaitInterruptibly(*h, CurrentWaitSettings().spin_us);
  // GPU ops: the caller's stream waits for the result; the host does not.
  if (h->event() != nullptr && h->status().ok()) {
    py::gil_scoped_release nogil;
    h->BlockCurrentStream(true);
  }
  return Result(*h);
}

// Wait() for many handles (the optimizer's synchronize): the GIL is released only
// for handles not yet done, and the caller's stream waits once per done event (a
// fused batch shares one).
// None for an unknown handle.
py::list WaitMany(const std::vector<int>& handles) {
  std::vector<std::shared_ptr<HandleState>> hs(handles.size());
  for (size_t i = 0; i < handles.size(); ++i) {
    hs[i] = Handles().Find(handles[i]);
    if (hs[i]) Handles().Release(handles[i]);
  }
  WaitForAll(hs);
  py::list out;
  for (auto& h : hs) {
    if (h) {
      out.append(Result(*h));
    } else {
      out.append(py::none());
    }
  }
  return out;
}

}  // namespace

void WaitForAll(const std::vector<std::shared_ptr<HandleState>>& hs) {
  const double spin = CurrentWaitSettings().spin_us;
  for (auto& h : hs) {
    if (h) WaitInterruptibly(*h, spin);
  }
  py::gil_scoped_release nogil;
  std::unordered_set<const GpuEvent*> waited;
  for (auto& h : hs) {
    if (h && h->event() != nullptr && h->status().ok()) {
      h->BlockCurrentStream(waited.insert(h->event().get()).second);
    }
  }
}

void BindWaits(py::module_& m) {
  m.def("poll", &Poll);
  m.def("wait", &Wait);
  m.def("wait_many", &WaitMany);
  m.def("release", [](int h) { Handles().Release(h); });
}

}  // namespace hvd
