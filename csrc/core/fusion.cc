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
    if ((r.type != OpType::kAllreduce && r.type != OpType::kReducescatter) || r.device < 0) {
      return false;
    }
    bytes += r.NumElements() * static_cast<int64_t>(DataTypeSize(r.dtype));
  }
  return !fresh.empty() && bytes < threshold_bytes;
}

std::vector<int64_t> ReducescatterRows(const Response& r, int size) {
  if (!r.rank_rows.empty()) return r.rank_rows;
  const int64_t dim0 = r.shape.empty() ? 0 : r.shape[0];
  std::vector<int64_t> rows(size);
  for (int p = 0; p < size; ++p) rows[p] = dim0 / size + (p < dim0 % size ? 1 : 0);
  return rows;
}

ScatterLayout PlanReducescatter(const std::vector<Response>& batch, int size) {
  ScatterLayout l;
  const size_t n = batch.size();
  l.elems.assign(n, std::vector<int64_t>(size));
  l.src_offset.assign(n, std::vector<int64_t>(size));
  l.dst_offset.assign(n, std::vector<int64_t>(size));
  l.counts.assign(size, 0);
  for (size_t i = 0; i < n; ++i) {
    int64_t row = 1;
    for (size_t d = 1; d < batch[i].shape.size(); ++d) row *= batch[i].shape[d];
    const std::vector<int64_t> rows = ReducescatterRows(batch[i], size);
    int64_t off = 0;
    for (int p = 0; p < size; ++p) {
      l.elems[i][p] = rows[p] * row;
      l.src_offset[i][p] = off;
      off += l.elems[i][p];
      l.counts[p] += static_cast<size_t>(l.elems[i][p]);
    }
  }
  int64_t pos = 0;
  for (int p = 0; p < size; ++p) {
    for (size_t i = 0; i < n; ++i) {
      l.dst_offset[i][p] = pos;
      pos += l.elems[i][p];
    }
  }
  l.total = pos;
  return l;
}

namespace {
bool Fusable(const Response& a, const Response& b, bool separate_groups) {
  const bool same_kind = (a.type == OpType::kAllreduce && b.type == OpType::kAllreduce) ||
                         (a.type == OpType::kReducescatter && b.type == OpType::kReducescatter);
  return same_kind && a.error.empty() && b.error.empty() && a.dtype == b.dtype && a.op == b.op &&
         a.prescale == b.prescale && a.postscale == b.postscale && a.on_gpu == b.on_gpu &&
         a.devices == b.devices && (!separate_groups || a.group_id == b.group_id);
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
