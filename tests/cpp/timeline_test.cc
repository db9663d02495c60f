// core/timeline: the Chrome-trace file is strict JSON after Stop(), and each
// line is one event, so a file cut short still parses line by line.
#include <gtest/gtest.h>

#include <fstream>
#include <sstream>
#include <string>

#include "core/timeline.h"

namespace hvd {
namespace {

std::string Slurp(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

int Count(const std::string& s, const std::string& what) {
  int n = 0;
  for (size_t p = s.find(what); p != std::string::npos; p = s.find(what, p + 1)) ++n;
  return n;
}

TEST(Timeline, WritesBalancedSpansAndClosesTheArray) {
  std::string path = ::testing::TempDir() + "timeline_test.json";
  Timeline t;
  ASSERT_TRUE(t.Start(path, true).ok());
  t.NegotiateStart("grad \"w\"", "allreduce");
  t.NegotiateRankReady("grad \"w\"", 0);
  t.NegotiateRankReady("grad \"w\"", 1);
  t.NegotiateEnd("grad \"w\"");
  t.MarkCycle();
  t.OpStart("grad \"w\"", "allreduce");
  t.Activity("grad \"w\"", "QUEUE");
  t.Activity("grad \"w\"", "tcp_allreduce");
  t.OpEnd("grad \"w\"");
  t.OpStart("b", "broadcast");  // left open: Stop() closes it
  t.Flush();
  std::string partial = Slurp(path);
  EXPECT_EQ(partial.rfind("[\n", 0), 0u);
  EXPECT_EQ(partial.find("]"), std::string::npos) << "closed before Stop()";
  t.Stop();
  EXPECT_FALSE(t.active());
  std::string s = Slurp(path);
  EXPECT_NE(s.find("\"name\": \"grad \\\"w\\\"\""), std::string::npos) << "name not escaped";
  EXPECT_EQ(Count(s, "\"ph\": \"B\""), Count(s, "\"ph\": \"E\""));
  EXPECT_EQ(Count(s, "\"NEGOTIATE_ALLREDUCE\""), 1);
  EXPECT_EQ(Count(s, "\"TCP_ALLREDUCE\""), 1);
  EXPECT_EQ(Count(s, "\"QUEUE\""), 1);
  EXPECT_EQ(Count(s, "\"CYCLE_START\""), 1);
  EXPECT_EQ(Count(s, "\"ph\": \"i\", \"ts\""), 2) << "rank-ready marks";
  EXPECT_EQ(s.substr(s.size() - 4), "}\n]\n") << "array not closed";
  std::remove(path.c_str());
}

TEST(Timeline, UnwritablePathIsAClearError) {
  Timeline t;
  Status st = t.Start("/nonexistent-dir/x/timeline.json", false);
  EXPECT_FALSE(st.ok());
  EXPECT_NE(st.message().find("/nonexistent-dir/x/timeline.json"), std::string::npos);
  EXPECT_FALSE(t.active());
}

}  // namespace
}  // namespace hvd
