// core/fusion: PlanFusion batching rules.
#include <gtest/gtest.h>

#include "core/fusion.h"

namespace hvd {
namespace {

using Batches = std::vector<std::vector<size_t>>;

Response AR(int64_t elems, DataType dtype = DataType::kFloat32, ReduceOp op = ReduceOp::kSum) {
  Response r;
  r.type = OpType::kAllreduce;
  r.name = "t";
  r.dtype = dtype;
  r.op = op;
  r.shape = {elems};
  return r;
}

TEST(Fusion, ResponseBytes) {
  Response r = AR(10, DataType::kFloat64);
  EXPECT_EQ(ResponseBytes(r), 80);
  r.shape = {2, 3, 4};
  r.dtype = DataType::kFloat16;
  EXPECT_EQ(ResponseBytes(r), 48);
  r.shape = {};
  EXPECT_EQ(ResponseBytes(r), 2);  // scalar
  r.shape = {5, 0};
  EXPECT_EQ(ResponseBytes(r), 0);
}

Request GpuAR(int64_t elems, int32_t device = 0) {
  Request r;
  r.type = OpType::kAllreduce;
  r.shape = {elems};
  r.device = device;
  return r;
}

TEST(Fusion, OnlySmallGpuAllreducesWaitForBusyGpu) {
  EXPECT_FALSE(WorthHolding({}, 1024));
  EXPECT_TRUE(WorthHolding({GpuAR(100), GpuAR(100)}, 1024));   // 800 bytes
  EXPECT_FALSE(WorthHolding({GpuAR(128), GpuAR(128)}, 1024));  // a buffer's worth
  EXPECT_FALSE(WorthHolding({GpuAR(1), GpuAR(1, -1)}, 1024));  // a CPU tensor
  Request bcast = GpuAR(1);
  bcast.type = OpType::kBroadcast;
  EXPECT_FALSE(WorthHolding({GpuAR(1), bcast}, 1024));
  EXPECT_FALSE(WorthHolding({GpuAR(1)}, 0));  // fusion off: nothing to wait for
}

TEST(Fusion, EmptyList) { EXPECT_TRUE(PlanFusion({}, 1024).empty()); }

TEST(Fusion, ConsecutiveAllreducesFuseUpToThreshold) {
  // 4 bytes per element: 100 elems = 400 bytes.
  std::vector<Response> rs = {AR(100), AR(100), AR(100), AR(100), AR(100)};
  EXPECT_EQ(PlanFusion(rs, 1200), (Batches{{0, 1, 2}, {3, 4}}));
  EXPECT_EQ(PlanFusion(rs, 1199), (Batches{{0, 1}, {2, 3}, {4}}));
  EXPECT_EQ(PlanFusion(rs, 1 << 20), (Batches{{0, 1, 2, 3, 4}}));
  EXPECT_EQ(PlanFusion(rs, 400), (Batches{{0}, {1}, {2}, {3}, {4}}));
  EXPECT_EQ(PlanFusion(rs, 0), (Batches{{0}, {1}, {2}, {3}, {4}}));
}

TEST(Fusion, DtypeOpOrScaleChangeBreaksBatch) {
  std::vector<Response> rs = {AR(1),
                              AR(1),
                              AR(1, DataType::kFloat16),
                              AR(1, DataType::kFloat16),
                              AR(1, DataType::kFloat16, ReduceOp::kMax),
                              AR(1, DataType::kFloat16)};
  EXPECT_EQ(PlanFusion(rs, 1 << 20), (Batches{{0, 1}, {2, 3}, {4}, {5}}));

  std::vector<Response> scaled = {AR(1), AR(1), AR(1), AR(1), AR(1)};
  scaled[1].prescale = 0.5;
  scaled[2].prescale = 0.5;
  scaled[3].postscale = 0.5;
  scaled[3].prescale = 0.5;
  EXPECT_EQ(PlanFusion(scaled, 1 << 20), (Batches{{0}, {1, 2}, {3}, {4}}));
}

TEST(Fusion, DeviceChangeBreaksBatch) {
  std::vector<Response> rs = {AR(1), AR(1), AR(1), AR(1)};
  rs[1].on_gpu = true;
  rs[2].on_gpu = true;
  EXPECT_EQ(PlanFusion(rs, 1 << 20), (Batches{{0}, {1, 2}, {3}}));
}

// One process with tensors on two GPUs (a model split across them): an op of each
// device goes out on its own (upstream's test_model_parallelism).
TEST(Fusion, GpuTensorsOfAnotherDeviceLayoutBreakBatch) {
  std::vector<Response> rs = {AR(1), AR(1), AR(1), AR(1)};
  for (auto& r : rs) r.on_gpu = true;
  rs[0].devices = rs[1].devices = DevicesKey({{0, 0}, {1, 2}});
  rs[2].devices = rs[3].devices = DevicesKey({{0, 1}, {1, 3}});
  EXPECT_EQ(PlanFusion(rs, 1 << 20), (Batches{{0, 1}, {2, 3}}));
}

TEST(Fusion, NonAllreduceBreaksBatch) {
  std::vector<Response> rs = {AR(1), AR(1), AR(1), AR(1), AR(1), AR(1)};
  rs[2].type = OpType::kBroadcast;
  rs[4].type = OpType::kAllgather;
  rs[5].type = OpType::kAllgather;  // two allgathers never fuse
  EXPECT_EQ(PlanFusion(rs, 1 << 20), (Batches{{0, 1}, {2}, {3}, {4}, {5}}));
  for (OpType t : {OpType::kBroadcast, OpType::kAlltoall, OpType::kControl, OpType::kAllgather}) {
    std::vector<Response> same(3, AR(1));
    for (auto& r : same) r.type = t;
    EXPECT_EQ(PlanFusion(same, 1 << 20), (Batches{{0}, {1}, {2}})) << OpTypeName(t);
  }
}

TEST(Fusion, ReducescattersFuseWithEachOtherOnly) {
  std::vector<Response> rs = {AR(1), AR(1), AR(1), AR(1), AR(1), AR(1)};
  rs[2].type = rs[3].type = rs[5].type = OpType::kReducescatter;
  rs[5].dtype = DataType::kFloat64;
  EXPECT_EQ(PlanFusion(rs, 1 << 20), (Batches{{0, 1}, {2, 3}, {4}, {5}}));
  Request gpu_rs = GpuAR(10);
  gpu_rs.type = OpType::kReducescatter;
  EXPECT_TRUE(WorthHolding({GpuAR(10), gpu_rs}, 1024));
}

Response RS(std::vector<int64_t> shape, std::vector<int64_t> splits = {}) {
  Response r = AR(1);
  r.type = OpType::kReducescatter;
  r.shape = std::move(shape);
  r.rank_rows = std::move(splits);
  return r;
}

TEST(Fusion, ReducescatterRowsAreTheSplitsOrEven) {
  EXPECT_EQ(ReducescatterRows(RS({7, 2}), 3), (std::vector<int64_t>{3, 2, 2}));
  EXPECT_EQ(ReducescatterRows(RS({2}), 3), (std::vector<int64_t>{1, 1, 0}));
  EXPECT_EQ(ReducescatterRows(RS({5}, {0, 5, 0}), 3), (std::vector<int64_t>{0, 5, 0}));
}

TEST(Fusion, FusedReducescatterGroupsEachRanksParts) {
  // Input 0: 4 rows of 2 (even: 2 rows per rank); input 1: 3 elements, all to rank 1;
  // input 2: 5 rows split 1 / 4.
  const ScatterLayout l = PlanReducescatter({RS({4, 2}), RS({3}, {0, 3}), RS({5}, {1, 4})}, 2);
  EXPECT_EQ(l.elems, (std::vector<std::vector<int64_t>>{{4, 4}, {0, 3}, {1, 4}}));
  EXPECT_EQ(l.src_offset, (std::vector<std::vector<int64_t>>{{0, 4}, {0, 0}, {0, 1}}));
  // rank 0's parts first (input 0's 4, input 2's 1), then rank 1's (4, 3, 4)
  EXPECT_EQ(l.dst_offset, (std::vector<std::vector<int64_t>>{{0, 5}, {4, 9}, {4, 12}}));
  EXPECT_EQ(l.counts, (std::vector<size_t>{5, 11}));
  EXPECT_EQ(l.total, 16);
  const ScatterLayout empty = PlanReducescatter({RS({0, 3})}, 2);
  EXPECT_EQ(empty.total, 0);
  EXPECT_EQ(empty.counts, (std::vector<size_t>{0, 0}));
}

TEST(Fusion, OversizeTensorAlone) {
  std::vector<Response> rs = {AR(10), AR(1000), AR(10), AR(10)};
  // threshold 100 bytes: the 4000-byte tensor goes alone and does not absorb neighbours.
  EXPECT_EQ(PlanFusion(rs, 100), (Batches{{0}, {1}, {2, 3}}));
  std::vector<Response> first_big = {AR(1000), AR(1), AR(1)};
  EXPECT_EQ(PlanFusion(first_big, 100), (Batches{{0}, {1, 2}}));
}

TEST(Fusion, ErrorResponsesAlone) {
  std::vector<Response> rs = {AR(1), AR(1), AR(1), AR(1), AR(1)};
  rs[1].error = "mismatch";
  rs[2].error = "mismatch";
  EXPECT_EQ(PlanFusion(rs, 1 << 20), (Batches{{0}, {1}, {2}, {3, 4}}));
  rs[0].error = "x";
  EXPECT_EQ(PlanFusion(rs, 1 << 20), (Batches{{0}, {1}, {2}, {3, 4}}));
}

TEST(Fusion, BatchesCoverEveryIndexInOrder) {
  std::vector<Response> rs;
  for (int i = 0; i < 50; ++i) {
    Response r = AR(1 + i % 7, i % 5 == 0 ? DataType::kFloat64 : DataType::kFloat32);
    if (i % 11 == 0) r.type = OpType::kBroadcast;
    rs.push_back(r);
  }
  Batches b = PlanFusion(rs, 64);
  size_t next = 0;
  for (const auto& batch : b) {
    ASSERT_FALSE(batch.empty());
    int64_t bytes = 0;
    for (size_t i : batch) {
      EXPECT_EQ(i, next++);
      bytes += ResponseBytes(rs[i]);
    }
    if (batch.size() > 1) {
      EXPECT_LE(bytes, 64);
    }
  }
  EXPECT_EQ(next, rs.size());
}

}  // namespace
}  // namespace hvd
