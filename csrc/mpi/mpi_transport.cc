// The MPI communicator (built when mpicxx is found; replaces mpi/no_mpi.cc).
//
// Every dtype travels as a contiguous byte type of its element size, and every
// reduction is a user-defined MPI op that calls ReduceInto: fp16, bf16 and bool get
// exactly the semantics of the TCP transport. Allreduce is a reduce-scatter followed
// by an allgather, so each element is reduced once, by one rank, and every rank ends
// with bitwise identical results (as the Collectives contract requires).
//
// Errors: our communicators use MPI_ERRORS_RETURN; a failing call returns kAborted.
// A peer that dies is handled by mpirun, which ends the job; Abort() cannot wake a
// blocked MPI call and does nothing.
//
// Threading: MPI is initialised with MPI_THREAD_MULTIPLE (or must have been, by
// mpi4py for example); the background thread makes the data-plane calls.
#include <mpi.h>

#include <algorithm>
#include <climits>
#include <cstdlib>
#include <mutex>

#include "common/types.h"
#include "mpi/mpi_setup.h"
#include "transport/transport.h"

namespace hvd {
namespace {

constexpr int kNumTypes = kNumDataTypes;  // one MPI type per row of HVD_DATA_TYPES
MPI_Datatype g_types[kNumTypes];
MPI_Op g_ops[4];  // Sum, Min, Max, Product
std::once_flag g_types_once;
bool g_we_initialized = false;

DataType FromMpi(MPI_Datatype t) {
  for (int i = 0; i < kNumTypes; ++i) {
    if (g_types[i] == t) return static_cast<DataType>(i);
  }
  std::abort();  // only our types reach our ops
}

template <ReduceOp kOp>
void ReduceFn(void* in, void* inout, int* len, MPI_Datatype* type) {
  ReduceInto(inout, in, static_cast<size_t>(*len), FromMpi(*type), kOp);
}

void InitTypes() {
  for (int i = 0; i < kNumTypes; ++i) {
    MPI_Type_contiguous(static_cast<int>(DataTypeSize(static_cast<DataType>(i))), MPI_BYTE,
                        &g_types[i]);
    MPI_Type_commit(&g_types[i]);
  }
  MPI_Op_create(&ReduceFn<ReduceOp::kSum>, 1, &g_ops[0]);
  MPI_Op_create(&ReduceFn<ReduceOp::kMin>, 1, &g_ops[1]);
  MPI_Op_create(&ReduceFn<ReduceOp::kMax>, 1, &g_ops[2]);
  MPI_Op_create(&ReduceFn<ReduceOp::kProduct>, 1, &g_ops[3]);
}

MPI_Op OpOf(ReduceOp op) {
  switch (op) {
    case ReduceOp::kMin:
      return g_ops[1];
    case ReduceOp::kMax:
      return g_ops[2];
    case ReduceOp::kProduct:
      return g_ops[3];
    default:
      return g_ops[0];
  }
}

void FinalizeAtExit() {
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (!finalized) MPI_Finalize();
}

Status Check(int rc, const char* what) {
  if (rc == MPI_SUCCESS) return Status::Ok();
  char msg[MPI_MAX_ERROR_STRING];
  int len = 0;
  MPI_Error_string(rc, msg, &len);
  return Status::Aborted(std::string(what) + " failed: " + std::string(msg, len));
}

Status ToInts(const std::vector<size_t>& v, std::vector<int>* counts, std::vector<int>* displs) {
  counts->resize(v.size());
  displs->resize(v.size());
  size_t off = 0;
  for (size_t i = 0; i < v.size(); ++i) {
    if (v[i] > static_cast<size_t>(INT_MAX) || off > static_cast<size_t>(INT_MAX)) {
      return Status::InvalidArgument(
          "the MPI transport moves at most 2 GiB per rank per op; "
          "split the tensor or use the TCP transport");
    }
    (*counts)[i] = static_cast<int>(v[i]);
    (*displs)[i] = static_cast<int>(off);
    off += v[i];
  }
  return Status::Ok();
}

class MpiCommunicator : public Communicator {
 public:
  explicit MpiCommunicator(MPI_Comm comm) : comm_(comm) {
    MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN);
    MPI_Comm_rank(comm_, &rank_);
    MPI_Comm_size(comm_, &size_);
  }
  ~MpiCommunicator() override { MPI_Comm_free(&comm_); }

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  const char* name() const override { return "MPI"; }

  Status Gather(const std::string& mine, std::vector<std::string>* all) override {
    int64_t len = static_cast<int64_t>(mine.size());
    std::vector<int64_t> lens(rank_ == 0 ? size_ : 0);
    HVD_RETURN_IF_ERROR(Check(
        MPI_Gather(&len, 1, MPI_INT64_T, lens.data(), 1, MPI_INT64_T, 0, comm_), "MPI_Gather"));
    std::vector<size_t> sizes(lens.begin(), lens.end());
    std::vector<int> counts, displs;
    if (rank_ == 0) HVD_RETURN_IF_ERROR(ToInts(sizes, &counts, &displs));
    std::string buf(rank_ == 0 ? displs.back() + counts.back() : 0, '\0');
    HVD_RETURN_IF_ERROR(
        Check(MPI_Gatherv(mine.data(), static_cast<int>(mine.size()), MPI_BYTE, &buf[0],
                          counts.data(), displs.data(), MPI_BYTE, 0, comm_),
              "MPI_Gatherv"));
    if (rank_ == 0) {
      all->resize(size_);
      for (int r = 0; r < size_; ++r) (*all)[r] = buf.substr(displs[r], counts[r]);
    }
    return Status::Ok();
  }

  Status Bcast(std::string* data) override {
    int64_t len = static_cast<int64_t>(data->size());
    HVD_RETURN_IF_ERROR(Check(MPI_Bcast(&len, 1, MPI_INT64_T, 0, comm_), "MPI_Bcast"));
    data->resize(static_cast<size_t>(len));
    return Check(MPI_Bcast(&(*data)[0], static_cast<int>(len), MPI_BYTE, 0, comm_), "MPI_Bcast");
  }

  Status Allgather(const std::string& mine, std::vector<std::string>* all) override {
    const int n = static_cast<int>(mine.size());
    std::string buf(static_cast<size_t>(n) * size_, '\0');
    HVD_RETURN_IF_ERROR(Check(MPI_Allgather(mine.data(), n, MPI_BYTE, &buf[0], n, MPI_BYTE, comm_),
                              "MPI_Allgather"));
    all->resize(size_);
    for (int r = 0; r < size_; ++r) (*all)[r] = buf.substr(static_cast<size_t>(r) * n, n);
    return Status::Ok();
  }

  Status Allreduce(void* buf, size_t count, DataType dtype, ReduceOp op) override {
    if (size_ == 1 || count == 0) return Status::Ok();
    std::vector<size_t> counts(size_);
    for (int r = 0; r < size_; ++r)
      counts[r] = count / size_ + (r < static_cast<int>(count % size_));
    std::vector<int> c, d;
    HVD_RETURN_IF_ERROR(ToInts(counts, &c, &d));
    const size_t esize = DataTypeSize(dtype);
    seg_.resize(std::max<size_t>(1, counts[rank_] * esize));
    MPI_Datatype t = g_types[static_cast<int>(dtype)];
    HVD_RETURN_IF_ERROR(Check(MPI_Reduce_scatter(buf, seg_.data(), c.data(), t, OpOf(op), comm_),
                              "MPI_Reduce_scatter"));
    return Check(MPI_Allgatherv(seg_.data(), c[rank_], t, buf, c.data(), d.data(), t, comm_),
                 "MPI_Allgatherv");
  }

  Status Allgatherv(const void* send, void* recv, const std::vector<size_t>& bytes) override {
    std::vector<int> c, d;
    HVD_RETURN_IF_ERROR(ToInts(bytes, &c, &d));
    return Check(
        MPI_Allgatherv(send, c[rank_], MPI_BYTE, recv, c.data(), d.data(), MPI_BYTE, comm_),
        "MPI_Allgatherv");
  }

  Status Broadcast(void* buf, size_t bytes, int root) override {
    if (bytes > static_cast<size_t>(INT_MAX)) {
      return Status::InvalidArgument("the MPI transport broadcasts at most 2 GiB per op");
    }
    return Check(MPI_Bcast(buf, static_cast<int>(bytes), MPI_BYTE, root, comm_), "MPI_Bcast");
  }

  Status Transfer(void* buf, size_t bytes, int from, int to) override {
    if (bytes > static_cast<size_t>(INT_MAX)) {
      return Status::InvalidArgument("the MPI transport sends at most 2 GiB per op");
    }
    if (rank_ == from) {
      return Check(MPI_Send(buf, static_cast<int>(bytes), MPI_BYTE, to, 0, comm_), "MPI_Send");
    }
    return Check(
        MPI_Recv(buf, static_cast<int>(bytes), MPI_BYTE, from, 0, comm_, MPI_STATUS_IGNORE),
        "MPI_Recv");
  }

  Status Alltoallv(const void* send, const std::vector<size_t>& send_bytes, void* recv,
                   const std::vector<size_t>& recv_bytes) override {
    std::vector<int> sc, sd, rc, rd;
    HVD_RETURN_IF_ERROR(ToInts(send_bytes, &sc, &sd));
    HVD_RETURN_IF_ERROR(ToInts(recv_bytes, &rc, &rd));
    return Check(MPI_Alltoallv(send, sc.data(), sd.data(), MPI_BYTE, recv, rc.data(), rd.data(),
                               MPI_BYTE, comm_),
                 "MPI_Alltoallv");
  }

  Status Reducescatter(void* buf, const std::vector<size_t>& counts, DataType dtype, ReduceOp op,
                       void* out) override {
    std::vector<int> c, d;
    HVD_RETURN_IF_ERROR(ToInts(counts, &c, &d));
    return Check(
        MPI_Reduce_scatter(buf, out, c.data(), g_types[static_cast<int>(dtype)], OpOf(op), comm_),
        "MPI_Reduce_scatter");
  }

  void Abort() override {}

  Status Subset(const std::vector<int>& members, std::unique_ptr<Communicator>* out) override {
    bool in = std::find(members.begin(), members.end(), rank_) != members.end();
    MPI_Comm sub = MPI_COMM_NULL;
    HVD_RETURN_IF_ERROR(
        Check(MPI_Comm_split(comm_, in ? 0 : MPI_UNDEFINED, rank_, &sub), "MPI_Comm_split"));
    out->reset(sub == MPI_COMM_NULL ? nullptr : new MpiCommunicator(sub));
    return Status::Ok();
  }

 private:
  MPI_Comm comm_;
  int rank_ = 0;
  int size_ = 1;
  std::vector<char> seg_;
};

}  // namespace

bool MpiBuilt() { return true; }

Status MpiSetup(const std::vector<int>& ranks, int64_t fortran_handle, bool serialized,
                MpiWorld* world, std::unique_ptr<Communicator>* out) {
  int initialized = 0, provided = 0;
  MPI_Initialized(&initialized);
  if (!initialized) {
    const int wanted = serialized ? MPI_THREAD_SERIALIZED : MPI_THREAD_MULTIPLE;
    if (MPI_Init_thread(nullptr, nullptr, wanted, &provided) != MPI_SUCCESS) {
      return Status::Aborted("MPI_Init_thread failed");
    }
    if (!g_we_initialized) std::atexit(FinalizeAtExit);
    g_we_initialized = true;
  } else {
    MPI_Query_thread(&provided);
  }
  if (provided < MPI_THREAD_SERIALIZED) {
    return Status::InvalidArgument(
        "MPI was initialised without thread support (horovod_torch calls MPI from its "
        "background thread); initialise it with MPI_THREAD_MULTIPLE (mpi4py does by default)");
  }
  std::call_once(g_types_once, InitTypes);
  MPI_Comm base =
      fortran_handle != 0 ? MPI_Comm_f2c(static_cast<MPI_Fint>(fortran_handle)) : MPI_COMM_WORLD;
  MPI_Comm comm = MPI_COMM_NULL;
  if (!ranks.empty()) {
    int me = 0, n = 0;
    MPI_Comm_rank(MPI_COMM_WORLD, &me);
    MPI_Comm_size(MPI_COMM_WORLD, &n);
    for (int r : ranks) {
      if (r < 0 || r >= n) {
        return Status::InvalidArgument("init(comm=[...]): rank " + std::to_string(r) +
                                       " is not in MPI_COMM_WORLD of size " + std::to_string(n));
      }
    }
    bool in = std::find(ranks.begin(), ranks.end(), me) != ranks.end();
    HVD_RETURN_IF_ERROR(
        Check(MPI_Comm_split(MPI_COMM_WORLD, in ? 0 : MPI_UNDEFINED, me, &comm), "MPI_Comm_split"));
    if (comm == MPI_COMM_NULL) {
      return Status::InvalidArgument("init(comm=[...]): MPI_COMM_WORLD rank " + std::to_string(me) +
                                     " is not in the given ranks");
    }
  } else {
    HVD_RETURN_IF_ERROR(Check(MPI_Comm_dup(base, &comm), "MPI_Comm_dup"));
  }
  MPI_Comm local = MPI_COMM_NULL, cross = MPI_COMM_NULL;
  MpiWorld w;
  w.threads_supported = provided == MPI_THREAD_MULTIPLE;
  MPI_Comm_rank(comm, &w.rank);
  MPI_Comm_size(comm, &w.size);
  MPI_Comm_split_type(comm, MPI_COMM_TYPE_SHARED, w.rank, MPI_INFO_NULL, &local);
  MPI_Comm_rank(local, &w.local_rank);
  MPI_Comm_size(local, &w.local_size);
  MPI_Comm_split(comm, w.local_rank, w.rank, &cross);
  MPI_Comm_rank(cross, &w.cross_rank);
  MPI_Comm_size(cross, &w.cross_size);
  MPI_Comm_free(&local);
  MPI_Comm_free(&cross);
  out->reset(new MpiCommunicator(comm));
  *world = w;
  return Status::Ok();
}

}  // namespace hvd
