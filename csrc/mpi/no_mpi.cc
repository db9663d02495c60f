// Builds without MPI: the MPI controller is not available.
#include "mpi/mpi_setup.h"

namespace hvd {

bool MpiBuilt() { return false; }

Status MpiSetup(const std::vector<int>&, int64_t, bool, MpiWorld*, std::unique_ptr<Communicator>*) {
  return Status::InvalidArgument(
      "this build of horovod_torch has no MPI support (mpicxx was not found when it was "
      "built); install MPI (e.g. libopenmpi-dev) and rebuild, or launch with horovodrun");
}

}  // namespace hvd
