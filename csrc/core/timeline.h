// The timeline: a Chrome trace (chrome://tracing, Perfetto) written by the
// coordinator. Every tensor name is a "process" row; its events are
//   NEGOTIATE_<OP>     first rank's request .. response (instant "rank N" marks
//                      when each rank became ready)
//   <OP>               response .. done, with nested activities QUEUE,
//                      MEMCPY_IN_FUSION_BUFFER, the collective named by the path
//                      it took (Communicator::PathName: e.g. SHM_ALLREDUCE,
//                      SHM_TCP_ALLREDUCE, TCP_ALLREDUCE, NCCL_ALLREDUCE) and
//                      MEMCPY_OUT_FUSION_BUFFER
// a counter track per rank, STRAGGLER_LAG_MS_RANK_<r>, with its lateness in each
// cycle that completed ops (core/straggler.h), and, with mark_cycles, a global instant
// "CYCLE_START" per cycle that ran work.
//
// The file is a JSON array written incrementally (flushed every cycle), so a
// killed job leaves a readable prefix; Stop() closes the array. Timestamps are
// microseconds since Start().
//
// Threading: used only by the background thread. Torch-free.
#pragma once

#include <chrono>
#include <cstdio>
#include <string>
#include <unordered_map>

#include "common/status.h"

namespace hvd {

class Timeline {
 public:
  Timeline() = default;
  ~Timeline() { Stop(); }
  Timeline(const Timeline&) = delete;
  Timeline& operator=(const Timeline&) = delete;

  // Opens (truncates) path and starts recording; a running timeline is closed first.
  Status Start(const std::string& path, bool mark_cycles);
  // Closes any open spans and the JSON array. No-op when not recording.
  void Stop();
  bool active() const { return file_ != nullptr; }

  void NegotiateStart(const std::string& name, const char* op);
  void NegotiateRankReady(const std::string& name, int rank);
  void NegotiateEnd(const std::string& name);
  void OpStart(const std::string& name, const char* op);
  // Ends the running activity of `name` (if any) and starts `activity` under its op.
  void Activity(const std::string& name, const std::string& activity);
  // Ends the activity and the op of `name`.
  void OpEnd(const std::string& name);
  void MarkCycle();
  // A sample of the counter track `name` (a Chrome trace "C" event).
  void Counter(const std::string& name, double value);
  void Flush();

 private:
  struct Row {
    int pid = 0;
    int depth = 0;  // open B events
    bool in_activity = false;
  };
  Row& RowOf(const std::string& name);
  void Event(const Row& row, char phase, const std::string& event_name, const char* extra);
  int64_t NowUs() const;

  std::FILE* file_ = nullptr;
  bool mark_cycles_ = false;
  std::chrono::steady_clock::time_point start_;
  std::unordered_map<std::string, Row> rows_;
};

}  // namespace hvd
