// Minimal rank-prefixed logging to stderr. The level is set once by the Runtime.
#pragma once

#include <sstream>
#include <string>

namespace hvd {

enum class LogLevel : int { kTrace = 0, kDebug, kInfo, kWarning, kError, kFatal };

void SetLogLevel(const std::string& name);
void SetLogRank(int rank);
bool LogEnabled(LogLevel level);
void LogLine(LogLevel level, const std::string& text);

class LogMessage {
 public:
  explicit LogMessage(LogLevel level) : level_(level) {}
  ~LogMessage() { LogLine(level_, stream_.str()); }
  std::ostringstream& stream() { return stream_; }

 private:
  LogLevel level_;
  std::ostringstream stream_;
};

}  // namespace hvd

#define HVD_LOG(level)                                         \
  if (!::hvd::LogEnabled(::hvd::LogLevel::level)) {            \
  } else                                                       \
    ::hvd::LogMessage(::hvd::LogLevel::level).stream()
