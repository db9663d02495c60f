// The calls of one torch.distributed group on the "hvd" backend (c10d_backend.cc):
// named, submitted to the runtime, and given their Work.
//
// Naming: the runtime matches ops across ranks by name. A c10d call has none; every
// rank issues the group's calls in the same order, so the n-th call is named by its
// group, its slot n % kC10dSlots, and its kind and arguments (core/c10d_names.h):
// names that repeat from step to step, which the response cache serves without a
// negotiation round. A call waits for the previous call of its slot to complete before
// it is submitted (the caller blocks). A send or recv is named by its sender, receiver,
// tag and count; a receive from any source by its receiver, tag and count.
//
// Threading: one call at a time per group (a mutex), from any thread.
#ifndef HOROVOD_TORCH_PYTHON_C10D_CALLS_H_
#define HOROVOD_TORCH_PYTHON_C10D_CALLS_H_

#include <torch/csrc/distributed/c10d/Types.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <chrono>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "common/thread_annotations.h"
#include "core/c10d_names.h"
#include "core/runtime.h"
#include "python/c10d_work.h"

namespace hvd {

// A torch.distributed reduction as the engine's op and the factor each rank's input
// is multiplied by first (PREMUL_SUM: a sum of the scaled inputs, as NCCL's).
struct Reduction {
  ReduceOp op;
  double prescale = 1.0;
};

// `op` as a Reduction; an error naming `what` for the ops the engine has not.
Reduction OurOp(const c10d::ReduceOp& op, const char* what);

// Copies a call's results from its ops' handles into the caller's tensors.
using Finish = std::function<void(const std::vector<std::shared_ptr<HandleState>>&)>;

class C10dCalls {
 public:
  // `timeout`: the group's; `group`: torch's name of the group.
  C10dCalls(std::chrono::milliseconds timeout, const std::string& group);

  // Submits `subs` (one op each; several: an atomic group) as the group's next call
  // and returns its Work; throws DistBackendError when the runtime refuses them.
  // `p2p`: a send/recv's sender, receiver and tag (sender -1: a receive from any
  // source), which number its name instead of the group's order.
  c10::intrusive_ptr<c10d::Work> Run(c10d::OpType type, const char* what,
                                     std::vector<Submission> subs, std::vector<at::Tensor> outputs,
                                     Finish finish, const P2pName* p2p = nullptr);

 private:
  std::vector<std::string> NamesFor(const char* what, const std::vector<Submission>& subs,
                                    const P2pName* p2p, uint64_t* slot) HVD_REQUIRES(mu_);
  void WaitForSlot(uint64_t slot, const char* what) HVD_REQUIRES(mu_);
  // Counts each message a completed receive from any source took as one from its
  // sender, and forgets it. Before a recv from a named rank with `tag` (non-null), first
  // waits for this rank's receives from any source with that tag.
  void SettleAnySource(const int64_t* tag, const char* what) HVD_REQUIRES(mu_);

  const std::chrono::milliseconds timeout_;
  const std::string group_;  // without dots: groups sharing a process set differ by it
  Mutex mu_;                 // every rank must name its calls in the same order
  uint64_t calls_ HVD_GUARDED_BY(mu_) = 0;
  std::string broken_ HVD_GUARDED_BY(mu_);  // why every call fails (WaitForSlot)
  // Each slot's last call's ops (core/c10d_names.h).
  std::vector<std::shared_ptr<HandleState>> slots_[kC10dSlots] HVD_GUARDED_BY(mu_);
  // By "<sender>.<receiver>.<tag>" (sender -1: receives from any source).
  std::map<std::string, uint64_t> p2p_calls_ HVD_GUARDED_BY(mu_);
  // Receives from any source not yet counted by their sender: the receive, its op.
  std::vector<std::pair<P2pName, std::shared_ptr<HandleState>>> any_ HVD_GUARDED_BY(mu_);
};

}  // namespace hvd

#endif  // HOROVOD_TORCH_PYTHON_C10D_CALLS_H_
