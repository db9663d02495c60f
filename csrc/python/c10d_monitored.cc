#include "python/c10d_monitored.h"

#include <algorithm>
#include <limits>
#include <string>
#include <vector>

#include "python/c10d_work.h"

namespace hvd {

void MonitoredBarrier(c10d::Backend& group, std::chrono::milliseconds limit, uint64_t call,
                      bool wait_all_ranks) {
  const int tag = std::numeric_limits<int>::min() + static_cast<int>(call % (1 << 30));
  const auto until = std::chrono::steady_clock::now() + limit;
  // At least 1 ms: a wait of 0 would mean the group's own timeout (HvdWork::wait).
  const auto left = [until] { return std::max(TimeLeft(until), std::chrono::milliseconds(1)); };
  auto token = [] { return std::vector<at::Tensor>{at::zeros({1}, at::kByte)}; };
  if (group.getRank() != 0) {
    try {
      auto sent = token(), answer = token();
      group.send(sent, 0, tag)->wait(left());
      group.recv(answer, 0, tag)->wait(left());
    } catch (const std::exception& e) {
      Fail("Rank " + std::to_string(group.getRank()) +
           " reached monitored_barrier, but rank 0 did not answer within " +
           std::to_string(limit.count()) +
           " ms: rank 0's error names the ranks that did not reach it (" + e.what() + ")");
    }
    return;
  }
  std::vector<std::vector<at::Tensor>> tokens;
  std::vector<c10::intrusive_ptr<c10d::Work>> works;
  for (int r = 1; r < group.getSize(); ++r) {
    tokens.push_back(token());
    works.push_back(group.recv(tokens.back(), r, tag));
  }
  std::vector<int> missing;
  for (int r = 1; r < group.getSize(); ++r) {
    try {
      works[static_cast<size_t>(r - 1)]->wait(left());
    } catch (const std::exception&) {
      missing.push_back(r);
      if (!wait_all_ranks) break;
    }
  }
  if (!missing.empty()) {
    std::string ranks;
    for (int r : missing) ranks += (ranks.empty() ? "" : ", ") + std::to_string(r);
    Fail("[Rank 0]: Rank" + std::string(missing.size() > 1 ? "s " : " ") + ranks +
         " failed to pass monitoredBarrier in " + std::to_string(limit.count()) + " ms");
  }
  for (int r = 1; r < group.getSize(); ++r) {
    auto answer = token();
    group.send(answer, r, tag)->wait(left());
  }
}

}  // namespace hvd
