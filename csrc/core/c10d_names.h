// The names of torch.distributed calls (python/c10d_backend.cc), and what the
// coordinator reads from them (Controller::FailDivergedCalls).
//
// Every rank issues a c10d group's calls in the same order (torch's rule for every
// backend), and numbers them alike. The n-th call is in slot n % kC10dSlots, and it
// waits for the previous call of its slot to complete before it is submitted (the
// caller blocks, also for async_op=True: the ninth call of a group in flight waits for
// the first). So a rank has at most one call pending in a slot, and when every member
// has one pending in slot s, it is the same call n everywhere.
//
// A call of one op whose request every rank must give alike (allreduce, broadcast,
// allgather, reduce-scatter, ...) is named by its slot, kind and arguments:
// "c10d.<group>.<slot>.allreduce.Float[1024].Sum". Such names repeat from step to step,
// so the response cache serves them without a negotiation round. A call whose
// arguments differ between ranks then has a different name on each; the coordinator
// sees it as different names pending in one slot on every rank, and fails it with the
// mismatch error. Other calls (several ops as one group, alltoall, scatter, barrier)
// are named by slot, kind and n: "c10d.<group>.<slot>.barrier#17".
//
// Torch-free.
#pragma once

#include <cstdint>
#include <cstdlib>
#include <string>
#include <vector>

namespace hvd {

// More slots: fewer callers wait; but up to kC10dSlots names per distinct call (a
// DDP bucket) fill the response cache (1024 entries by default).
constexpr uint64_t kC10dSlots = 8;

// "c10d.<group>.<n % kC10dSlots>.<rest>"; `group` must not contain a dot.
inline std::string C10dName(const std::string& group, uint64_t n, const std::string& rest) {
  return "c10d." + group + "." + std::to_string(n % kC10dSlots) + "." + rest;
}

// "c10d.<group>.<slot>" of a name C10dName made, or "" for any other name.
inline std::string C10dSlotOf(const std::string& name) {
  static const std::string kPrefix = "c10d.";
  if (name.compare(0, kPrefix.size(), kPrefix) != 0) return "";
  const size_t group_end = name.find('.', kPrefix.size());
  if (group_end == std::string::npos || group_end == kPrefix.size()) return "";
  size_t i = group_end + 1;
  while (i < name.size() && name[i] >= '0' && name[i] <= '9') ++i;
  if (i == group_end + 1 || i >= name.size() || name[i] != '.') return "";
  return name.substr(0, i);
}

// A send or recv (no slot): "c10d.<group>.p2p.<from>.<to>.<tag>.<k>", the k-th from
// `from` to `to` with `tag`, counted on both sides; a receive from any source:
// "c10d.<group>.p2pany.<to>.<tag>.<j>", the j-th of `to` with `tag`, which the
// coordinator pairs with a pending send (Controller::BindAnySource).
struct P2pName {
  std::string group;
  int64_t from = -1;  // -1: a receive from any source
  int64_t to = -1;
  int64_t tag = 0;
};

inline std::string P2pCallName(const std::string& group, const P2pName& p, uint64_t count) {
  const std::string tail =
      std::to_string(p.to) + "." + std::to_string(p.tag) + "." + std::to_string(count);
  return "c10d." + group + (p.from < 0 ? ".p2pany." : ".p2p." + std::to_string(p.from) + ".") +
         tail;
}

// Parses a name P2pCallName made; false for any other.
inline bool ParseP2pName(const std::string& name, P2pName* out) {
  std::vector<std::string> parts;
  size_t start = 0;
  for (size_t dot; (dot = name.find('.', start)) != std::string::npos; start = dot + 1) {
    parts.push_back(name.substr(start, dot - start));
  }
  parts.push_back(name.substr(start));
  const bool any = parts.size() == 6 && parts[2] == "p2pany";
  if (parts[0] != "c10d" || !(any || (parts.size() == 7 && parts[2] == "p2p"))) return false;
  std::vector<int64_t> v;
  for (size_t i = 3; i < parts.size(); ++i) {
    char* end = nullptr;
    v.push_back(std::strtoll(parts[i].c_str(), &end, 10));
    if (parts[i].empty() || *end != '\0') return false;
  }
  out->group = parts[1];
  out->from = any ? -1 : v[0];
  out->to = v[any ? 0 : 1];
  out->tag = v[any ? 1 : 2];
  return true;
}

}  // namespace hvd
