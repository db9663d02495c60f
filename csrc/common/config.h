// Every tuning knob of the engine, declared once: name, environment variable, type,
// default and one sentence. Config::FromEnv() is the only place that reads them;
// docs/config.md is generated from this list (`python -m horovod_torch.config --markdown`).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace hvd {

// X(member, ENV_NAME, type, default, description)
// clang-format off: the table is aligned by hand
#define HVD_KNOBS(X)                                                                         \
  X(fusion_threshold_bytes, "HOROVOD_FUSION_THRESHOLD", int64_t, 64 * 1024 * 1024,           \
    "Largest fusion buffer in bytes; ready tensors are packed up to this size and "          \
    "reduced together (0 disables fusion).")                                                 \
  X(cycle_time_ms, "HOROVOD_CYCLE_TIME", double, 1.0,                                        \
    "Longest time in milliseconds the background thread sleeps between "                     \
    "negotiation cycles when no new request wakes it.")                                      \
  X(wake_delay_us, "HOROVOD_WAKE_DELAY_US", double, 0.0,                                     \
    "After a new request wakes the background thread, wait this many microseconds "          \
    "before negotiating, so requests arriving together are fused.")                          \
  X(spin_us, "HOROVOD_SPIN_US", double, -1.0,                                                \
    "After a cycle that ran work, poll for new requests this many microseconds "             \
    "before sleeping, and let a thread waiting for an op poll as long before it "            \
    "sleeps: lower latency for back-to-back ops at the cost of busy cores. -1: 100 "         \
    "once the process has submitted a CUDA tensor, else 0.")                                 \
  X(cache_capacity, "HOROVOD_CACHE_CAPACITY", int64_t, 1024,                                 \
    "Number of responses kept in the response cache (0 disables the cache).")                \
  X(steady_exchange, "HOROVOD_STEADY_STATE_EXCHANGE", int64_t, 1,                            \
    "1: when every pending op is a cache hit, ranks exchange cache bits in one "             \
    "allgather instead of a gather and broadcast through rank 0 (0: always the latter).")    \
  X(tcp_timeout_s, "HOROVOD_TCP_TIMEOUT", double, 60.0,                                      \
    "Seconds a socket may make no progress during a collective before the peer is "          \
    "declared lost.")                                                                        \
  X(gpu_op_timeout_s, "HOROVOD_GPU_OP_TIMEOUT", double, 600.0,                               \
    "Seconds an NCCL collective may run on this rank's GPU without finishing before "        \
    "its communicator is aborted and the job fails with HorovodInternalError (a peer's "     \
    "GPU never joined it); 0: no limit. A peer that stops answering is found sooner, "       \
    "after HOROVOD_TCP_TIMEOUT.")                                                            \
  X(start_timeout_s, "HOROVOD_START_TIMEOUT", double, 30.0,                                  \
    "Seconds init() waits for every rank to reach the rendezvous.")                          \
  X(small_allreduce_bytes, "HOROVOD_SMALL_ALLREDUCE_BYTES", int64_t, 64 * 1024,              \
    "Buffers up to this size use the latency-optimal allreduce; larger ones the "            \
    "bandwidth-optimal ring.")                                                               \
  X(ring_chunk_bytes, "HOROVOD_RING_CHUNK_BYTES", int64_t, 256 * 1024,                       \
    "Pipelining chunk of the ring algorithms: reduction of one chunk overlaps the "          \
    "transfer of the next.")                                                                 \
  X(hierarchical_allreduce, "HOROVOD_HIERARCHICAL_ALLREDUCE", int64_t, -1,                   \
    "Allreduce, reducescatter and broadcast among the ranks of a host through shared "       \
    "memory (across hosts: one rank per local index over TCP). -1: above "                   \
    "HOROVOD_SMALL_ALLREDUCE_BYTES when a host has several ranks; 1: every size; 0: "        \
    "never (flat TCP).")                                                                     \
  X(hierarchical_allgather, "HOROVOD_HIERARCHICAL_ALLGATHER", int64_t, -1,                   \
    "Allgather through shared memory among the ranks of a host (across hosts of equal "      \
    "size: one TCP allgather per local index, then through the segment). -1: above "         \
    "HOROVOD_SMALL_ALLREDUCE_BYTES; 1: every size; 0: never.")                               \
  X(shm_control, "HOROVOD_SHM_CONTROL", int64_t, 1,                                          \
    "1: when every rank is on one host and a HOROVOD_HIERARCHICAL_* knob is not 0, "         \
    "negotiation messages go through the shared-memory segment (a barrier instead of "       \
    "TCP round trips); 0: always TCP.")                                                      \
  X(shm_threads, "HOROVOD_SHM_THREADS", int64_t, -1,                                         \
    "Threads per rank that copy and reduce each shared-memory step of 256 KiB or "           \
    "more (the rank's own and helpers; one core's memory bandwidth bounds a copy). "         \
    "-1: CPUs available / (2 * local ranks), at most 4; 1: no helpers; at most 64.")         \
  X(batch_while_busy, "HOROVOD_BATCH_WHILE_BUSY", int64_t, 1,                                \
    "1: GPU allreduces that become ready while this rank's NCCL stream is moving "           \
    "data (not waiting for the backward pass) wait until it stops (at most 10 ms, "          \
    "until a fusion buffer's worth waits, or until a caller waits for any op), "             \
    "then go out fused; 0: negotiate at once.")                                              \
  X(native_grad_hooks, "HOROVOD_NATIVE_GRAD_HOOKS", int64_t, 1,                              \
    "1: DistributedOptimizer starts each gradient's allreduce from a C++ hook on the "       \
    "autograd thread (no Python, no GIL), unless it uses groups, Adasum or a custom "        \
    "compressor; 0: from a Python hook.")                                                    \
  X(c10d_cuda_direct, "HOROVOD_C10D_CUDA_DIRECT", int64_t, 1,                                \
    "1: the torch.distributed backend \"hvd\" enqueues its all-reduces, broadcasts, "        \
    "all-gathers into a tensor and reduce-scatters of CUDA tensors itself, in the "          \
    "group's call order, on an NCCL communicator of the group's own (as torch's NCCL "       \
    "group does: Work.wait() only makes the stream wait); 0: as ops of the engine, "         \
    "negotiated and fused, wait() blocking the host until they ran.")                        \
  X(stall_check_s, "HOROVOD_STALL_CHECK_TIME_SECONDS", double, 60.0,                         \
    "Seconds a collective may wait for missing ranks before the coordinator logs "           \
    "which ranks are missing which tensors.")                                                \
  X(stall_shutdown_s, "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", double, 600.0,                  \
    "A collective stalled this long (some ranks never submitted it) fails the job on "       \
    "every rank with the stall report, as torch.distributed's 10-minute timeout "            \
    "does; 0 waits forever.")                                                                \
  X(straggler_check, "HOROVOD_STRAGGLER_CHECK", int64_t, 1,                                  \
    "1: the coordinator measures how late each rank's requests arrive, and how much "        \
    "less time its NCCL allreduces take on the GPU than the others' (the others "            \
    "waited for it), and names a rank that persistently lags (hvd.straggler_report(), "      \
    "one warning on rank 0, timeline counters); 0: no measurement.")                         \
  X(straggler_gpu_timing, "HOROVOD_STRAGGLER_GPU_TIMING", int64_t, 1,                        \
    "With HOROVOD_STRAGGLER_CHECK=1: 1 times each NCCL allreduce on the GPU (two timing "    \
    "events per op) for the straggler report's GPU signal, which names a slow GPU; 0 "       \
    "keeps only the requests' lateness and saves about 4 us per allreduce.")                 \
  X(straggler_window, "HOROVOD_STRAGGLER_WINDOW", int64_t, 64,                               \
    "Negotiation cycles that completed ops kept for the straggler report (a rolling "        \
    "window); a rank is judged once a quarter of it (at least 8) has filled.")               \
  X(straggler_lag, "HOROVOD_STRAGGLER_LAG", double, 0.1,                                     \
    "Straggler threshold as a fraction of the step time: a rank is named when its "          \
    "median lateness reaches this fraction (and HOROVOD_STRAGGLER_MIN_LAG_MS) and it "       \
    "was the last rank in more than HOROVOD_STRAGGLER_SHARE of the window's cycles.")        \
  X(straggler_min_lag_ms, "HOROVOD_STRAGGLER_MIN_LAG_MS", double, 5.0,                       \
    "Smallest median lateness in milliseconds for which a rank is named a straggler; a "     \
    "wait for an op this long records its Python caller for the report.")                    \
  X(straggler_share, "HOROVOD_STRAGGLER_SHARE", double, 0.5,                                 \
    "A straggler was the last rank in more than this share of the window's cycles.")         \
  X(log_level, "HOROVOD_LOG_LEVEL", std::string, "warning",                                  \
    "Log verbosity: trace, debug, info, warning, error or fatal.")                           \
  X(log_hide_time, "HOROVOD_LOG_HIDE_TIME", int64_t, 0,                                      \
    "1: log lines carry no timestamp (default: UTC time to the microsecond).")               \
  X(timeline, "HOROVOD_TIMELINE", std::string, "",                                           \
    "Path of a Chrome-trace JSON timeline the coordinator writes from init() on; "           \
    "DYNAMIC: none until hvd.start_timeline().")                                             \
  X(timeline_mark_cycles, "HOROVOD_TIMELINE_MARK_CYCLES", int64_t, 0,                        \
    "1: the timeline marks every negotiation cycle that ran work.")                          \
  X(autotune, "HOROVOD_AUTOTUNE", int64_t, 0,                                                \
    "1: the coordinator tunes fusion threshold, wake delay and response cache during "       \
    "the first steps (Bayesian optimisation of bytes reduced per second), then keeps "       \
    "the best.")                                                                             \
  X(autotune_log, "HOROVOD_AUTOTUNE_LOG", std::string, "",                                   \
    "CSV file where the coordinator records every autotune sample and its score.")           \
  X(autotune_warmup_samples, "HOROVOD_AUTOTUNE_WARMUP_SAMPLES", int64_t, 3,                  \
    "Autotune samples discarded at the start (caches and allocators warming up).")           \
  X(autotune_steps_per_sample, "HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE", int64_t, 10,             \
    "Cycles that reduce data per autotune sample.")                                          \
  X(autotune_bayes_opt_max_samples, "HOROVOD_AUTOTUNE_BAYES_OPT_MAX_SAMPLES", int64_t, 20,   \
    "Settings autotune scores before it keeps the best.")                                    \
  X(autotune_gaussian_process_noise, "HOROVOD_AUTOTUNE_GAUSSIAN_PROCESS_NOISE", double, 0.8, \
    "Noise (relative variance) the autotune Gaussian process assumes "                       \
    "in scores.")                                                                            \
  X(stall_check_disable, "HOROVOD_STALL_CHECK_DISABLE", int64_t, 0,                          \
    "Horovod's switch: 1 turns the stall check off (no stall report, no stall "              \
    "shutdown).")                                                                            \
  X(gloo_timeout_s, "HOROVOD_GLOO_TIMEOUT_SECONDS", double, 0.0,                             \
    "Horovod's Gloo timeout: if > 0, it replaces HOROVOD_TCP_TIMEOUT and "                   \
    "HOROVOD_START_TIMEOUT (how long a silent peer is waited for).")                         \
  X(thread_affinity, "HOROVOD_THREAD_AFFINITY", std::string, "",                             \
    "CPU core of the background thread: one core for every rank, or a comma-"                \
    "separated list with one core per local rank (Horovod's format).")                       \
  X(mpi_threads_disable, "HOROVOD_MPI_THREADS_DISABLE", int64_t, 0,                          \
    "1: horovod_torch initialises MPI with MPI_THREAD_SERIALIZED instead of "                \
    "MPI_THREAD_MULTIPLE (the script must then not call MPI itself).")                       \
  X(torus_allreduce, "HOROVOD_TORUS_ALLREDUCE", int64_t, 0,                                  \
    "Horovod's 2D torus allreduce: 1 selects this engine's two-level (host, then "           \
    "across hosts) allreduce, as HOROVOD_HIERARCHICAL_ALLREDUCE=1 does.")                    \
  X(disable_group_fusion, "HOROVOD_DISABLE_GROUP_FUSION", int64_t, 0,                        \
    "1: the tensors of a grouped op are fused only with each other, never with "             \
    "other ops.")                                                                            \
  X(num_nccl_streams, "HOROVOD_NUM_NCCL_STREAMS", int64_t, 1,                                \
    "Accepted for Horovod's scripts; the NCCL backend runs one stream per device "           \
    "(docs/design.md section 8), so other values change nothing.")                           \
  X(enable_async_completion, "HOROVOD_ENABLE_ASYNC_COMPLETION", int64_t, 0,                  \
    "Accepted for Horovod's scripts; GPU ops always complete asynchronously here "           \
    "(the caller's stream waits for an event, the host does not).")
// clang-format on

struct Config {
#define HVD_DECLARE_KNOB(member, env, type, def, doc) type member = def;
  HVD_KNOBS(HVD_DECLARE_KNOB)
#undef HVD_DECLARE_KNOB

  // Reads every knob from the environment; unset variables keep their defaults.
  // A value that does not parse, or is outside what its knob allows (KnobAllowed),
  // is reported in *error and the default kept.
  static Config FromEnv(std::string* error);

  // The knobs every rank must set alike (they choose the wire protocol or the
  // algorithm), one "NAME=value" a line. A per-host environment difference in one of
  // these would give wrong results or a hang; init() compares them instead.
  std::string ProtocolSettings() const;
};

// The values numeric knob `env` allows, in words ("> 0", "-1, 0 or 1"), or "" when
// any value of its type will do; KnobAllows says whether `value` is one of them.
std::string KnobAllowed(const std::string& env);
bool KnobAllows(const std::string& env, double value);

// "" if every rank's ProtocolSettings() (index: rank) equals rank 0's; else a message
// that names each knob that differs and the ranks' values.
std::string SettingsDisagreement(const std::vector<std::string>& per_rank);

}  // namespace hvd
