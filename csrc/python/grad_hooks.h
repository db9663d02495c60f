// DistributedOptimizer's gradient hooks in C++ (horovod_torch._C.GradHooks): the
// autograd hook engine behind HOROVOD_NATIVE_GRAD_HOOKS=1; docs/design.md §9a.
#ifndef HOROVOD_TORCH_PYTHON_GRAD_HOOKS_H_
#define HOROVOD_TORCH_PYTHON_GRAD_HOOKS_H_

#include <torch/csrc/autograd/variable.h>
#include <torch/extension.h>

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace hvd {

// DistributedOptimizer's gradient hooks in C++: a post hook on each parameter's
// gradient accumulator submits the in-place allreduce of its .grad straight to the
// runtime. With `owners` (a sharded optimizer's reduce_scatter_gradients: the rank
// of the process set that owns each parameter) it submits instead a reduce-scatter
// whose splits give the whole gradient to its owner, and a rank that does not own
// the parameter drops its .grad at once (the runtime keeps the tensor until sent);
// a fp16/bf16 wire dtype is then cast here, on the GPU too (only allreduce casts
// while packing). With
// Compression.fp16/bf16 a CUDA gradient goes with its wire dtype, and the GPU backend casts while
// it packs and unpacks; a CPU one is cast here first. It runs on the autograd thread without Python
// or the GIL, so a backward pass bound by the CPU that launches its kernels is not slowed by a
// Python call per gradient. synchronize() collects the handles with Take() and starts, in Python,
// the gradients the hooks left alone (no gradient this step, sparse, non-contiguous).
//
// Threading: hooks run on autograd threads, Take/Reset/InFlight on the Python
// thread; one mutex guards the slots. The hooks hold the state weakly, so
// destroying the GradHooks (the optimizer) detaches them.
class GradHooks {
 public:
  GradHooks(std::vector<at::Tensor> params, std::vector<std::string> names, int op, double prescale,
            double postscale, int process_set_id, int passes_per_step, const std::string& wire,
            std::vector<int64_t> owners = {}, int rank = 0, int set_size = 0);
  ~GradHooks();

  // [(parameter index, handle, the tensor reduced)] of the allreduces the hooks
  // started since the last Reset(); the handles go to the handle table.
  pybind11::list Take();
  // synchronize()'s whole work in the common step, without a Python call per
  // gradient: when the hooks started every parameter's allreduce, waits for them all
  // (WaitForAll: the caller's stream then waits for them on the GPU) and writes
  // results that are not already .grad (a CPU gradient's cast) into .grad; returns
  // (0, "") or the (code, message) of the first op that failed. None, with nothing
  // taken, when a parameter's op is not started (no gradient this step, sparse,
  // non-contiguous) or the ops are reduce-scatters: synchronize() then Take()s them.
  pybind11::object WaitAll();
  // Forgets pass counts and started allreduces (after synchronize, or an elastic reset).
  void Reset();
  bool InFlight();
  void SetPassesPerStep(int n);

 private:
  struct State;  // the slots and settings the hooks share (grad_hooks.cc)
  struct Hook;
  // shared_ptr or intrusive_ptr, depending on the torch version
  using AccPtr = decltype(torch::autograd::impl::grad_accumulator(
      std::declval<const torch::autograd::Variable&>()));

  std::shared_ptr<State> state_;
  std::vector<AccPtr> accs_;
  std::vector<uintptr_t> keys_;
};

}  // namespace hvd

#endif  // HOROVOD_TORCH_PYTHON_GRAD_HOOKS_H_
