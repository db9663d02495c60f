// The TCP transport's hierarchy: which ranks share a host, their shared-memory
// group, which path each collective takes, and the allreduce and allgather that
// combine the group with TCP across hosts.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <map>

#include "common/logging.h"
#include "common/sha256.h"
#include "transport/shm.h"
#include "transport/tcp_transport.h"

namespace hvd {
namespace {

// Ranks can share a memfd segment when they run on the same kernel (boot id)
// and in the same network namespace (the abstract socket that passes the
// segment is per namespace; containers or test "hosts" in their own namespace
// are hosts of their own).
std::string HostKey() {
  std::string boot(64, '\0');
  int fd = ::open("/proc/sys/kernel/random/boot_id", O_RDONLY | O_CLOEXEC);
  ssize_t n = fd >= 0 ? ::read(fd, &boot[0], boot.size()) : -1;
  if (fd >= 0) ::close(fd);
  boot.resize(n > 0 ? static_cast<size_t>(n) : 0);
  while (!boot.empty() && (boot.back() == '\n' || boot.back() == '\0')) boot.pop_back();
  struct stat st {};
  if (boot.empty() || ::stat("/proc/self/ns/net", &st) != 0) return std::string();
  return boot + "/" + std::to_string(st.st_ino);
}

constexpr size_t kHostKeyBytes = 80;  // fixed length for the allgather

}  // namespace

Status TcpTransport::SetUpHierarchy(const std::string& secret, const std::string& prefix) {
  std::string key = options_.host_key.empty() ? HostKey() : options_.host_key;
  if (key.size() >= kHostKeyBytes) key.clear();
  // A rank that cannot tell its host gets a key of its own: it shares with nobody.
  if (key.empty()) key = "rank " + std::to_string(rank_);
  key.resize(kHostKeyBytes, '\0');
  std::vector<std::string> keys;
  HVD_RETURN_IF_ERROR(Allgather(key, &keys));
  std::map<std::string, std::vector<int>> hosts;  // ranks ascending
  for (int r = 0; r < size_; ++r) hosts[keys[r]].push_back(r);
  const std::vector<int>& local = hosts[keys[rank_]];
  if (local.size() < 2) return Status::Ok();
  const int me = static_cast<int>(std::find(local.begin(), local.end(), rank_) - local.begin());
  ShmOptions so;
  so.timeout_s = options_.io_timeout_s;
  so.threads = options_.shm_threads;
  // About 64 MB of segment per host at most (three buffers of one slot per rank).
  so.slot_bytes = std::clamp<size_t>((64u << 20) / (3 * local.size()), 64u << 10, 1u << 20);
  // Unique to the job (its secret), the mesh generation (prefix) and the host.
  std::string group =
      Hex(Sha256(secret)).substr(0, 16) + "/" + prefix + "/" + std::to_string(local[0]);
  Status st = ShmGroup::Create(group, secret, me, static_cast<int>(local.size()), so, &local_);
  if (!st.ok()) {
    return Status::Aborted("could not set up shared memory among the " +
                           std::to_string(local.size()) + " ranks of this host (" + st.message() +
                           "); set HOROVOD_HIERARCHICAL_ALLREDUCE=0 and "
                           "HOROVOD_HIERARCHICAL_ALLGATHER=0 to use TCP only");
  }
  local_ranks_ = local;
  one_host_ = hosts.size() == 1;
  bool uniform = true;
  for (const auto& h : hosts) uniform = uniform && h.second.size() == local.size();
  if (!one_host_ && uniform) {
    // Group j: the rank with local index j on every host, ascending.
    cross_groups_.assign(local.size(), {});
    for (size_t j = 0; j < local.size(); ++j) {
      for (const auto& h : hosts) cross_groups_[j].push_back(h.second[j]);
      std::sort(cross_groups_[j].begin(), cross_groups_[j].end());
    }
    cross_ = SubsetView(cross_groups_[me]);
  }
  HVD_LOG(kDebug) << "rank " << rank_ << ": " << local.size() << " ranks on this host, "
                  << hosts.size() << " hosts" << (cross_ ? ", hierarchical allreduce" : "");
  return Status::Ok();
}

// Allreduce and allgather (their knobs) use the segment on one host and across
// hosts of equal size; broadcast and reducescatter (the allreduce knob) on one host
// only; alltoall never; the control plane per ShmControl(). The auto knob (-1)
// keeps buffers up to small_allreduce_bytes on TCP.
TcpTransport::Path TcpTransport::PathOf(OpType op, size_t bytes) const {
  if (op == OpType::kControl) return ShmControl() ? Path::kShm : Path::kTcp;
  const bool gather = op == OpType::kAllgather;
  const int knob = gather ? options_.hierarchical_allgather : options_.hierarchical_allreduce;
  const bool across = cross_ && (gather || op == OpType::kAllreduce);
  if (!local_ || knob == 0 || op == OpType::kAlltoall || !(one_host_ || across)) return Path::kTcp;
  if (knob != 1 && bytes <= options_.small_allreduce_bytes) return Path::kTcp;
  return one_host_ ? Path::kShm : Path::kHier;
}

const char* TcpTransport::PathName(OpType op, size_t bytes) const {
  switch (PathOf(op, bytes)) {
    case Path::kShm:
      return "SHM";
    case Path::kHier:
      return "SHM_TCP";
    case Path::kTcp:
      break;
  }
  return "TCP";
}

// Several hosts: reduce-scatter within the host, allreduce of this rank's share
// with the same share on every other host, allgather within the host. Every step
// is deterministic, so all ranks get identical bits.
Status TcpTransport::HierarchicalAllreduce(char* buf, size_t count, DataType dtype, ReduceOp op) {
  const int n = local_->size(), me = local_->rank();
  const size_t esize = DataTypeSize(dtype);
  std::vector<size_t> counts(n, count / n), bytes(n);
  for (size_t r = 0; r < count % n; ++r) ++counts[r];
  size_t offset = 0;
  for (int r = 0; r < n; ++r) {
    bytes[r] = counts[r] * esize;
    if (r < me) offset += bytes[r];
  }
  HVD_RETURN_IF_ERROR(local_->ReduceScatter(buf, counts, dtype, op));
  HVD_RETURN_IF_ERROR(cross_->Allreduce(buf + offset, counts[me], dtype, op));
  return local_->Allgather(buf, bytes);
}

// Several hosts of equal size: each rank allgathers its block with the ranks of
// its local index on the other hosts (TCP: a rank receives one block per host, not
// one per rank), then the ranks of a host allgather what they collected through the
// segment, then every block moves to its place in rank order.
Status TcpTransport::HierarchicalAllgather(char* out, const std::vector<size_t>& off,
                                           const std::vector<size_t>& bytes) {
  const int n = local_->size(), me = local_->rank();
  // Bytes of group j's blocks, and where they start in the host-wide buffer.
  std::vector<size_t> group_bytes(n, 0), group_off(n, 0);
  for (int j = 0; j < n; ++j) {
    for (int g : cross_groups_[j]) group_bytes[j] += bytes[g];
    if (j > 0) group_off[j] = group_off[j - 1] + group_bytes[j - 1];
  }
  std::vector<char>& host = scratch_;
  host.resize(group_off[n - 1] + group_bytes[n - 1] + 1);
  const std::vector<int>& mine = cross_groups_[me];
  std::vector<size_t> cross_bytes(mine.size());
  for (size_t k = 0; k < mine.size(); ++k) cross_bytes[k] = bytes[mine[k]];
  HVD_RETURN_IF_ERROR(
      cross_->Allgatherv(out + off[rank_], host.data() + group_off[me], cross_bytes));
  HVD_RETURN_IF_ERROR(local_->Allgather(host.data(), group_bytes));
  for (int j = 0; j < n; ++j) {
    size_t pos = group_off[j];
    for (int g : cross_groups_[j]) {
      if (g != rank_ && bytes[g] > 0) std::memcpy(out + off[g], host.data() + pos, bytes[g]);
      pos += bytes[g];
    }
  }
  return Status::Ok();
}

}  // namespace hvd
