// What the module's global state (bindings.cc) offers the rest of csrc/python: the
// one way to hand ops to the process's runtime, and the handle table that outlives
// it. grad_hooks.cc and c10d_backend.cc submit through these.
#ifndef HOROVOD_TORCH_PYTHON_MODULE_STATE_H_
#define HOROVOD_TORCH_PYTHON_MODULE_STATE_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "common/status.h"
#include "core/handles.h"
#include "core/runtime.h"

namespace hvd {

// Submits `subs` to the runtime of hvd.init(); an error status when there is none
// (not initialised, or a forked child's copy). `states` gets one handle state per op.
Status SubmitToRuntime(std::vector<Submission> subs,
                       std::vector<std::shared_ptr<HandleState>>* states);

// The process's handle table (integer handles given to Python).
HandleTable& Handles();

// A group's id: a hash of its members' names, so that it is the same on every rank
// whatever order the ranks submit their groups in (0 means "not grouped").
int64_t GroupId(const std::vector<std::string>& names);

}  // namespace hvd

#endif  // HOROVOD_TORCH_PYTHON_MODULE_STATE_H_
