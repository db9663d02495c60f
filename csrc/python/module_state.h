// What the module's global state (bindings.cc) offers the rest of csrc/python: the
// one way to hand ops to the process's runtime, and the handle table that outlives
// it. grad_hooks.cc submits through these.
#ifndef HOROVOD_TORCH_PYTHON_MODULE_STATE_H_
#define HOROVOD_TORCH_PYTHON_MODULE_STATE_H_

#include <memory>
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

}  // namespace hvd

#endif  // HOROVOD_TORCH_PYTHON_MODULE_STATE_H_
