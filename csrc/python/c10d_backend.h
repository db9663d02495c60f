// The torch.distributed backend "hvd" (docs/torch_distributed.md): a c10d::Backend
// whose collectives are ops of this process's runtime.
// horovod_torch/integrations/torch_distributed.py registers it with torch and brings the runtime up
// through torch's store.
#ifndef HOROVOD_TORCH_PYTHON_C10D_BACKEND_H_
#define HOROVOD_TORCH_PYTHON_C10D_BACKEND_H_

#include <torch/extension.h>

namespace hvd {

// Adds _C.c10d_backend(rank, size, timeout_s) -> torch._C._distributed_c10d.Backend.
void BindC10dBackend(pybind11::module_& m);

}  // namespace hvd

#endif  // HOROVOD_TORCH_PYTHON_C10D_BACKEND_H_
