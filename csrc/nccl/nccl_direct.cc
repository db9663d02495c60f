#include "nccl/nccl_direct.h"

#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>

#include <chrono>
#include <cstring>
#include <stdexcept>
#include <thread>

#include "nccl/nccl_reduce.h"

namespace hvd {
namespace {

void Throw(const std::string& error) {
  if (!error.empty()) throw std::runtime_error(error);
}

std::string NcclError(const char* what, ncclResult_t r, ncclComm_t comm) {
  return std::string("NCCL error in ") + what + ": " + ncclGetErrorString(r) + " (" +
         ncclGetLastError(comm) + ")";
}

ncclRedOp_t DirectNcclOp(ReduceOp op) {
  return op == ReduceOp::kAverage ? ncclAvg : NcclOp(op, false);
}

}  // namespace

bool DirectReducible(at::ScalarType t, ReduceOp op) {
  switch (t) {
    case at::kFloat:
    case at::kDouble:
    case at::kHalf:
    case at::kBFloat16:
      return true;
    case at::kByte:
    case at::kChar:
    case at::kInt:
    case at::kLong:
      return op != ReduceOp::kAverage;  // torch's NCCL group refuses it too
    default:
      return false;  // int16, bool, complex: the engine's path widens or refuses them
  }
}

Status AsyncError(ncclComm_t comm, int device) {
  ncclResult_t async = ncclSuccess;
  const ncclResult_t got = ncclCommGetAsyncError(comm, &async);
  if (got != ncclSuccess) async = got;
  if (async == ncclSuccess || async == ncclInProgress) return Status::Ok();
  return Status::Aborted("NCCL reported an asynchronous error on GPU " + std::to_string(device) +
                         ": " + ncclGetErrorString(async) + " (" + ncclGetLastError(comm) + ")");
}

NcclDirect::NcclDirect(const std::string& id, int rank, int size, int device, Status* status)
    : device_(device) {
  ncclUniqueId uid;
  if (id.size() != sizeof(uid)) {
    *status = Status::InvalidArgument("bad NCCL unique id for a communicator of the group");
    return;
  }
  std::memcpy(&uid, id.data(), sizeof(uid));
  const auto dev = static_cast<c10::DeviceIndex>(device);
  c10::cuda::CUDAGuard guard(dev);
  const ncclResult_t r = ncclCommInitRank(&comm_, size, uid, rank);
  if (r != ncclSuccess) {
    comm_ = nullptr;
    *status = Status::Aborted(NcclError("ncclCommInitRank", r, nullptr));
    return;
  }
  stream_ = c10::cuda::getStreamFromPool(/*isHighPriority=*/true, dev);
  *status = Status::Ok();
}

NcclDirect::~NcclDirect() {
  if (comm_ == nullptr) return;
  if (aborted_) return;  // Abort() freed it
  ncclCommDestroy(comm_);
}

std::string NcclDirect::Broken() {
  MutexLock lock(mu_);
  return broken_;
}

void NcclDirect::Fail(const std::string& why) {
  MutexLock lock(mu_);
  if (broken_.empty()) broken_ = why;
}

std::shared_ptr<GpuEvent> NcclDirect::Enqueue(const std::vector<DirectOp>& ops,
                                              const std::string& name) {
  // Held while NCCL may use the communicator: Abort() frees it only after this ends
  // (or after a while: a call blocked on a lost peer must be ended by the abort).
  struct Use {
    std::atomic<int>& n;
    explicit Use(std::atomic<int>& c) : n(c) { ++n; }
    ~Use() { --n; }
  } use(users_);
  const std::string broken = Broken();
  if (!broken.empty() || aborted_) Throw(broken.empty() ? "the communicator was aborted" : broken);
  const auto dev = static_cast<c10::DeviceIndex>(device_);
  c10::cuda::CUDAGuard guard(dev);
  const c10::cuda::CUDAStream& stream = *stream_;
  auto ready = std::make_shared<NcclEvent>(device_);
  Throw(ready->Record(c10::cuda::getCurrentCUDAStream(dev)));
  Throw(ready->Block(stream));
  auto start = std::make_shared<NcclEvent>(device_);
  Throw(start->Record(stream));
  ncclResult_t r = ncclGroupStart();
  for (const DirectOp& op : ops) {
    if (r != ncclSuccess) break;
    void* in = op.input.data_ptr();
    void* out = op.output.data_ptr();
    switch (op.kind) {
      case DirectOp::Kind::kAllreduce:
        r = ncclAllReduce(in, out, op.input.numel(), NcclType(op.input.scalar_type()),
                          DirectNcclOp(op.op), comm_, stream);
        break;
      case DirectOp::Kind::kBroadcast:
        r = ncclBroadcast(in, out, op.output.nbytes(), ncclUint8, op.root, comm_, stream);
        break;
      case DirectOp::Kind::kAllgather:
        r = ncclAllGather(in, out, op.input.nbytes(), ncclUint8, comm_, stream);
        break;
      case DirectOp::Kind::kReducescatter:
        r = ncclReduceScatter(in, out, op.output.numel(), NcclType(op.input.scalar_type()),
                              DirectNcclOp(op.op), comm_, stream);
        break;
    }
  }
  const ncclResult_t end = ncclGroupEnd();
  if (r == ncclSuccess) r = end;
  if (r != ncclSuccess) {
    const std::string error = NcclError(name.c_str(), r, comm_);
    Fail(error);
    Throw(error);
  }
  auto done = std::make_shared<NcclEvent>(device_);
  Throw(done->Record(stream));
  for (const DirectOp& op : ops) {
    // Memory used on our stream must not be reused before that work finishes.
    c10::cuda::CUDACachingAllocator::recordStream(op.input.storage().data_ptr(), stream);
    c10::cuda::CUDACachingAllocator::recordStream(op.output.storage().data_ptr(), stream);
  }
  MutexLock lock(mu_);
  DropDone(in_flight_);
  in_flight_.push_back(InFlight{std::move(start), done, name});
  return done;
}

void NcclDirect::Abort(const std::string& why) {
  Fail(why);
  if (comm_ == nullptr || aborted_.exchange(true)) return;
  // A caller still inside Enqueue() gets a second to leave NCCL first.
  for (int i = 0; i < 1000 && users_.load() > 0; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  ncclCommAbort(comm_);
}

void NcclDirect::End(const std::string& why, double grace_s) {
  Fail(why);
  const auto until = std::chrono::steady_clock::now() + std::chrono::duration<double>(grace_s);
  for (;;) {
    {
      MutexLock lock(mu_);
      DropDone(in_flight_);
      if (in_flight_.empty()) return;
    }
    if (std::chrono::steady_clock::now() >= until) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  Abort(why);
}

Status NcclDirect::Check(double timeout_s) {
  if (comm_ == nullptr || aborted_) return Status::Ok();
  HVD_RETURN_IF_ERROR(AsyncError(comm_, device_));
  MutexLock lock(mu_);
  return CheckInFlight(in_flight_, timeout_s, device_);
}

}  // namespace hvd
