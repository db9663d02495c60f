#include "wire/message.h"

#include <algorithm>

#include "common/fnv.h"
#include "wire/codec.h"

namespace hvd {
namespace {

// The magics change with the layout (2: participants; 3: a response's alias; 4: its
// devices), so that ranks of different builds fail on the first message instead of
// decoding garbage.
constexpr uint32_t kRequestMagic = 0x48565132;   // "HVQ2"
constexpr uint32_t kResponseMagic = 0x48565335;  // "HVS5"

// A control op's fields follow its kind; a data op has only the kind (kNone).
void Put(Writer& w, const ControlOp& c) {
  w.U8(static_cast<uint8_t>(c.kind));
  if (c.kind == ControlKind::kNone) return;
  w.I64s(c.ranks);
  w.I32(c.process_set);
  w.I32(c.last_joined);
}

ControlOp GetControl(Reader& rd) {
  ControlOp c;
  c.kind = static_cast<ControlKind>(rd.U8());
  if (c.kind == ControlKind::kNone) return c;
  c.ranks = rd.I64s();
  c.process_set = rd.I32();
  c.last_joined = rd.I32();
  return c;
}

void Put(Writer& w, const Request& r) {
  w.I32(r.rank);
  w.U8(static_cast<uint8_t>(r.type));
  w.Str(r.name);
  w.U8(static_cast<uint8_t>(r.dtype));
  w.U8(static_cast<uint8_t>(r.op));
  w.I32(r.root);
  w.F64(r.prescale);
  w.F64(r.postscale);
  w.I64s(r.shape);
  w.I64s(r.splits);
  w.I64(r.group_id);
  w.I32(r.group_size);
  w.I32(r.device);
  w.I64s(r.participants);
  Put(w, r.control);
}

Request GetRequest(Reader& rd) {
  Request r;
  r.rank = rd.I32();
  r.type = static_cast<OpType>(rd.U8());
  r.name = rd.Str();
  r.dtype = static_cast<DataType>(rd.U8());
  r.op = static_cast<ReduceOp>(rd.U8());
  r.root = rd.I32();
  r.prescale = rd.F64();
  r.postscale = rd.F64();
  r.shape = rd.I64s();
  r.splits = rd.I64s();
  r.group_id = rd.I64();
  r.group_size = rd.I32();
  r.device = rd.I32();
  r.participants = rd.I64s();
  r.control = GetControl(rd);
  return r;
}

void Put(Writer& w, const Response& r) {
  w.U8(static_cast<uint8_t>(r.type));
  w.Str(r.name);
  w.Str(r.error);
  w.U8(static_cast<uint8_t>(r.dtype));
  w.U8(static_cast<uint8_t>(r.op));
  w.I32(r.root);
  w.F64(r.prescale);
  w.F64(r.postscale);
  w.I64s(r.shape);
  w.I64s(r.rank_rows);
  w.I64(r.group_id);
  w.Bool(r.on_gpu);
  w.U64(r.devices);
  w.I64s(r.participants);
  Put(w, r.control);
  w.Str(r.alias);
}

Response GetResponse(Reader& rd) {
  Response r;
  r.type = static_cast<OpType>(rd.U8());
  r.name = rd.Str();
  r.error = rd.Str();
  r.dtype = static_cast<DataType>(rd.U8());
  r.op = static_cast<ReduceOp>(rd.U8());
  r.root = rd.I32();
  r.prescale = rd.F64();
  r.postscale = rd.F64();
  r.shape = rd.I64s();
  r.rank_rows = rd.I64s();
  r.group_id = rd.I64();
  r.on_gpu = rd.Bool();
  r.devices = rd.U64();
  r.participants = rd.I64s();
  r.control = GetControl(rd);
  r.alias = rd.Str();
  return r;
}

// In range, and a control kind exactly on kControl ops.
template <typename Message>
bool ValidEnums(const Message& m) {
  const bool control = m.type == OpType::kControl;
  return static_cast<uint8_t>(m.type) <= static_cast<uint8_t>(OpType::kControl) &&
         static_cast<int>(m.dtype) < kNumDataTypes && static_cast<int>(m.op) < kNumReduceOps &&
         static_cast<uint8_t>(m.control.kind) <=
             static_cast<uint8_t>(ControlKind::kAddProcessSetOfMembers) &&
         control == (m.control.kind != ControlKind::kNone);
}

Status Finish(const Reader& rd, const char* what) {
  if (!rd.ok() || !rd.done()) {
    return Status::Aborted(std::string("corrupt ") + what + " received from a peer");
  }
  return Status::Ok();
}

}  // namespace

const char* OpTypeName(OpType t) {
  switch (t) {
    case OpType::kAllreduce:
      return "allreduce";
    case OpType::kAllgather:
      return "allgather";
    case OpType::kBroadcast:
      return "broadcast";
    case OpType::kAlltoall:
      return "alltoall";
    case OpType::kReducescatter:
      return "reducescatter";
    case OpType::kControl:
      return "control";
  }
  return "unknown";
}

const char* ControlKindName(ControlKind k) {
  switch (k) {
    case ControlKind::kNone:
      return "none";
    case ControlKind::kBarrier:
      return "barrier";
    case ControlKind::kJoin:
      return "join";
    case ControlKind::kAddProcessSet:
      return "add_process_set";
    case ControlKind::kRemoveProcessSet:
      return "remove_process_set";
    case ControlKind::kAddProcessSetOfMembers:
      return "add_process_set_of_members";
  }
  return "unknown";
}

std::string Request::Signature() const {
  Writer w;
  Request copy = *this;
  copy.rank = 0;
  Put(w, copy);
  return std::move(w.str());
}

uint64_t DevicesKey(std::vector<std::pair<int32_t, int32_t>> devices) {
  std::sort(devices.begin(), devices.end());
  Fnv1a h;  // over (rank, device) in rank order
  for (const auto& [rank, device] : devices) h.Int(rank).Int(device);
  return h.value();
}

int64_t Request::NumElements() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

std::string Encode(const RequestList& list) {
  Writer w;
  w.U32(kRequestMagic);
  w.U32(list.cache_capacity);
  w.Bool(list.shutdown);
  w.U64s(list.ready_bits);
  w.U64s(list.invalid_bits);
  w.U32(static_cast<uint32_t>(list.requests.size()));
  for (const auto& r : list.requests) Put(w, r);
  w.U32(static_cast<uint32_t>(list.waits.size()));
  for (const auto& s : list.waits) w.Str(s);
  w.Str(list.host);
  w.Str(list.wait_site);
  return std::move(w.str());
}

std::string Encode(const ResponseList& list) {
  Writer w;
  w.U32(kResponseMagic);
  w.Bool(list.shutdown);
  if (list.shutdown) w.I32(list.shutdown_rank);
  w.Str(list.fatal);
  w.Bool(list.ranks_joined);
  w.U64s(list.ready_bits);
  w.U64s(list.invalid_bits);
  w.U32(static_cast<uint32_t>(list.responses.size()));
  for (const auto& r : list.responses) Put(w, r);
  w.Bool(list.has_params);
  if (list.has_params) {
    w.I64(list.fusion_threshold_bytes);
    w.F64(list.wake_delay_us);
    w.Bool(list.cache_enabled);
  }
  w.Bool(list.has_stragglers);
  if (list.has_stragglers) {
    const StragglerReport& s = list.stragglers;
    w.I32(s.cycles);
    w.I32(s.samples);
    w.F64(s.step_s);
    w.F64(s.threshold_s);
    w.I32(s.straggler);
    w.Str(s.wait_site);
    w.U32(static_cast<uint32_t>(s.ranks.size()));
    for (const RankLag& r : s.ranks) {
      w.Str(r.host);
      w.F64(r.median_s);
      w.F64(r.p95_s);
      w.F64(r.last_share);
    }
  }
  return std::move(w.str());
}

Status Decode(const std::string& bytes, RequestList* list) {
  Reader rd(bytes);
  if (rd.U32() != kRequestMagic)
    return Status::Aborted("bad request-list magic from a peer (a different build?)");
  list->cache_capacity = rd.U32();
  list->shutdown = rd.Bool();
  list->ready_bits = rd.U64s();
  list->invalid_bits = rd.U64s();
  uint32_t n = rd.U32();
  list->requests.clear();
  for (uint32_t i = 0; i < n && rd.ok(); ++i) {
    list->requests.push_back(GetRequest(rd));
    const Request& r = list->requests.back();
    if (!ValidEnums(r)) return Status::Aborted("corrupt request from a peer");
  }
  const uint32_t waits = rd.U32();
  list->waits.clear();
  for (uint32_t i = 0; i < waits && rd.ok(); ++i) list->waits.push_back(rd.Str());
  list->host = rd.Str();
  list->wait_site = rd.Str();
  return Finish(rd, "request list");
}

Status Decode(const std::string& bytes, ResponseList* list) {
  Reader rd(bytes);
  if (rd.U32() != kResponseMagic)
    return Status::Aborted("bad response-list magic from a peer (a different build?)");
  list->shutdown = rd.Bool();
  list->shutdown_rank = list->shutdown ? rd.I32() : -1;
  list->fatal = rd.Str();
  list->ranks_joined = rd.Bool();
  list->ready_bits = rd.U64s();
  list->invalid_bits = rd.U64s();
  uint32_t n = rd.U32();
  list->responses.clear();
  for (uint32_t i = 0; i < n && rd.ok(); ++i) {
    list->responses.push_back(GetResponse(rd));
    const Response& r = list->responses.back();
    if (!ValidEnums(r)) return Status::Aborted("corrupt response from a peer");
  }
  list->has_params = rd.Bool();
  if (list->has_params) {
    list->fusion_threshold_bytes = rd.I64();
    list->wake_delay_us = rd.F64();
    list->cache_enabled = rd.Bool();
  }
  list->has_stragglers = rd.Bool();
  list->stragglers = StragglerReport();
  if (list->has_stragglers) {
    StragglerReport& s = list->stragglers;
    s.cycles = rd.I32();
    s.samples = rd.I32();
    s.step_s = rd.F64();
    s.threshold_s = rd.F64();
    s.straggler = rd.I32();
    s.wait_site = rd.Str();
    const uint32_t n = rd.U32();
    for (uint32_t i = 0; i < n && rd.ok(); ++i) {
      RankLag r;
      r.host = rd.Str();
      r.median_s = rd.F64();
      r.p95_s = rd.F64();
      r.last_share = rd.F64();
      s.ranks.push_back(std::move(r));
    }
    if (s.straggler < -1 || s.straggler >= static_cast<int32_t>(s.ranks.size())) {
      return Status::Aborted("corrupt straggler report from a peer");
    }
  }
  return Finish(rd, "response list");
}

}  // namespace hvd
