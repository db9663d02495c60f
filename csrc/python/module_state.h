// What the module's global state (bindings.cc) offers the rest of csrc/python: the
// one way to hand ops to the process's runtime, the handle table that outlives it,
// and what waits tell the runtime. grad_hooks.cc and c10d_backend.cc submit through
// these; waits.cc waits through them. Also the parts of the module that other files
// bind (the Bind* functions), called by bindings.cc's PYBIND11_MODULE.
#ifndef HOROVOD_TORCH_PYTHON_MODULE_STATE_H_
#define HOROVOD_TORCH_PYTHON_MODULE_STATE_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <pybind11/pybind11.h>

#include "common/status.h"
#include "core/handles.h"
#include "core/runtime.h"

namespace hvd {

// Submits `subs` to the runtime of hvd.init(); an error status when there is none
// (not initialised, or a forked child's copy). `states` gets one handle state per op.
Status SubmitToRuntime(std::vector<Submission> subs,
                       std::vector<std::shared_ptr<HandleState>>* states);

// A communicator of a torch.distributed group's own on the runtime's GPU data plane
// (core/gpu_backend.h's DirectComm): rank 0's new id, and joining it (blocks until
// every rank has). An error status when there is no runtime, or it has no NCCL.
Status NewDirectCommId(std::string* id);
Status JoinDirectComm(const std::string& id, int rank, int size, int device,
                      std::shared_ptr<DirectComm>* out);
// HOROVOD_C10D_CUDA_DIRECT of the running runtime, and that it has NCCL.
bool C10dCudaDirect();

// The process's handle table (integer handles given to Python).
HandleTable& Handles();

// A group's id: a hash of its members' names, so that it is the same on every rank
// whatever order the ranks submit their groups in (0 means "not grouped").
int64_t GroupId(const std::vector<std::string>& names);

// The wait settings of the last init() (read without a lock).
struct WaitSettings {
  double spin_us = 0;          // HOROVOD_SPIN_US
  double stall_warn_s = 60;    // a wait this long logs where it waits (inf: off)
  double long_wait_s = 0.005;  // a wait this long is a straggler's mark (inf: off)
};
WaitSettings CurrentWaitSettings();

// Tells the runtime, if any, that a thread waits for op `name` in the Python caller
// `site` (the coordinator's stall report names it), or with an empty site that it no
// longer does. Called without the GIL.
void NoteWaitSite(const std::string& name, const std::string& site);

// Tells the runtime, if any, where a wait as long as a straggler's lag happened.
void NoteLongWaitSite(const std::string& site);

// Waits for every op of `hs` (null entries are skipped) as _C.wait_many does: with
// the GIL released while one is not done, interruptible by Python's signals (then
// py::error_already_set), each op's name freed; then the caller's current stream
// waits once per done event of the ops that succeeded. Called with the GIL held.
void WaitForAll(const std::vector<std::shared_ptr<HandleState>>& hs);

void BindWaits(pybind11::module_& m);      // waits.cc: poll, wait, wait_many, release
void BindStore(pybind11::module_& m);      // store_bindings.cc: StoreServer, StoreClient
void BindGradHooks(pybind11::module_& m);  // grad_hooks.cc: GradHooks, PassCounter

}  // namespace hvd

#endif  // HOROVOD_TORCH_PYTHON_MODULE_STATE_H_
