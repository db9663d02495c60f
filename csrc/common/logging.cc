#include "common/logging.h"

#include <atomic>
#include <cctype>
#include <chrono>
#include <cstdio>
#include <ctime>

namespace hvd {
namespace {
std::atomic<int> g_level{static_cast<int>(LogLevel::kWarning)};
std::atomic<int> g_rank{-1};
std::atomic<bool> g_hide_time{false};
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

void SetLogHideTime(bool hide) { g_hide_time = hide; }

bool LogEnabled(LogLevel level) { return static_cast<int>(level) >= g_level.load(); }

void LogLine(LogLevel level, const std::string& text) {
  char stamp[48] = "";
  if (!g_hide_time.load()) {
    auto now = std::chrono::system_clock::now();
    std::time_t secs = std::chrono::system_clock::to_time_t(now);
    long us = static_cast<long>(
        std::chrono::duration_cast<std::chrono::microseconds>(now.time_since_epoch()).count() %
        1000000);
    std::tm tm{};
    gmtime_r(&secs, &tm);
    size_t n = std::strftime(stamp, sizeof(stamp), " %Y-%m-%dT%H:%M:%S", &tm);
    std::snprintf(stamp + n, sizeof(stamp) - n, ".%06ldZ", us);
  }
  // One fprintf per line: lines of concurrent threads do not interleave.
  std::fprintf(stderr, "[horovod_torch %s rank %d%s] %s\n", kNames[static_cast<int>(level)],
               g_rank.load(), stamp, text.c_str());
}

}  // namespace hvd
