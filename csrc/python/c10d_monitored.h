// dist.monitored_barrier on the "hvd" backend (docs/torch_distributed.md), through the
// group's own send and recv.
#ifndef HOROVOD_TORCH_PYTHON_C10D_MONITORED_H_
#define HOROVOD_TORCH_PYTHON_C10D_MONITORED_H_

#include <torch/csrc/distributed/c10d/Backend.hpp>

#include <chrono>
#include <cstdint>

namespace hvd {

// As gloo's: every other rank of `group` sends rank 0 a token and waits for its
// answer; rank 0 waits up to `limit` for the tokens and raises naming the first rank
// whose token did not come (every such rank, with wait_all_ranks), else answers them
// all. A rank that does not get the answer in time raises too. One-byte sends and
// receives with a tag of the call's own (`call`: the group's k-th monitored barrier),
// so that what a failed call left pending never pairs with a later call's.
void MonitoredBarrier(c10d::Backend& group, std::chrono::milliseconds limit, uint64_t call,
                      bool wait_all_ranks);

}  // namespace hvd

#endif  // HOROVOD_TORCH_PYTHON_C10D_MONITORED_H_
