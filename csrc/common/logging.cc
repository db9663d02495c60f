#include "common/logging.h"

#include <atomic>
#include <cctype>
#include <cstdio>

namespace hvd {
namespace {
std::atomic<int> g_level{static_cast<int>(LogLevel::kWarning)};
std::atomic<int> g_rank{-1};
const char* kNames[] = {"trace", "debug", "info", "warning", "error", "fatal"};
}  // namespace

void SetLogLevel(const std::string& name) {
  std::string lower;
  for (char c : name) lower += static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  for (int i = 0; i < 6; ++i) {
    if (lower == kNames[i]) g_level = i;
  }
}

void SetLogRank(int rank) { g_rank = rank; }

bool LogEnabled(LogLevel level) { return static_cast<int>(level) >= g_level.load(); }

void LogLine(LogLevel level, const std::string& text) {
  std::fprintf(stderr, "[horovod_torch %s rank %d] %s\n", kNames[static_cast<int>(level)],
               g_rank.load(), text.c_str());
}

}  // namespace hvd
