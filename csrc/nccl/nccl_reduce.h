// How the NCCL backend reduces: NCCL's types and ops for torch's, and the scale
// factors folded into NCCL's reduction where they can be (FoldedOp).
#pragma once

#include <ATen/ATen.h>
#include <nccl.h>

#include <cstdint>

#include "common/status.h"
#include "common/types.h"
#include "wire/message.h"

namespace hvd {

// NCCL has no int16 or bool: int16 is reduced as int32, bool as uint8 with
// Max for "or" and Min for "and". Data movement uses bytes (ncclUint8).
ncclDataType_t NcclType(at::ScalarType t);
ncclRedOp_t NcclOp(ReduceOp op, bool is_bool);

// Scales in place; integer tensors are scaled in double and truncated back, as
// on the CPU path.
void Scale(at::Tensor& t, double f);

// Bytes of one row (dim 0) of t.
int64_t RowBytes(const at::Tensor& t);

// A user's prescale or postscale factor as a GPU tensor of type t is scaled by: in
// t itself for 16-bit floats (as Horovod's CUDA kernels and upstream's tests do:
// factor.type(dtype) * tensor), else unchanged (float32 rounds it in the kernel, and
// integers are scaled in double).
double FactorIn(at::ScalarType t, double f);

// The tensor NCCL reduces: int16 widened, bool viewed as bytes, else itself.
at::Tensor Reducible(const at::Tensor& t);

// The NCCL op of one reduction, with as much of the scaling folded into it as
// keeps the user's split between before and after the sum. For a float32/float64
// Sum or Average, the prescale multiplies each rank's input inside NCCL's
// reduction (a pre-multiplied sum made for this op; ncclSum when it is 1), and a
// plain Average (no factors) is ncclAvg where 1/size is exact in the type (a
// rounded 1/3 in bfloat16 would scale the whole result by 1.002). pre() and post() are what is left
// for the caller to scale by before and after: a postscale, Average's 1/size after a prescale, or,
// for other types and ops, both factors.
class FoldedOp {
 public:
  FoldedOp(const Response& r, at::ScalarType t, ncclComm_t comm, int size);
  ~FoldedOp() {
    if (created_) ncclRedOpDestroy(op_, comm_);
  }
  FoldedOp(const FoldedOp&) = delete;
  FoldedOp& operator=(const FoldedOp&) = delete;

  ncclRedOp_t op() const { return op_; }
  double pre() const { return pre_; }
  double post() const { return post_; }
  const Status& status() const { return status_; }

 private:
  // The scalar is read before the call returns (ncclScalarHostImmediate).
  bool Create(at::ScalarType t, double f);
#if NCCL_VERSION_CODE >= NCCL_VERSION(2, 11, 0)
  ncclResult_t Make(void* scalar, ncclDataType_t dt) {
    return ncclRedOpCreatePreMulSum(&op_, scalar, dt, ncclScalarHostImmediate, comm_);
  }
#endif

  ncclComm_t comm_;
  ncclRedOp_t op_;
  double pre_, post_;
  bool created_ = false;
  Status status_ = Status::Ok();
};

}  // namespace hvd
