#include "common/config.h"

#include <cstdlib>
#include <limits>
#include <map>
#include <stdexcept>

namespace hvd {
namespace {

bool Parse(const char* s, int64_t* out) {
  try {
    size_t pos = 0;
    long long v = std::stoll(s, &pos);
    if (s[pos] != '\0') return false;
    *out = v;
    return true;
  } catch (const std::exception&) {
    return false;
  }
}

bool Parse(const char* s, double* out) {
  try {
    size_t pos = 0;
    double v = std::stod(s, &pos);
    if (s[pos] != '\0') return false;
    *out = v;
    return true;
  } catch (const std::exception&) {
    return false;
  }
}

bool Parse(const char* s, std::string* out) {
  *out = s;
  return true;
}

// What a knob of C++ type `type` takes, for error messages.
std::string Expected(const std::string& type) {
  if (type == "int64_t") return "an integer";
  if (type == "double") return "a number";
  return "valid";
}

constexpr double kInf = std::numeric_limits<double>::infinity();

// The range of each numeric knob whose other values break something (a timeout of 0
// fails every collective at once, a negative size or count means nothing). Flags
// (0 / 1) are not listed: like Horovod, any other integer reads as on.
struct Range {
  const char* env;
  double lo, hi;
  bool lo_excluded;  // lo < value rather than lo <= value
  bool minus_one;    // -1 (automatic) allowed too
  const char* words;
};
const Range kRanges[] = {
    {"HOROVOD_FUSION_THRESHOLD", 0, kInf, false, false, ">= 0"},
    {"HOROVOD_CYCLE_TIME", 0, kInf, true, false, "> 0"},
    {"HOROVOD_WAKE_DELAY_US", 0, kInf, false, false, ">= 0"},
    {"HOROVOD_SPIN_US", 0, kInf, false, true, ">= 0, or -1 (automatic)"},
    {"HOROVOD_CACHE_CAPACITY", 0, kInf, false, false, ">= 0"},
    {"HOROVOD_STEADY_STATE_EXCHANGE", 0, 1, false, false, "0 or 1"},
    {"HOROVOD_TCP_TIMEOUT", 0, kInf, true, false, "> 0"},
    {"HOROVOD_GPU_OP_TIMEOUT", 0, kInf, false, false, ">= 0 (0: no limit)"},
    {"HOROVOD_START_TIMEOUT", 0, kInf, true, false, "> 0"},
    {"HOROVOD_SMALL_ALLREDUCE_BYTES", 0, kInf, false, false, ">= 0"},
    {"HOROVOD_RING_CHUNK_BYTES", 1, kInf, false, false, ">= 1"},
    {"HOROVOD_HIERARCHICAL_ALLREDUCE", 0, 1, false, true, "-1, 0 or 1"},
    {"HOROVOD_HIERARCHICAL_ALLGATHER", 0, 1, false, true, "-1, 0 or 1"},
    {"HOROVOD_SHM_CONTROL", 0, 1, false, false, "0 or 1"},
    {"HOROVOD_C10D_CUDA_DIRECT", 0, 1, false, false, "0 or 1"},
    {"HOROVOD_SHM_THREADS", 1, kInf, false, true, ">= 1, or -1 (automatic)"},
    {"HOROVOD_STALL_CHECK_TIME_SECONDS", 0, kInf, false, false, ">= 0"},
    {"HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", 0, kInf, false, false, ">= 0 (0: never)"},
    {"HOROVOD_STRAGGLER_WINDOW", 8, 4096, false, false, "between 8 and 4096"},
    {"HOROVOD_STRAGGLER_LAG", 0, kInf, false, false, ">= 0"},
    {"HOROVOD_STRAGGLER_MIN_LAG_MS", 0, kInf, false, false, ">= 0"},
    {"HOROVOD_STRAGGLER_SHARE", 0, 1, false, false, "between 0 and 1"},
    {"HOROVOD_AUTOTUNE_WARMUP_SAMPLES", 0, kInf, false, false, ">= 0"},
    {"HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE", 1, kInf, false, false, ">= 1"},
    {"HOROVOD_AUTOTUNE_BAYES_OPT_MAX_SAMPLES", 1, kInf, false, false, ">= 1"},
    {"HOROVOD_AUTOTUNE_GAUSSIAN_PROCESS_NOISE", 0, 1, false, false, "between 0 and 1"},
    {"HOROVOD_GLOO_TIMEOUT_SECONDS", 0, kInf, false, false, ">= 0"},
    {"HOROVOD_NUM_NCCL_STREAMS", 1, kInf, false, false, ">= 1"},
};

const Range* FindRange(const std::string& env) {
  for (const Range& r : kRanges) {
    if (env == r.env) return &r;
  }
  return nullptr;
}

// "" if `value` (parsed from knob `env`) is allowed, else the error's text.
std::string OutOfRange(const char* env, const char* text, double value) {
  if (KnobAllows(env, value)) return "";
  return std::string(env) + "='" + text + "' is out of range: it must be " + KnobAllowed(env);
}
std::string OutOfRange(const char*, const char*, const std::string&) { return ""; }

}  // namespace

std::string KnobAllowed(const std::string& env) {
  const Range* r = FindRange(env);
  return r == nullptr ? "" : r->words;
}

bool KnobAllows(const std::string& env, double value) {
  const Range* r = FindRange(env);
  if (r == nullptr) return true;
  if (r->minus_one && value == -1) return true;
  return (r->lo_excluded ? value > r->lo : value >= r->lo) && value <= r->hi;
}

Config Config::FromEnv(std::string* error) {
  // Where an installed package lists its knobs (docs/config.md is in the repository).
  static const char* const kKnobHelp = "python -m horovod_torch.config lists every knob";
  Config c;
#define HVD_READ_KNOB(member, env, type, def, doc)                                      \
  if (const char* v = std::getenv(env); v != nullptr && *v != '\0') {                   \
    type parsed{};                                                                      \
    std::string why;                                                                    \
    if (!Parse(v, &parsed)) {                                                           \
      why = std::string(env) + "='" + v + "' is not " + Expected(#type);                \
    } else {                                                                            \
      why = OutOfRange(env, v, parsed);                                                 \
    }                                                                                   \
    if (why.empty()) {                                                                  \
      c.member = parsed;                                                                \
    } else if (error != nullptr) {                                                      \
      *error += std::string(error->empty() ? "" : "; ") + why + " (" + kKnobHelp + ")"; \
    }                                                                                   \
  }
  HVD_KNOBS(HVD_READ_KNOB)
#undef HVD_READ_KNOB
  // Horovod's knobs that stand for ours.
  if (c.gloo_timeout_s > 0) c.tcp_timeout_s = c.start_timeout_s = c.gloo_timeout_s;
  if (c.torus_allreduce != 0 && c.hierarchical_allreduce < 0) c.hierarchical_allreduce = 1;
  return c;
}

// Built on std::string, not iostreams (see common/logging.h: they can crash when the
// extension and the host process carry different libstdc++ builds).
std::string Config::ProtocolSettings() const {
  std::string out;
  auto line = [&out](const char* knob, int64_t value) {
    out += std::string(knob) + "=" + std::to_string(value) + "\n";
  };
  line("HOROVOD_FUSION_THRESHOLD", fusion_threshold_bytes);
  line("HOROVOD_DISABLE_GROUP_FUSION", disable_group_fusion);
  line("HOROVOD_CACHE_CAPACITY", cache_capacity);
  line("HOROVOD_STEADY_STATE_EXCHANGE", steady_exchange);
  line("HOROVOD_SMALL_ALLREDUCE_BYTES", small_allreduce_bytes);
  line("HOROVOD_RING_CHUNK_BYTES", ring_chunk_bytes);
  line("HOROVOD_HIERARCHICAL_ALLREDUCE", hierarchical_allreduce);
  line("HOROVOD_HIERARCHICAL_ALLGATHER", hierarchical_allgather);
  line("HOROVOD_SHM_CONTROL", shm_control);
  line("HOROVOD_SHM_THREADS", shm_threads);
  line("HOROVOD_BATCH_WHILE_BUSY", batch_while_busy);
  line("HOROVOD_C10D_CUDA_DIRECT", c10d_cuda_direct);
  line("HOROVOD_AUTOTUNE", autotune);
  return out;
}

namespace {
std::map<std::string, std::string> ParseSettings(const std::string& s) {
  std::map<std::string, std::string> out;
  size_t start = 0;
  while (start < s.size()) {
    size_t end = s.find('\n', start);
    if (end == std::string::npos) end = s.size();
    const std::string line = s.substr(start, end - start);
    const size_t eq = line.find('=');
    if (eq != std::string::npos) out[line.substr(0, eq)] = line.substr(eq + 1);
    start = end + 1;
  }
  return out;
}
}  // namespace

std::string SettingsDisagreement(const std::vector<std::string>& per_rank) {
  if (per_rank.empty()) return "";
  const auto mine = ParseSettings(per_rank[0]);
  // knob -> value -> ranks with that value (rank 0's value first)
  std::map<std::string, std::map<std::string, std::vector<int>>> differ;
  for (size_t r = 1; r < per_rank.size(); ++r) {
    if (per_rank[r] == per_rank[0]) continue;
    for (const auto& kv : ParseSettings(per_rank[r])) {
      auto it = mine.find(kv.first);
      const std::string theirs = it == mine.end() ? "(unknown)" : it->second;
      if (theirs != kv.second) {
        auto& values = differ[kv.first];
        if (values.empty()) values[theirs].push_back(0);
        values[kv.second].push_back(static_cast<int>(r));
      }
    }
  }
  if (differ.empty()) return "";
  std::string msg =
      "ranks were started with different settings that must be equal on every "
      "rank (they choose the wire protocol or the algorithm):";
  for (const auto& knob : differ) {
    msg += " " + knob.first + " is";
    bool first = true;
    for (const auto& value : knob.second) {
      std::string ranks;
      for (size_t i = 0; i < value.second.size() && i < 8; ++i) {
        ranks += (i ? "," : "") + std::to_string(value.second[i]);
      }
      if (value.second.size() > 8) ranks += ",...";
      msg += std::string(first ? "" : ",") + " " + value.first + " on rank" +
             (value.second.size() > 1 ? "s " : " ") + ranks;
      first = false;
    }
    msg += ";";
  }
  msg.back() = '.';
  return msg + " Set these variables alike on every host (or leave them unset).";
}

}  // namespace hvd
