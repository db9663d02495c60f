// The MPI controller's entry points: csrc/mpi/mpi_transport.cc in builds with MPI,
// csrc/mpi/no_mpi.cc (a stub that says MPI is not built) in the others. No MPI header
// here: the bindings include it in every build.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "common/status.h"
#include "transport/transport.h"

namespace hvd {

struct MpiWorld {
  int rank = 0, size = 1, local_rank = 0, local_size = 1, cross_rank = 0, cross_size = 1;
  bool threads_supported = false;
};
bool MpiBuilt();
// Initialises MPI if nobody has (MPI_THREAD_MULTIPLE, or MPI_THREAD_SERIALIZED with
// `serialized`: HOROVOD_MPI_THREADS_DISABLE) and makes the job's communicator: over
// a duplicate of `fortran_handle`'s communicator (0: MPI_COMM_WORLD), or, if `ranks`
// is non-empty, the sub-communicator of those MPI_COMM_WORLD ranks. Collective over
// that communicator's (or MPI_COMM_WORLD's) processes.
Status MpiSetup(const std::vector<int>& ranks, int64_t fortran_handle, bool serialized,
                MpiWorld* world, std::unique_ptr<Communicator>* out);

}  // namespace hvd
