#include "core/timeline.h"

#include <cctype>
#include <cerrno>
#include <cstring>

namespace hvd {
namespace {

std::string JsonString(const std::string& s) {
  std::string out = "\"";
  for (unsigned char c : s) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += static_cast<char>(c);
    } else if (c < 0x20) {
      char buf[8];
      std::snprintf(buf, sizeof(buf), "\\u%04x", c);
      out += buf;
    } else {
      out += static_cast<char>(c);
    }
  }
  return out + "\"";
}

std::string Upper(const char* s) {
  std::string out(s);
  for (char& c : out) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  return out;
}

}  // namespace

Status Timeline::Start(const std::string& path, bool mark_cycles) {
  Stop();
  std::FILE* f = std::fopen(path.c_str(), "w");
  if (f == nullptr) {
    return Status::InvalidArgument("cannot write the timeline to '" + path + "': " +
                                   std::strerror(errno) + "; give a path in a writable directory");
  }
  file_ = f;
  mark_cycles_ = mark_cycles;
  start_ = std::chrono::steady_clock::now();
  rows_.clear();
  std::fputs("[\n", file_);
  std::fflush(file_);
  return Status::Ok();
}

void Timeline::Stop() {
  if (file_ == nullptr) return;
  for (auto& kv : rows_) {
    while (kv.second.depth > 0) {
      Event(kv.second, 'E', "", nullptr);
      --kv.second.depth;
    }
  }
  // A last event without a trailing comma closes the array: the file is strict JSON.
  std::fprintf(file_,
               "{\"name\": \"TIMELINE_END\", \"ph\": \"i\", \"s\": \"g\", \"ts\": %lld, "
               "\"pid\": 0, \"tid\": 0}\n]\n",
               static_cast<long long>(NowUs()));
  std::fclose(file_);
  file_ = nullptr;
  rows_.clear();
}

int64_t Timeline::NowUs() const {
  return std::chrono::duration_cast<std::chrono::microseconds>(std::chrono::steady_clock::now() -
                                                               start_)
      .count();
}

Timeline::Row& Timeline::RowOf(const std::string& name) {
  auto it = rows_.find(name);
  if (it != rows_.end()) return it->second;
  Row& row = rows_[name];
  row.pid = static_cast<int>(rows_.size());
  std::fprintf(file_,
               "{\"name\": \"process_name\", \"ph\": \"M\", \"pid\": %d, \"args\": {\"name\": "
               "%s}},\n{\"name\": \"process_sort_index\", \"ph\": \"M\", \"pid\": %d, "
               "\"args\": {\"sort_index\": %d}},\n",
               row.pid, JsonString(name).c_str(), row.pid, row.pid);
  return row;
}

void Timeline::Event(const Row& row, char phase, const std::string& event_name, const char* extra) {
  std::string name_field = event_name.empty() ? "" : "\"name\": " + JsonString(event_name) + ", ";
  std::fprintf(file_, "{%s\"ph\": \"%c\", \"ts\": %lld, \"pid\": %d, \"tid\": 0%s},\n",
               name_field.c_str(), phase, static_cast<long long>(NowUs()), row.pid,
               extra ? extra : "");
}

void Timeline::NegotiateStart(const std::string& name, const char* op) {
  if (!file_) return;
  Row& row = RowOf(name);
  Event(row, 'B', "NEGOTIATE_" + Upper(op), nullptr);
  ++row.depth;
}

void Timeline::NegotiateRankReady(const std::string& name, int rank) {
  if (!file_) return;
  Event(RowOf(name), 'i', std::to_string(rank), ", \"s\": \"p\"");
}

void Timeline::NegotiateEnd(const std::string& name) {
  if (!file_) return;
  Row& row = RowOf(name);
  if (row.depth == 0) return;
  Event(row, 'E', "", nullptr);
  --row.depth;
}

void Timeline::OpStart(const std::string& name, const char* op) {
  if (!file_) return;
  Row& row = RowOf(name);
  Event(row, 'B', Upper(op), nullptr);
  ++row.depth;
  row.in_activity = false;
}

void Timeline::Activity(const std::string& name, const std::string& activity) {
  if (!file_) return;
  Row& row = RowOf(name);
  if (row.depth == 0) return;  // started after this op began: no enclosing span
  if (row.in_activity) {
    Event(row, 'E', "", nullptr);
    --row.depth;
  }
  Event(row, 'B', Upper(activity.c_str()), nullptr);
  ++row.depth;
  row.in_activity = true;
}

void Timeline::OpEnd(const std::string& name) {
  if (!file_) return;
  Row& row = RowOf(name);
  int close = row.in_activity ? 2 : 1;
  for (int i = 0; i < close && row.depth > 0; ++i) {
    Event(row, 'E', "", nullptr);
    --row.depth;
  }
  row.in_activity = false;
}

void Timeline::MarkCycle() {
  if (!file_ || !mark_cycles_) return;
  std::fprintf(file_,
               "{\"name\": \"CYCLE_START\", \"ph\": \"i\", \"s\": \"g\", \"ts\": %lld, "
               "\"pid\": 0, \"tid\": 0},\n",
               static_cast<long long>(NowUs()));
}

void Timeline::Counter(const std::string& name, double value) {
  if (!file_) return;
  std::fprintf(
      file_, "{\"name\": %s, \"ph\": \"C\", \"ts\": %lld, \"pid\": 0, \"args\": {\"ms\": %.3f}},\n",
      JsonString(name).c_str(), static_cast<long long>(NowUs()), value);
}

void Timeline::Flush() {
  if (file_) std::fflush(file_);
}

}  // namespace hvd
