#include "python/c10d_calls.h"

#include <algorithm>

#include "python/module_state.h"

namespace hvd {

Reduction OurOp(const c10d::ReduceOp& op, const char* what) {
  switch (op.op_) {
    case c10d::ReduceOp::SUM:
      return {ReduceOp::kSum};
    case c10d::ReduceOp::AVG:
      return {ReduceOp::kAverage};
    case c10d::ReduceOp::MIN:
      return {ReduceOp::kMin};
    case c10d::ReduceOp::MAX:
      return {ReduceOp::kMax};
    case c10d::ReduceOp::PRODUCT:
      return {ReduceOp::kProduct};
    case c10d::ReduceOp::PREMUL_SUM: {
      const auto* factor = dynamic_cast<const c10d::NCCLPreMulSumSupplement*>(op.supplement_.get());
      if (factor == nullptr) Fail(std::string(what) + ": PREMUL_SUM without its factor");
      if (!factor->tensor_factor.defined()) return {ReduceOp::kSum, factor->double_factor};
      return {ReduceOp::kSum, factor->tensor_factor.item<double>()};
    }
    default:
      Fail(std::string(what) +
           ": only ReduceOp SUM, AVG, MIN, MAX, PRODUCT and PREMUL_SUM are supported (not "
           "BAND, BOR or BXOR)");
  }
}

namespace {

// A group name without dots (core/c10d_names.h reads the slot after the first one).
std::string Sanitized(std::string group) {
  std::replace(group.begin(), group.end(), '.', '_');
  return group;
}

// What names a call of one op whose request every rank must give alike: its kind,
// dtype and shape, and its reduction or root ("allreduce.Float[1024].Sum").
std::string Arguments(const char* what, const Submission& s) {
  std::string a = std::string(what) + "." + c10::toString(s.input.scalar_type()) + "[";
  for (int64_t i = 0; i < s.input.dim(); ++i) {
    a += (i ? "," : "") + std::to_string(s.input.size(i));
  }
  a += "]";
  switch (s.request.type) {
    case OpType::kAllreduce:
    case OpType::kReducescatter:
      return a + "." + ReduceOpName(s.request.op);
    case OpType::kBroadcast:
      return a + ".root" + std::to_string(s.request.root);
    default:
      return a;
  }
}

// The key of p2p_calls_.
std::string P2pKey(int64_t from, int64_t to, int64_t tag) {
  return std::to_string(from) + "." + std::to_string(to) + "." + std::to_string(tag);
}

}  // namespace

C10dCalls::C10dCalls(std::chrono::milliseconds timeout, const std::string& group)
    : timeout_(timeout), group_(Sanitized(group)) {}

// Waits until the previous call in slot `slot` has completed, and frees its names for
// this call (its handles may live on in its Work a while longer). After a timeout the
// ranks' call numbers disagree for good: every later call fails at once.
void C10dCalls::WaitForSlot(uint64_t slot, const char* what) {
  if (!broken_.empty()) Fail(std::string(what) + ": " + broken_);
  const auto until = std::chrono::steady_clock::now() + timeout_;
  for (const auto& h : slots_[slot]) {
    if (!h->Wait(0, TimeLeft(until))) {
      broken_ = "the group is unusable: '" + h->name() + "', called " + std::to_string(kC10dSlots) +
                " calls before '" + what +
                "', did not complete within the group's timeout (a peer did not call it); "
                "destroy the process group and create it again";
      Fail(std::string(what) + ": " + broken_);
    }
  }
  for (const auto& h : slots_[slot]) h->ReleaseName();
  slots_[slot].clear();
}

void C10dCalls::SettleAnySource(const int64_t* tag, const char* what) {
  const auto until = std::chrono::steady_clock::now() + timeout_;
  for (auto it = any_.begin(); it != any_.end();) {
    const P2pName& recv = it->first;
    const std::shared_ptr<HandleState>& h = it->second;
    if (tag != nullptr && recv.tag == *tag && !h->Wait(0, TimeLeft(until))) {
      Fail(std::string(what) + ": timed out waiting for the receive from any source '" + h->name() +
           "' posted before it with the same tag");
    }
    if (!h->done()) {
      ++it;
      continue;
    }
    if (h->source() >= 0) {  // paired with a send (also when the pair failed)
      ++p2p_calls_[P2pKey(h->source(), recv.to, recv.tag)];
    }
    it = any_.erase(it);
  }
}

// Names the ops of the next call; *slot gets its slot (none for a send/recv).
std::vector<std::string> C10dCalls::NamesFor(const char* what, const std::vector<Submission>& subs,
                                             const P2pName* p2p, uint64_t* slot) {
  if (p2p != nullptr) {
    return {P2pCallName(group_, *p2p, p2p_calls_[P2pKey(p2p->from, p2p->to, p2p->tag)]++)};
  }
  const uint64_t n = calls_++;
  *slot = n % kC10dSlots;
  const bool alike = subs.size() == 1 && subs[0].request.type != OpType::kAlltoall &&
                     subs[0].request.type != OpType::kControl;
  if (alike) return {C10dName(group_, n, Arguments(what, subs[0]))};
  std::vector<std::string> names;
  for (size_t i = 0; i < subs.size(); ++i) {
    names.push_back(C10dName(group_, n,
                             std::string(what) + "#" + std::to_string(n) +
                                 (subs.size() > 1 ? "." + std::to_string(i) : "")));
  }
  return names;
}

c10::intrusive_ptr<c10d::Work> C10dCalls::Run(c10d::OpType type, const char* what,
                                              std::vector<Submission> subs,
                                              std::vector<at::Tensor> outputs, Finish finish,
                                              const P2pName* p2p) {
  if (InFutureCallback()) {
    // Its number in the group's order would depend on when this rank's earlier call
    // completed, which differs between ranks: it could meet another call of a peer.
    Fail(std::string(what) +
         " called inside a callback of another call's future (as DDP's PowerSGD hook "
         "does): not supported on the engine's calls, since the ranks cannot agree on its "
         "place in the group's order; call it outside the callback");
  }
  auto call = std::make_shared<CallState>();
  call->what = what;
  call->outputs = std::move(outputs);
  call->finish = std::move(finish);
  std::vector<c10::Device> devices;
  for (const auto& t : call->outputs) {
    if (t.is_cuda() && std::find(devices.begin(), devices.end(), t.device()) == devices.end()) {
      devices.push_back(t.device());
    }
  }
  call->future = c10::make_intrusive<c10::ivalue::Future>(
      c10::ListType::create(c10::TensorType::get()), devices);
  {
    MutexLock lock(mu_);
    const bool named_recv = p2p != nullptr && p2p->from >= 0 && type == c10d::OpType::RECV;
    SettleAnySource(named_recv ? &p2p->tag : nullptr, what);
    uint64_t slot = kC10dSlots;  // none (p2p)
    std::vector<std::string> names = NamesFor(what, subs, p2p, &slot);
    if (slot < kC10dSlots) WaitForSlot(slot, what);
    for (size_t i = 0; i < subs.size(); ++i) subs[i].request.name = names[i];
    if (subs.size() > 1) {
      const int64_t group = GroupId(names);
      for (auto& s : subs) {
        s.request.group_id = group;
        s.request.group_size = static_cast<int32_t>(subs.size());
      }
    }
    std::vector<std::shared_ptr<HandleState>> states;
    Status st = SubmitToRuntime(std::move(subs), &states);
    if (!st.ok()) Fail(std::string(what) + ": " + st.message());
    if (slot < kC10dSlots) slots_[slot] = states;
    if (p2p != nullptr && p2p->from < 0) {
      any_.emplace_back(*p2p, states[0]);
      call->from_any = true;
    }
    call->handles = std::move(states);
  }
  return StartWork(std::move(call), type, timeout_);
}

}  // namespace hvd
