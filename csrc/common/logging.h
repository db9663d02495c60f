// Minimal rank-prefixed logging to stderr. The level is set once by the Runtime.
#pragma once

#include <string>
#include <type_traits>

namespace hvd {

enum class LogLevel : int { kTrace = 0, kDebug, kInfo, kWarning, kError, kFatal };

void SetLogLevel(const std::string& name);
void SetLogRank(int rank);
// Lines carry a UTC timestamp (to the microsecond) unless hidden.
void SetLogHideTime(bool hide);
bool LogEnabled(LogLevel level);
void LogLine(LogLevel level, const std::string& text);

// Collects one line. Built on std::string rather than iostreams, which can crash
// when the extension and the host process carry different libstdc++ builds.
class LogMessage {
 public:
  explicit LogMessage(LogLevel level) : level_(level) {}
  ~LogMessage() { LogLine(level_, text_); }
  LogMessage& stream() { return *this; }
  LogMessage& operator<<(const std::string& s) {
    text_ += s;
    return *this;
  }
  LogMessage& operator<<(const char* s) {
    text_ += s;
    return *this;
  }
  template <typename T, typename = std::enable_if_t<std::is_arithmetic_v<T>>>
  LogMessage& operator<<(T v) {
    text_ += std::to_string(v);
    return *this;
  }

 private:
  LogLevel level_;
  std::string text_;
};

}  // namespace hvd

#define HVD_LOG(level)                              \
  if (!::hvd::LogEnabled(::hvd::LogLevel::level)) { \
  } else                                            \
    ::hvd::LogMessage(::hvd::LogLevel::level).stream()
