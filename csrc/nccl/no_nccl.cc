// Registry for builds without CUDA/NCCL (built instead of the rest of csrc/nccl):
// there is no GPU data plane.
#include "core/gpu_backend.h"

namespace hvd {

std::unique_ptr<GpuBackend> CreateGpuBackend(ControlPlane*, int, int, double, bool) {
  return nullptr;
}

int NcclVersionBuilt() { return 0; }

bool DirectReducible(at::ScalarType, ReduceOp) { return false; }

}  // namespace hvd
