// Every tuning knob of the engine, declared once: name, environment variable, type,
// default and one sentence. Config::FromEnv() is the only place that reads them;
// docs/config.md is generated from this list (`python -m horovod_torch.config --markdown`).
#pragma once

#include <cstdint>
#include <string>

namespace hvd {

// X(member, ENV_NAME, type, default, description)
#define HVD_KNOBS(X)                                                                  \
  X(fusion_threshold_bytes, "HOROVOD_FUSION_THRESHOLD", int64_t, 64 * 1024 * 1024,    \
    "Largest fusion buffer in bytes; ready tensors are packed up to this size and "   \
    "reduced together (0 disables fusion).")                                          \
  X(cycle_time_ms, "HOROVOD_CYCLE_TIME", double, 1.0,                                 \
    "Longest time in milliseconds the background thread sleeps between "              \
    "negotiation cycles when no new request wakes it.")                               \
  X(wake_delay_us, "HOROVOD_WAKE_DELAY_US", double, 0.0,                              \
    "After a new request wakes the background thread, wait this many microseconds "  \
    "before negotiating, so requests arriving together are fused.")                  \
  X(spin_us, "HOROVOD_SPIN_US", double, -1.0,                                         \
    "After a cycle that ran work, poll for new requests this many microseconds "      \
    "before sleeping, and let a thread waiting for an op poll as long before it "     \
    "sleeps: lower latency for back-to-back ops at the cost of busy cores. -1: 100 "  \
    "when the process sees a CUDA device, else 0.")                                   \
  X(cache_capacity, "HOROVOD_CACHE_CAPACITY", int64_t, 1024,                          \
    "Number of responses kept in the response cache (0 disables the cache).")         \
  X(steady_exchange, "HOROVOD_STEADY_STATE_EXCHANGE", int64_t, 1,                     \
    "1: when every pending op is a cache hit, ranks exchange cache bits in one "      \
    "allgather instead of a gather and broadcast through rank 0 (0: always the latter).") \
  X(tcp_timeout_s, "HOROVOD_TCP_TIMEOUT", double, 60.0,                               \
    "Seconds a socket may make no progress during a collective before the peer is "   \
    "declared lost.")                                                                 \
  X(start_timeout_s, "HOROVOD_START_TIMEOUT", double, 30.0,                           \
    "Seconds init() waits for every rank to reach the rendezvous.")                   \
  X(small_allreduce_bytes, "HOROVOD_SMALL_ALLREDUCE_BYTES", int64_t, 64 * 1024,       \
    "Buffers up to this size use the latency-optimal allreduce; larger ones the "     \
    "bandwidth-optimal ring.")                                                        \
  X(ring_chunk_bytes, "HOROVOD_RING_CHUNK_BYTES", int64_t, 256 * 1024,                \
    "Pipelining chunk of the ring algorithms: reduction of one chunk overlaps the "   \
    "transfer of the next.")                                                          \
  X(hierarchical_allreduce, "HOROVOD_HIERARCHICAL_ALLREDUCE", int64_t, -1,           \
    "Allreduce, reducescatter and broadcast among the ranks of a host through shared " \
    "memory (across hosts: one rank per local index over TCP). -1: above "            \
    "HOROVOD_SMALL_ALLREDUCE_BYTES when a host has several ranks; 1: every size; 0: "  \
    "never (flat TCP).")                                                              \
  X(hierarchical_allgather, "HOROVOD_HIERARCHICAL_ALLGATHER", int64_t, -1,           \
    "Allgather through shared memory among the ranks of a host (across hosts of equal " \
    "size: one TCP allgather per local index, then through the segment). -1: above "  \
    "HOROVOD_SMALL_ALLREDUCE_BYTES; 1: every size; 0: never.")                        \
  X(shm_control, "HOROVOD_SHM_CONTROL", int64_t, 1,                                  \
    "1: when every rank is on one host and a HOROVOD_HIERARCHICAL_* knob is not 0, "   \
    "negotiation messages go through the shared-memory segment (a barrier instead of " \
    "TCP round trips); 0: always TCP.")                                               \
  X(shm_threads, "HOROVOD_SHM_THREADS", int64_t, -1,                                  \
    "Threads per rank that copy and reduce each shared-memory step of 256 KiB or "      \
    "more (the rank's own and helpers; one core's memory bandwidth bounds a copy). "   \
    "-1: CPUs available / (2 * local ranks), at most 4; 1: no helpers; at most 64.")    \
  X(batch_while_busy, "HOROVOD_BATCH_WHILE_BUSY", int64_t, 1,                          \
    "1: GPU allreduces that become ready while this rank's NCCL stream is moving "    \
    "data (not waiting for the backward pass) wait until it stops (at most 10 ms, "   \
    "until a fusion buffer's worth waits, or until a caller waits for any op), "      \
    "then go out fused; 0: negotiate at once.")                                        \
  X(native_grad_hooks, "HOROVOD_NATIVE_GRAD_HOOKS", int64_t, 1,                        \
    "1: DistributedOptimizer starts each gradient's allreduce from a C++ hook on the "  \
    "autograd thread (no Python, no GIL), unless it uses groups, Adasum or a custom "   \
    "compressor; 0: from a Python hook.")                                              \
  X(stall_check_s, "HOROVOD_STALL_CHECK_TIME_SECONDS", double, 60.0,                    \
    "Seconds a collective may wait for missing ranks before the coordinator logs "    \
    "which ranks are missing which tensors.")                                         \
  X(stall_shutdown_s, "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", double, 0.0,             \
    "If > 0, a collective stalled this long fails the job on every rank with the "    \
    "stall report instead of waiting forever.")                                       \
  X(log_level, "HOROVOD_LOG_LEVEL", std::string, "warning",                           \
    "Log verbosity: trace, debug, info, warning, error or fatal.")                    \
  X(log_hide_time, "HOROVOD_LOG_HIDE_TIME", int64_t, 0,                               \
    "1: log lines carry no timestamp (default: UTC time to the microsecond).")        \
  X(timeline, "HOROVOD_TIMELINE", std::string, "",                                    \
    "Path of a Chrome-trace JSON timeline the coordinator writes from init() on; "    \
    "DYNAMIC: none until hvd.start_timeline().")                                      \
  X(timeline_mark_cycles, "HOROVOD_TIMELINE_MARK_CYCLES", int64_t, 0,                 \
    "1: the timeline marks every negotiation cycle that ran work.")                   \
  X(autotune, "HOROVOD_AUTOTUNE", int64_t, 0,                                         \
    "1: the coordinator tunes fusion threshold, wake delay and response cache during " \
    "the first steps (Bayesian optimisation of bytes reduced per second), then keeps " \
    "the best.")                                                                      \
  X(autotune_log, "HOROVOD_AUTOTUNE_LOG", std::string, "",                            \
    "CSV file where the coordinator records every autotune sample and its score.")    \
  X(autotune_warmup_samples, "HOROVOD_AUTOTUNE_WARMUP_SAMPLES", int64_t, 3,           \
    "Autotune samples discarded at the start (caches and allocators warming up).")    \
  X(autotune_steps_per_sample, "HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE", int64_t, 10,      \
    "Cycles that reduce data per autotune sample.")                                  \
  X(autotune_bayes_opt_max_samples, "HOROVOD_AUTOTUNE_BAYES_OPT_MAX_SAMPLES", int64_t, \
    20, "Settings autotune scores before it keeps the best.")                         \
  X(autotune_gaussian_process_noise, "HOROVOD_AUTOTUNE_GAUSSIAN_PROCESS_NOISE",      \
    double, 0.8, "Noise (relative variance) the autotune Gaussian process assumes "   \
    "in scores.")

struct Config {
#define HVD_DECLARE_KNOB(member, env, type, def, doc) type member = def;
  HVD_KNOBS(HVD_DECLARE_KNOB)
#undef HVD_DECLARE_KNOB

  // Reads every knob from the environment; unset variables keep their defaults.
  // A value that does not parse is reported in *error and the default kept.
  static Config FromEnv(std::string* error);
};

}  // namespace hvd
