// Registry for builds with CUDA and NCCL: the GPU data plane is NcclBackend.
#include "nccl/nccl_backend.h"

namespace hvd {

std::unique_ptr<GpuBackend> CreateGpuBackend(ControlPlane* control, int rank, int size,
                                             double op_timeout_s, bool time_collectives) {
  return std::make_unique<NcclBackend>(control, rank, size, op_timeout_s, time_collectives);
}

int NcclVersionBuilt() { return NCCL_VERSION_CODE; }

}  // namespace hvd
