// Negotiation messages. Each cycle every rank sends a RequestList to the coordinator
// (rank 0 of the process set); the coordinator answers every rank with the same
// ResponseList. Layout on the wire: docs/wire.md.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "common/status.h"
#include "common/types.h"

namespace hvd {

// The data operations, and kControl: an op that moves no tensor (ControlOp says
// which). Executors and backends run data operations only; the Runtime applies
// control operations itself.
enum class OpType : uint8_t {
  kAllreduce = 0,
  kAllgather = 1,
  kBroadcast = 2,
  kAlltoall = 3,
  kReducescatter = 4,
  kControl = 5,
};

enum class ControlKind : uint8_t {
  kNone = 0,  // a data operation
  kBarrier = 1,
  kJoin = 2,  // this rank has no more data; it contributes zeros until all have joined
  // Register a process set / remove one. Run on the global set, so every rank applies
  // it at the same point of its op sequence.
  kAddProcessSet = 3,
  kRemoveProcessSet = 4,
  // Register a process set that only its members submit (torch.distributed's
  // new_group: torch creates a group's backend on its members only). Ready once every
  // member submitted it; every rank then applies it at that point, as kAddProcessSet.
  // A set of exactly these ranks that already exists is shared instead.
  kAddProcessSetOfMembers = 5,
};

// A control operation: negotiated by name like a collective (every rank of its set
// submits it, in the same order), with fields of its own.
struct ControlOp {
  ControlKind kind = ControlKind::kNone;
  std::vector<int64_t> ranks;  // kAddProcessSet(OfMembers): the set's global ranks, ascending
  int32_t process_set = 0;     // kRemoveProcessSet: the set's id
  int32_t last_joined = -1;    // kJoin, in the response: the last rank to join

  bool operator==(const ControlOp& o) const {
    return kind == o.kind && ranks == o.ranks && process_set == o.process_set &&
           last_joined == o.last_joined;
  }
};

const char* OpTypeName(OpType t);
const char* ControlKindName(ControlKind k);
// "allreduce", ..., or a control op's kind ("barrier", "join", ...): for messages and
// the timeline.
template <typename Message>
const char* OpName(const Message& m) {
  return m.type == OpType::kControl ? ControlKindName(m.control.kind) : OpTypeName(m.type);
}

// What one rank wants to run. Everything ranks must agree on is in here.
struct Request {
  int32_t rank = 0;
  OpType type = OpType::kAllreduce;
  std::string name;
  DataType dtype = DataType::kFloat32;
  ReduceOp op = ReduceOp::kSum;
  int32_t root = 0;
  double prescale = 1.0;
  double postscale = 1.0;
  std::vector<int64_t> shape;
  std::vector<int64_t> splits;  // alltoall: rows sent to each rank; reducescatter: rows kept
  int64_t group_id = 0;         // 0: not grouped; else every member must be ready
  int32_t group_size = 0;
  int32_t device = -1;  // -1: CPU tensor; else the CUDA device index
  // Empty: every rank of the process set takes part. Else the set ranks that do,
  // ascending; the op is ready once each of them submitted it, and the others skip it.
  // A broadcast between two ranks is a send from its root to the other (c10d send/recv).
  // One rank, with root -1: a receive from any source (IsAnyRecv), which the coordinator
  // pairs with a send to that rank (Controller::BindAnySource).
  std::vector<int64_t> participants;
  ControlOp control;  // kControl only

  // Everything except `rank`: two ranks' requests for one name must have equal
  // signatures for the cache to treat them as a repeat.
  std::string Signature() const;
  int64_t NumElements() const;
};

struct RequestList {
  uint32_t cache_capacity = 0;         // must be equal on every rank
  std::vector<Request> requests;       // requests not served by the response cache
  std::vector<uint64_t> ready_bits;    // cache positions this rank has pending
  std::vector<uint64_t> invalid_bits;  // cache positions this rank found stale
  bool shutdown = false;
  // The ops this rank's threads have waited for a while, "name\tfile:line" (the
  // Python caller): only for the coordinator's stall report, empty otherwise.
  std::vector<std::string> waits;
  // This rank's host (HOROVOD_HOSTNAME, else its host name) and the Python caller of
  // its last wait that took a while ("file:line"): for the straggler report.
  std::string host;
  std::string wait_site;
};

// One collective to run (or one error to report) for one tensor name.
struct Response {
  OpType type = OpType::kAllreduce;
  std::string name;
  std::string error;  // non-empty: every rank fails this name with RuntimeError
  DataType dtype = DataType::kFloat32;
  ReduceOp op = ReduceOp::kSum;
  int32_t root = 0;
  double prescale = 1.0;
  double postscale = 1.0;
  std::vector<int64_t> shape;      // rank 0's shape
  std::vector<int64_t> rank_rows;  // allgather: dim 0 per rank; alltoall: size x size splits;
                                   // reducescatter: rows per rank (empty: even)
  int64_t group_id = 0;
  bool on_gpu = false;  // CUDA tensors: run by the GPU backend
  // CUDA tensors: which device each rank's tensor is on (DevicesKey()); only responses
  // with equal keys are fused, as one process may hold tensors on several GPUs.
  uint64_t devices = 0;
  std::vector<int64_t> participants;  // as the Request's
  ControlOp control;                  // kControl only
  // A send paired with a receive from any source: the receiver's name for this op.
  std::string alias;
};

// A key of the ranks' CUDA devices for one op: equal for two ops when every rank's
// tensors of both are on one device. `devices`: (rank, device index) per request.
uint64_t DevicesKey(std::vector<std::pair<int32_t, int32_t>> devices);

template <typename Message>
bool IsAnyRecv(const Message& m) {
  return m.type == OpType::kBroadcast && m.participants.size() == 1 && m.root == -1;
}

// The coordinator's straggler measurement (core/straggler.h), sent to every rank:
// per rank, how far behind the first rank its requests arrived.
struct RankLag {
  std::string host;
  double median_s = 0;    // median lateness over the report's samples
  double p95_s = 0;       // 95th percentile
  double last_share = 0;  // share of the samples in which it was last
};
struct StragglerReport {
  int32_t cycles = 0;      // cycles that completed ops, in the window
  int32_t samples = 0;     // ... of which some rank was at least the minimum lag behind
  double step_s = 0;       // median interval between repeats of one op (0: none yet)
  double threshold_s = 0;  // median lateness above which a rank that is mostly last is named
  int32_t straggler = -1;  // the rank named, or -1
  std::string wait_site;   // where the other ranks wait for it (Python caller), if known
  std::vector<RankLag> ranks;
};

struct ResponseList {
  std::vector<uint64_t> ready_bits;    // AND over ranks, invalid ones removed
  std::vector<uint64_t> invalid_bits;  // OR over ranks
  std::vector<Response> responses;     // new (uncached) responses, in execution order
  bool shutdown = false;
  int32_t shutdown_rank = -1;  // with shutdown: the lowest rank that asked
  std::string fatal;           // non-empty: the job stops; every rank fails with this message
  // A rank has joined (hvd.join()): this cycle's allreduces run with its zeros, so the
  // ranks' GPU times are not compared (core/straggler.h).
  bool ranks_joined = false;
  // Autotune: the coordinator's new setting, applied by every rank this cycle.
  bool has_params = false;
  int64_t fusion_threshold_bytes = 0;
  double wake_delay_us = 0;
  bool cache_enabled = true;
  // The straggler report, refreshed about once a second.
  bool has_stragglers = false;
  StragglerReport stragglers;
};

std::string Encode(const RequestList& list);
std::string Encode(const ResponseList& list);
Status Decode(const std::string& bytes, RequestList* list);
Status Decode(const std::string& bytes, ResponseList* list);

}  // namespace hvd
