// Backward passes counted per parameter, and the error for one pass too many: the one
// implementation behind both gradient-hook paths of DistributedOptimizer (GradHooks in
// C++, and the Python hooks through horovod_torch._C.PassCounter).
//
// Threading: none of its own. GradHooks holds its mutex around it; the Python hooks
// run under the GIL.
#ifndef HOROVOD_TORCH_PYTHON_PASS_COUNTER_H_
#define HOROVOD_TORCH_PYTHON_PASS_COUNTER_H_

#include <string>
#include <vector>

namespace hvd {

class PassCounter {
 public:
  enum class Hit {
    kWait,   // more passes to come before the allreduce
    kStart,  // the step's last pass: start the allreduce (then MarkStarted)
    kExtra,  // its allreduce is already under way: a pass too many (ExtraPassMessage)
  };

  PassCounter(size_t params, int passes_per_step)
      : passes_(params, 0), started_(params, false), passes_per_step_(passes_per_step) {}

  size_t size() const { return passes_.size(); }
  // A gradient of parameter i was accumulated.
  Hit Count(size_t i) {
    if (started_[i]) return Hit::kExtra;
    return ++passes_[i] < passes_per_step_ ? Hit::kWait : Hit::kStart;
  }
  // Its allreduce was submitted (by a hook, or by synchronize()).
  void MarkStarted(size_t i) { started_[i] = true; }
  bool AnyStarted() const {
    for (bool s : started_) {
      if (s) return true;
    }
    return false;
  }
  // A new step (after synchronize, or an elastic reset).
  void Reset() {
    passes_.assign(passes_.size(), 0);
    started_.assign(started_.size(), false);
  }
  void set_passes_per_step(int n) { passes_per_step_ = n; }
  // What backward() raises (as an AssertionError, as Horovod's hook does).
  std::string ExtraPassMessage() const {
    return "Gradients were computed more than backward_passes_per_step (" +
           std::to_string(passes_per_step_) +
           ") times before optimizer.step() or synchronize(); raise "
           "backward_passes_per_step to accumulate gradients locally";
  }

 private:
  std::vector<int> passes_;
  std::vector<bool> started_;
  int passes_per_step_;
};

}  // namespace hvd

#endif  // HOROVOD_TORCH_PYTHON_PASS_COUNTER_H_
