// wire/codec.h and wire/message.{h,cc}: encode/decode round trips, robustness
// against truncated and corrupted buffers, request signatures.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>

#include "wire/codec.h"
#include "wire/message.h"

namespace hvd {
namespace {

Request FullRequest(int rank, const std::string& name) {
  Request r;
  r.rank = rank;
  r.type = OpType::kAlltoall;
  r.name = name;
  r.dtype = DataType::kBFloat16;
  r.op = ReduceOp::kProduct;
  r.root = 3;
  r.prescale = 0.125;
  r.postscale = -7.5e300;
  r.shape = {4, 0, 7, std::numeric_limits<int64_t>::max(), -1};
  r.splits = {1, 2, 0, std::numeric_limits<int64_t>::min()};
  r.group_id = 0x0123456789abcdefLL;
  r.group_size = 17;
  r.device = 3;
  r.participants = {0, 5};
  return r;
}

Response FullResponse(const std::string& name) {
  Response r;
  r.type = OpType::kReducescatter;
  r.name = name;
  r.error = "something went wrong";
  r.error.push_back('\0');  // errors may hold any byte
  r.error += "tail";
  r.dtype = DataType::kFloat64;
  r.op = ReduceOp::kMax;
  r.root = -2;
  r.prescale = 1e-300;
  r.postscale = std::numeric_limits<double>::infinity();
  r.shape = {1, 2, 3};
  r.rank_rows = {9, 8, 7, 6, 0};
  r.group_id = -5;
  r.on_gpu = true;
  r.devices = 0xfedcba9876543210ULL;
  r.participants = {1, 2};
  r.alias = "c10d.0.p2pany.1.0.3";
  return r;
}

void ExpectEq(const Request& a, const Request& b) {
  EXPECT_EQ(a.rank, b.rank);
  EXPECT_EQ(a.type, b.type);
  EXPECT_EQ(a.name, b.name);
  EXPECT_EQ(a.dtype, b.dtype);
  EXPECT_EQ(a.op, b.op);
  EXPECT_EQ(a.root, b.root);
  EXPECT_EQ(std::memcmp(&a.prescale, &b.prescale, 8), 0);
  EXPECT_EQ(std::memcmp(&a.postscale, &b.postscale, 8), 0);
  EXPECT_EQ(a.shape, b.shape);
  EXPECT_EQ(a.splits, b.splits);
  EXPECT_EQ(a.group_id, b.group_id);
  EXPECT_EQ(a.group_size, b.group_size);
  EXPECT_EQ(a.device, b.device);
  EXPECT_EQ(a.participants, b.participants);
}

void ExpectEq(const Response& a, const Response& b) {
  EXPECT_EQ(a.type, b.type);
  EXPECT_EQ(a.name, b.name);
  EXPECT_EQ(a.error, b.error);
  EXPECT_EQ(a.dtype, b.dtype);
  EXPECT_EQ(a.op, b.op);
  EXPECT_EQ(a.root, b.root);
  EXPECT_EQ(std::memcmp(&a.prescale, &b.prescale, 8), 0);
  EXPECT_EQ(std::memcmp(&a.postscale, &b.postscale, 8), 0);
  EXPECT_EQ(a.shape, b.shape);
  EXPECT_EQ(a.rank_rows, b.rank_rows);
  EXPECT_EQ(a.group_id, b.group_id);
  EXPECT_EQ(a.on_gpu, b.on_gpu);
  EXPECT_EQ(a.devices, b.devices);
  EXPECT_EQ(a.participants, b.participants);
  EXPECT_EQ(a.alias, b.alias);
}

RequestList SampleRequestList() {
  RequestList l;
  l.requests.push_back(FullRequest(2, "grad/layer1.weight"));
  Request empty;  // all defaults, empty name and vectors
  l.requests.push_back(empty);
  l.requests.push_back(FullRequest(0, std::string(1000, 'x')));
  l.ready_bits = {0, ~0ull, 0x8000000000000001ull};
  l.invalid_bits = {42};
  l.shutdown = true;
  l.waits = {"grad/layer1.weight\ttrain.py:42", ""};
  l.host = "node-7";
  l.wait_site = "train.py:57 in main";
  return l;
}

ResponseList SampleResponseList() {
  ResponseList l;
  l.responses.push_back(FullResponse("a"));
  l.responses.push_back(Response());
  l.responses.push_back(FullResponse(std::string(300, '\xff')));
  l.ready_bits = {1, 2, 3};
  l.invalid_bits = {};
  l.shutdown = true;
  l.shutdown_rank = 5;
  l.ranks_joined = true;
  l.has_stragglers = true;
  l.stragglers.cycles = 64;
  l.stragglers.samples = 40;
  l.stragglers.step_s = 0.25;
  l.stragglers.threshold_s = 0.025;
  l.stragglers.straggler = 1;
  l.stragglers.wait_site = "train.py:57 in main";
  l.stragglers.ranks = {RankLag{"a", 0, 0.001, 0}, RankLag{"b", 0.04, 0.05, 0.9}};
  return l;
}

TEST(Codec, WriterReaderRoundTrip) {
  Writer w;
  w.U8(0xab);
  w.U32(0xdeadbeef);
  w.I32(-12345);
  w.I64(std::numeric_limits<int64_t>::min());
  w.U64(~0ull);
  w.F64(-0.0);
  w.Str("");
  w.Str(std::string("a\0b", 3));
  w.I64s({});
  w.I64s({-1, 0, 1});
  w.U64s({7});
  Reader rd(w.str());
  EXPECT_EQ(rd.U8(), 0xab);
  EXPECT_EQ(rd.U32(), 0xdeadbeefu);
  EXPECT_EQ(rd.I32(), -12345);
  EXPECT_EQ(rd.I64(), std::numeric_limits<int64_t>::min());
  EXPECT_EQ(rd.U64(), ~0ull);
  double z = rd.F64();
  EXPECT_TRUE(z == 0.0 && std::signbit(z));
  EXPECT_EQ(rd.Str(), "");
  EXPECT_EQ(rd.Str(), std::string("a\0b", 3));
  EXPECT_TRUE(rd.I64s().empty());
  EXPECT_EQ(rd.I64s(), (std::vector<int64_t>{-1, 0, 1}));
  EXPECT_EQ(rd.U64s(), (std::vector<uint64_t>{7}));
  EXPECT_TRUE(rd.ok());
  EXPECT_TRUE(rd.done());
  // Reading past the end fails softly and stays failed.
  EXPECT_EQ(rd.U32(), 0u);
  EXPECT_FALSE(rd.ok());
  EXPECT_EQ(rd.Str(), "");
  EXPECT_FALSE(rd.ok());
}

TEST(Codec, ReaderRejectsHugeLengths) {
  Writer w;
  w.U32(0xffffffffu);  // string length far beyond the buffer
  w.Str("abc");
  Reader rd(w.str());
  EXPECT_EQ(rd.Str(), "");
  EXPECT_FALSE(rd.ok());

  Writer v;
  v.U32(0x20000000u);  // 2^29 int64s = 4 GiB: must not allocate
  v.I64(1);
  Reader rv(v.str());
  EXPECT_TRUE(rv.I64s().empty());
  EXPECT_FALSE(rv.ok());
}

TEST(Message, RequestListRoundTrip) {
  RequestList in = SampleRequestList();
  std::string bytes = Encode(in);
  RequestList out;
  out.requests.push_back(FullRequest(9, "stale"));  // Decode replaces, not appends
  ASSERT_TRUE(Decode(bytes, &out).ok());
  EXPECT_EQ(out.shutdown, in.shutdown);
  EXPECT_EQ(out.ready_bits, in.ready_bits);
  EXPECT_EQ(out.invalid_bits, in.invalid_bits);
  EXPECT_EQ(out.waits, in.waits);
  EXPECT_EQ(out.host, in.host);
  EXPECT_EQ(out.wait_site, in.wait_site);
  ASSERT_EQ(out.requests.size(), in.requests.size());
  for (size_t i = 0; i < in.requests.size(); ++i) ExpectEq(in.requests[i], out.requests[i]);
  EXPECT_EQ(Encode(out), bytes);

  RequestList empty_in, empty_out;
  ASSERT_TRUE(Decode(Encode(empty_in), &empty_out).ok());
  EXPECT_TRUE(empty_out.requests.empty());
  EXPECT_FALSE(empty_out.shutdown);
}

TEST(Message, ResponseListRoundTrip) {
  ResponseList in = SampleResponseList();
  std::string bytes = Encode(in);
  ResponseList out;
  ASSERT_TRUE(Decode(bytes, &out).ok());
  EXPECT_EQ(out.shutdown, in.shutdown);
  EXPECT_EQ(out.shutdown_rank, in.shutdown_rank);
  EXPECT_TRUE(out.ranks_joined);
  EXPECT_EQ(out.ready_bits, in.ready_bits);
  EXPECT_EQ(out.invalid_bits, in.invalid_bits);
  ASSERT_EQ(out.responses.size(), in.responses.size());
  for (size_t i = 0; i < in.responses.size(); ++i) ExpectEq(in.responses[i], out.responses[i]);
  ASSERT_TRUE(out.has_stragglers);
  EXPECT_EQ(out.stragglers.straggler, 1);
  EXPECT_EQ(out.stragglers.wait_site, in.stragglers.wait_site);
  ASSERT_EQ(out.stragglers.ranks.size(), 2u);
  EXPECT_EQ(out.stragglers.ranks[1].host, "b");
  EXPECT_EQ(out.stragglers.ranks[1].last_share, 0.9);
  EXPECT_EQ(Encode(out), bytes);
}

TEST(Message, AStragglerReportNamingNoRankOfItsOwnFails) {
  ResponseList in = SampleResponseList();
  in.stragglers.straggler = 7;  // two ranks listed
  ResponseList out;
  EXPECT_FALSE(Decode(Encode(in), &out).ok());
  in.stragglers.straggler = -1;
  EXPECT_TRUE(Decode(Encode(in), &out).ok());
}

TEST(Message, EveryEnumValueRoundTrips) {
  for (int t = 0; t <= static_cast<int>(OpType::kControl); ++t) {
    for (int d = 0; d <= static_cast<int>(DataType::kBool); ++d) {
      for (int o = 0; o <= static_cast<int>(ReduceOp::kProduct); ++o) {
        RequestList l;
        Request r;
        r.type = static_cast<OpType>(t);
        if (r.type == OpType::kControl) r.control.kind = ControlKind::kBarrier;
        r.dtype = static_cast<DataType>(d);
        r.op = static_cast<ReduceOp>(o);
        l.requests.push_back(r);
        RequestList out;
        ASSERT_TRUE(Decode(Encode(l), &out).ok());
        ASSERT_EQ(out.requests.size(), 1u);
        EXPECT_EQ(out.requests[0].type, r.type);
        EXPECT_EQ(out.requests[0].dtype, r.dtype);
        EXPECT_EQ(out.requests[0].op, r.op);
      }
    }
  }
}

TEST(Message, TruncatedBuffersFail) {
  std::string req = Encode(SampleRequestList());
  std::string resp = Encode(SampleResponseList());
  for (size_t n = 0; n < req.size(); ++n) {
    RequestList l;
    EXPECT_FALSE(Decode(req.substr(0, n), &l).ok()) << "request list truncated to " << n;
  }
  for (size_t n = 0; n < resp.size(); ++n) {
    ResponseList l;
    EXPECT_FALSE(Decode(resp.substr(0, n), &l).ok()) << "response list truncated to " << n;
  }
}

TEST(Message, TrailingBytesFail) {
  RequestList rl;
  ResponseList sl;
  Status a = Decode(Encode(SampleRequestList()) + "x", &rl);
  Status b = Decode(Encode(SampleResponseList()) + std::string(1, '\0'), &sl);
  EXPECT_FALSE(a.ok());
  EXPECT_FALSE(b.ok());
  EXPECT_EQ(a.code(), StatusCode::kAborted);
  EXPECT_NE(a.message().find("corrupt"), std::string::npos) << a.message();
}

TEST(Message, WrongMagicFails) {
  RequestList rl;
  ResponseList sl;
  // A response list is not a request list and vice versa.
  EXPECT_FALSE(Decode(Encode(SampleResponseList()), &rl).ok());
  EXPECT_FALSE(Decode(Encode(SampleRequestList()), &sl).ok());
  std::string bytes = Encode(SampleRequestList());
  bytes[0] ^= 1;
  Status st = Decode(bytes, &rl);
  EXPECT_FALSE(st.ok());
  EXPECT_NE(st.message().find("magic"), std::string::npos) << st.message();
}

TEST(Message, CorruptLengthFieldsFail) {
  // Layout: magic u32, cache capacity u32, shutdown u8, ready u32+8n, invalid u32+8n,
  // count u32, requests...
  RequestList in;
  Request r;
  r.name = "abc";
  r.shape = {2, 3};
  in.requests.push_back(r);
  std::string good = Encode(in);
  const size_t count_off = 4 + 4 + 1 + 4 + 4;
  const size_t name_len_off = count_off + 4 + 4 + 1;
  auto put_u32 = [](std::string* s, size_t off, uint32_t v) { std::memcpy(&(*s)[off], &v, 4); };

  for (uint32_t bad : {0u, 2u, 1000u, 0xffffffffu}) {
    std::string b = good;
    put_u32(&b, count_off, bad);
    RequestList out;
    EXPECT_FALSE(Decode(b, &out).ok()) << "request count " << bad;
  }
  for (uint32_t bad : {0u, 4u, 0x7fffffffu, 0xffffffffu}) {
    std::string b = good;
    put_u32(&b, name_len_off, bad);
    RequestList out;
    EXPECT_FALSE(Decode(b, &out).ok()) << "name length " << bad;
  }
  for (uint32_t bad : {1u, 0x10000000u, 0xffffffffu}) {  // ready_bits count
    std::string b = good;
    put_u32(&b, 9, bad);  // after magic and cache capacity, shutdown
    RequestList out;
    EXPECT_FALSE(Decode(b, &out).ok()) << "ready_bits count " << bad;
  }
}

// Random corruption must never crash or read out of bounds (run under
// SANITIZE=address to check the latter); whatever decodes must re-encode.
TEST(Message, RandomCorruptionNeverCrashes) {
  std::mt19937 rng(1234);
  const std::string req = Encode(SampleRequestList());
  const std::string resp = Encode(SampleResponseList());
  int rejected = 0;
  for (int iter = 0; iter < 20000; ++iter) {
    const std::string& base = (iter % 2) ? req : resp;
    std::string b = base;
    int flips = 1 + rng() % 4;
    for (int f = 0; f < flips; ++f) {
      size_t pos = rng() % b.size();
      b[pos] = static_cast<char>(rng());
    }
    if (rng() % 4 == 0) b.resize(rng() % b.size());
    if (iter % 2) {
      RequestList l;
      Status st = Decode(b, &l);
      if (!st.ok()) ++rejected;
    } else {
      ResponseList l;
      Status st = Decode(b, &l);
      if (!st.ok()) ++rejected;
    }
  }
  EXPECT_GT(rejected, 0);
}

// Out-of-range enum bytes (version skew, corruption) are refused: such a list would
// otherwise hit HVD_CHECK in DataTypeSize() (fusion/transport) and abort the process.
TEST(Message, DecodeRejectsOutOfRangeEnums) {
  ResponseList l;
  Response r;
  r.name = "x";
  l.responses.push_back(r);
  std::string good = Encode(l);
  // magic 4, shutdown 1, fatal 4+0, ranks_joined 1, ready 4, invalid 4, count 4, then
  // type u8.
  const size_t type_off = 22;
  const size_t dtype_off = type_off + 1 + 4 + 1 + 4 + 0;  // type, name(len+1), error(len+0)
  std::string bad_type = good, bad_dtype = good;
  bad_type[type_off] = static_cast<char>(200);
  bad_dtype[dtype_off] = static_cast<char>(200);
  ResponseList out;
  ASSERT_TRUE(Decode(good, &out).ok());
  EXPECT_EQ(out.responses[0].dtype, DataType::kFloat32);
  EXPECT_FALSE(Decode(bad_type, &out).ok()) << "OpType 200 accepted";
  EXPECT_FALSE(Decode(bad_dtype, &out).ok()) << "DataType 200 accepted";
  // The first value past each table (common/types.h) is refused, the last row accepted.
  const size_t op_off = dtype_off + 1;
  std::string edge = good;
  edge[dtype_off] = static_cast<char>(kNumDataTypes - 1);
  edge[op_off] = static_cast<char>(kNumReduceOps - 1);
  EXPECT_TRUE(Decode(edge, &out).ok());
  edge[dtype_off] = static_cast<char>(kNumDataTypes);
  EXPECT_FALSE(Decode(edge, &out).ok()) << "DataType past the table accepted";
  edge[dtype_off] = static_cast<char>(kNumDataTypes - 1);
  edge[op_off] = static_cast<char>(kNumReduceOps);
  EXPECT_FALSE(Decode(edge, &out).ok()) << "ReduceOp past the table accepted";
}

TEST(Message, SignatureIgnoresRankOnly) {
  Request a = FullRequest(0, "t");
  Request b = FullRequest(5, "t");
  EXPECT_EQ(a.Signature(), b.Signature());

  auto differs = [&](const char* what, auto mutate) {
    Request c = FullRequest(0, "t");
    mutate(c);
    EXPECT_NE(c.Signature(), a.Signature()) << what;
  };
  differs("shape", [](Request& r) { r.shape[0] = 5; });
  differs("shape rank", [](Request& r) { r.shape.push_back(1); });
  differs("dtype", [](Request& r) { r.dtype = DataType::kFloat16; });
  differs("op", [](Request& r) { r.op = ReduceOp::kSum; });
  differs("type", [](Request& r) { r.type = OpType::kAllgather; });
  differs("name", [](Request& r) { r.name = "u"; });
  differs("root", [](Request& r) { r.root = 0; });
  differs("prescale", [](Request& r) { r.prescale = 0.25; });
  differs("postscale", [](Request& r) { r.postscale = 1.0; });
  differs("splits", [](Request& r) { r.splits[1] = 3; });
  differs("group", [](Request& r) { r.group_id = 1; });
  differs("group size", [](Request& r) { r.group_size = 2; });
  differs("device", [](Request& r) { r.device = -1; });
  // Signature() must not modify the request.
  EXPECT_EQ(b.rank, 5);
}

TEST(Message, NumElements) {
  Request r;
  EXPECT_EQ(r.NumElements(), 1);  // scalar
  r.shape = {3, 4, 5};
  EXPECT_EQ(r.NumElements(), 60);
  r.shape = {3, 0, 5};
  EXPECT_EQ(r.NumElements(), 0);
}

TEST(Message, OpTypeNames) {
  EXPECT_STREQ(OpTypeName(OpType::kAllreduce), "allreduce");
  EXPECT_STREQ(OpTypeName(OpType::kAllgather), "allgather");
  EXPECT_STREQ(OpTypeName(OpType::kBroadcast), "broadcast");
  EXPECT_STREQ(OpTypeName(OpType::kAlltoall), "alltoall");
  EXPECT_STREQ(OpTypeName(OpType::kReducescatter), "reducescatter");
  EXPECT_STREQ(OpTypeName(OpType::kControl), "control");
  EXPECT_STREQ(ControlKindName(ControlKind::kBarrier), "barrier");
  EXPECT_STREQ(ControlKindName(ControlKind::kJoin), "join");
  EXPECT_STREQ(ControlKindName(ControlKind::kAddProcessSet), "add_process_set");
  EXPECT_STREQ(ControlKindName(ControlKind::kRemoveProcessSet), "remove_process_set");
  EXPECT_STREQ(ControlKindName(ControlKind::kAddProcessSetOfMembers), "add_process_set_of_members");
  Request r;
  r.type = OpType::kControl;
  r.control.kind = ControlKind::kJoin;
  EXPECT_STREQ(OpName(r), "join");
  r.type = OpType::kAlltoall;
  EXPECT_STREQ(OpName(r), "alltoall");
}

// A control op's fields travel only with kControl, and kControl only with a kind: a
// request or response that breaks either rule is refused as corrupt.
TEST(Message, ControlFieldsRoundTripAndMustMatchTheType) {
  RequestList l;
  Request r;
  r.type = OpType::kControl;
  r.control.kind = ControlKind::kAddProcessSet;
  r.control.ranks = {0, 2, 5};
  l.requests.push_back(r);
  RequestList out;
  ASSERT_TRUE(Decode(Encode(l), &out).ok());
  EXPECT_TRUE(out.requests[0].control == r.control);

  l.requests[0].control.kind = ControlKind::kNone;  // kControl without a kind
  EXPECT_FALSE(Decode(Encode(l), &out).ok());
  l.requests[0].type = OpType::kAllreduce;  // a data op with a kind
  l.requests[0].control.kind = ControlKind::kBarrier;
  EXPECT_FALSE(Decode(Encode(l), &out).ok());

  ResponseList rl;
  Response resp;
  resp.type = OpType::kControl;
  resp.control.kind = ControlKind::kJoin;
  resp.control.last_joined = 2;
  rl.responses.push_back(resp);
  ResponseList rout;
  ASSERT_TRUE(Decode(Encode(rl), &rout).ok());
  EXPECT_EQ(rout.responses[0].control.last_joined, 2);
  rl.responses[0].control.kind = static_cast<ControlKind>(9);  // out of range
  EXPECT_FALSE(Decode(Encode(rl), &rout).ok());
}

}  // namespace
}  // namespace hvd
