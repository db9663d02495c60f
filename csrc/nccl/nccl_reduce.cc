#include "nccl/nccl_reduce.h"

#include <string>

namespace hvd {

ncclDataType_t NcclType(at::ScalarType t) {
  switch (t) {
    case at::kByte:
      return ncclUint8;
    case at::kBool:
      return ncclUint8;
    case at::kChar:
      return ncclInt8;
    case at::kInt:
      return ncclInt32;
    case at::kLong:
      return ncclInt64;
    case at::kHalf:
      return ncclFloat16;
    case at::kBFloat16:
      return ncclBfloat16;
    case at::kFloat:
      return ncclFloat32;
    case at::kDouble:
      return ncclFloat64;
    default:
      return ncclInt32;  // int16 is widened first
  }
}

ncclRedOp_t NcclOp(ReduceOp op, bool is_bool) {
  switch (op) {
    case ReduceOp::kMin:
      return ncclMin;
    case ReduceOp::kMax:
      return ncclMax;
    case ReduceOp::kProduct:
      return is_bool ? ncclMin : ncclProd;
    default:
      return is_bool ? ncclMax : ncclSum;
  }
}

void Scale(at::Tensor& t, double f) {
  if (f == 1.0) return;
  if (at::isFloatingType(t.scalar_type())) {
    t.mul_(f);
  } else {
    t.copy_(t.to(at::kDouble).mul_(f));
  }
}

int64_t RowBytes(const at::Tensor& t) {
  int64_t n = t.element_size();
  for (int64_t i = 1; i < t.dim(); ++i) n *= t.size(i);
  return n;
}

double FactorIn(at::ScalarType t, double f) {
  switch (t) {
    case at::kHalf:
      return static_cast<double>(static_cast<float>(c10::Half(static_cast<float>(f))));
    case at::kBFloat16:
      return static_cast<double>(static_cast<float>(c10::BFloat16(static_cast<float>(f))));
    default:
      return f;
  }
}

FoldedOp::FoldedOp(const Response& r, at::ScalarType t, ncclComm_t comm, int size) : comm_(comm) {
  const FoldedReduction f =
      FoldAverage(r.op, FactorIn(t, r.prescale), FactorIn(t, r.postscale), size);
  op_ = NcclOp(f.op, t == at::kBool);
  pre_ = f.pre;
  post_ = f.post;
  const bool sum = f.op == ReduceOp::kSum;
  if (!sum || !at::isFloatingType(t)) return;
  if (r.op == ReduceOp::kAverage && r.prescale == 1.0 && r.postscale == 1.0 &&
      FactorIn(t, 1.0 / size) == 1.0 / size) {
    op_ = ncclAvg;  // NCCL multiplies by 1/size in the tensor's type
    post_ = 1.0;
  } else if (pre_ == 1.0) {
    op_ = ncclSum;
  } else if (size == 1 || t == at::kHalf || t == at::kBFloat16 || !Create(t, pre_)) {
    // Kernels: for 16-bit types, NCCL's pre-multiplied sum adds each scaled input
    // before rounding it to the type, where Horovod scales (and rounds) first and
    // then sums: an ulp apart at 4 ranks. On a communicator of one rank NCCL 2.28's
    // pre-multiplied sum leaves elements unscaled (the last of 17^3 float32s: upstream's
    // test_horovod_allreduce_prescale at one GPU). Else an unusual type, or an error
    // (status()).
    return;
  }
  pre_ = 1.0;
}

bool FoldedOp::Create(at::ScalarType t, double f) {
#if NCCL_VERSION_CODE < NCCL_VERSION(2, 11, 0)
  (void)t;
  (void)f;
  return false;  // no pre-multiplied sums before NCCL 2.11: scaled by kernels
#else
  ncclResult_t res;
  switch (t) {
    case at::kFloat: {
      float v = static_cast<float>(f);
      res = Make(&v, ncclFloat32);
      break;
    }
    case at::kDouble: {
      double v = f;
      res = Make(&v, ncclFloat64);
      break;
    }
    default:
      return false;
  }
  if (res != ncclSuccess) {
    status_ = Status::Aborted(std::string("NCCL error in ncclRedOpCreatePreMulSum: ") +
                              ncclGetErrorString(res));
    return false;
  }
  created_ = true;
  return true;
#endif
}

at::Tensor Reducible(const at::Tensor& t) {
  if (t.scalar_type() == at::kShort) return t.to(at::kInt);
  if (t.scalar_type() == at::kBool) return t.view(at::kByte);
  return t;
}

}  // namespace hvd
