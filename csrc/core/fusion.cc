#include "core/fusion.h"

namespace hvd {

int64_t ResponseBytes(const Response& r) {
  int64_t n = 1;
  for (int64_t d : r.shape) n *= d;
  return n * static_cast<int64_t>(DataTypeSize(r.dtype));
}

bool WorthHolding(const std::vector<Request>& fresh, int64_t threshold_bytes) {
  int64_t bytes = 0;
  for (const Request& r : fresh) {
    if (r.type != OpType::kAllreduce || r.device < 0) return false;
    bytes += r.NumElements() * static_cast<int64_t>(DataTypeSize(r.dtype));
  }
  return !fresh.empty() && bytes < threshold_bytes;
}

namespace {
bool Fusable(const Response& a, const Response& b, bool separate_groups) {
  return a.type == OpType::kAllreduce && b.type == OpType::kAllreduce && a.error.empty() &&
         b.error.empty() && a.dtype == b.dtype && a.op == b.op && a.prescale == b.prescale &&
         a.postscale == b.postscale && a.on_gpu == b.on_gpu &&
         (!separate_groups || a.group_id == b.group_id);
}
}  // namespace

std::vector<std::vector<size_t>> PlanFusion(const std::vector<Response>& responses,
                                            int64_t threshold_bytes, bool separate_groups) {
  std::vector<std::vector<size_t>> batches;
  int64_t batch_bytes = 0;
  for (size_t i = 0; i < responses.size(); ++i) {
    int64_t bytes = ResponseBytes(responses[i]);
    if (!batches.empty() &&
        Fusable(responses[batches.back().front()], responses[i], separate_groups) &&
        batch_bytes + bytes <= threshold_bytes) {
      batches.back().push_back(i);
      batch_bytes += bytes;
    } else {
      batches.push_back({i});
      batch_bytes = bytes;
    }
  }
  return batches;
}

}  // namespace hvd
