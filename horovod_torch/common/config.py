"""Every knob in one place. The engine's knobs come from the single C++ list
(csrc/common/config.h, exposed as ``_C.knobs()``); the launcher's variables are
listed here. ``python -m horovod_torch.config --markdown`` writes docs/config.md."""
import argparse
import os
import sys
from typing import Callable, Dict, List, NamedTuple, Optional, Tuple, TypeVar

# Variables horovodrun sets for each worker (or the user sets without it).
LAUNCHER_VARS: List[Tuple[str, str, str]] = [
    ("HOROVOD_RANK / HOROVOD_SIZE", "horovodrun", "This worker's rank and the job size."),
    ("HOROVOD_LOCAL_RANK / HOROVOD_LOCAL_SIZE", "horovodrun",
     "Rank among the workers on this host, and their number."),
    ("HOROVOD_CROSS_RANK / HOROVOD_CROSS_SIZE", "horovodrun",
     "Index of this host among hosts with a worker of this local rank, and their number."),
    ("HOROVOD_HOSTNAME", "horovodrun", "The host name this worker was placed on."),
    ("HOROVOD_STORE_ADDR / HOROVOD_STORE_PORT", "horovodrun",
     "Address of the rendezvous store the launcher runs."),
    ("HOROVOD_SECRET", "horovodrun", "Per-job secret authenticating store and mesh connections."),
    ("HOROVOD_ELASTIC", "--host-discovery-script", "1 in elastic jobs."),
    ("HOROVOD_ELASTIC_WORKER_ID", "elastic driver", "This worker's identity in the store."),
    ("HOROVOD_ELASTIC_TIMEOUT", "--elastic-timeout",
     "Seconds a worker waits for a new generation after a reset (default 600)."),
    ("HOROVOD_RENDEZVOUS_PREFIX", "(user)", "Store namespace of a static job (default 'job')."),
    ("HOROVOD_SSH_COMMAND", "--ssh-command",
     "Replaces ssh for starting workers on other hosts (a prefix; host and command follow)."),
    ("HOROVOD_CONTROLLER", "(user)",
     "mpi: run over MPI (default under mpirun in MPI builds); gloo: the TCP transport."),
    ("HOROVOD_DYNAMIC_PROCESS_SETS", "(user)",
     "1: allow hvd.add_process_set() / remove_process_set() after init."),
    ("HOROVOD_SPARK_START_TIMEOUT", "(user)",
     "Seconds horovod_torch.spark.run waits for all its tasks to start when not given "
     "start_timeout (default 600)."),
]


class KnobFlag(NamedTuple):
    """horovodrun option(s) that set one HOROVOD_* variable for every worker.

    A value option (``kind`` is int, float or str) sets the variable to its value
    times ``scale`` (MB -> bytes); a switch (``kind`` None) sets it to ``const``.
    Several entries may set the same variable (``--autotune`` / ``--no-autotune``):
    the last one given wins."""
    flags: Tuple[str, ...]
    env: str
    kind: Optional[type] = None
    metavar: str = ""
    scale: int = 1
    const: str = "1"
    help: str = ""


# Horovod's option names first; the later names of an entry are aliases. The launcher
# builds its options from this list (--start-timeout and --log-level it defines itself).
KNOB_FLAGS: List[KnobFlag] = [
    KnobFlag(("--fusion-threshold-mb",), "HOROVOD_FUSION_THRESHOLD", int, "MB", 1024 * 1024),
    KnobFlag(("--cycle-time-ms",), "HOROVOD_CYCLE_TIME", float, "MS"),
    KnobFlag(("--cache-capacity",), "HOROVOD_CACHE_CAPACITY", int, "N"),
    KnobFlag(("--hierarchical-allreduce",), "HOROVOD_HIERARCHICAL_ALLREDUCE", const="1"),
    KnobFlag(("--no-hierarchical-allreduce",), "HOROVOD_HIERARCHICAL_ALLREDUCE", const="0"),
    KnobFlag(("--hierarchical-allgather",), "HOROVOD_HIERARCHICAL_ALLGATHER", const="1"),
    KnobFlag(("--no-hierarchical-allgather",), "HOROVOD_HIERARCHICAL_ALLGATHER", const="0"),
    KnobFlag(("--torus-allreduce",), "HOROVOD_TORUS_ALLREDUCE", const="1"),
    KnobFlag(("--no-torus-allreduce",), "HOROVOD_TORUS_ALLREDUCE", const="0"),
    KnobFlag(("--autotune",), "HOROVOD_AUTOTUNE", const="1"),
    KnobFlag(("--no-autotune",), "HOROVOD_AUTOTUNE", const="0"),
    KnobFlag(("--autotune-log-file",), "HOROVOD_AUTOTUNE_LOG", str, "FILE"),
    KnobFlag(("--autotune-warmup-samples",), "HOROVOD_AUTOTUNE_WARMUP_SAMPLES", int, "N"),
    KnobFlag(("--autotune-steps-per-sample",), "HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE", int, "N"),
    KnobFlag(("--autotune-bayes-opt-max-samples",), "HOROVOD_AUTOTUNE_BAYES_OPT_MAX_SAMPLES",
             int, "N"),
    KnobFlag(("--autotune-gaussian-process-noise",), "HOROVOD_AUTOTUNE_GAUSSIAN_PROCESS_NOISE",
             float, "X"),
    KnobFlag(("--timeline-filename",), "HOROVOD_TIMELINE", str, "FILE"),
    KnobFlag(("--timeline-mark-cycles",), "HOROVOD_TIMELINE_MARK_CYCLES", const="1"),
    KnobFlag(("--no-timeline-mark-cycles",), "HOROVOD_TIMELINE_MARK_CYCLES", const="0"),
    KnobFlag(("--no-stall-check",), "HOROVOD_STALL_CHECK_DISABLE", const="1"),
    KnobFlag(("--stall-check",), "HOROVOD_STALL_CHECK_DISABLE", const="0"),
    KnobFlag(("--stall-check-warning-time-seconds", "--stall-check-time-seconds"),
             "HOROVOD_STALL_CHECK_TIME_SECONDS", float, "S"),
    KnobFlag(("--stall-check-shutdown-time-seconds", "--stall-shutdown-time-seconds"),
             "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", float, "S"),
    KnobFlag(("--mpi-threads-disable",), "HOROVOD_MPI_THREADS_DISABLE", const="1"),
    KnobFlag(("--no-mpi-threads-disable",), "HOROVOD_MPI_THREADS_DISABLE", const="0"),
    KnobFlag(("--num-nccl-streams",), "HOROVOD_NUM_NCCL_STREAMS", int, "N"),
    KnobFlag(("--thread-affinity",), "HOROVOD_THREAD_AFFINITY", int, "CPU"),
    KnobFlag(("--gloo-timeout-seconds",), "HOROVOD_GLOO_TIMEOUT_SECONDS", int, "S"),
    KnobFlag(("--tcp",), "NCCL_IB_DISABLE", const="1",
             help="use TCP only: sets NCCL_IB_DISABLE=1 (NCCL leaves InfiniBand alone)"),
    KnobFlag(("--log-without-timestamp", "--log-hide-timestamp"), "HOROVOD_LOG_HIDE_TIME",
             const="1"),
    KnobFlag(("--log-with-timestamp", "--no-log-hide-timestamp"), "HOROVOD_LOG_HIDE_TIME",
             const="0"),
    KnobFlag(("--log-level",), "HOROVOD_LOG_LEVEL", str, "LEVEL"),
    KnobFlag(("--start-timeout",), "HOROVOD_START_TIMEOUT", int, "S"),
]


# HOROVOD_START_TIMEOUT is an engine knob (csrc/common/config.h holds its default and
# its line of docs/config.md), and the Python side reads it too, before or without the
# engine: horovodrun's default for --start-timeout, the job-secret exchange of init(),
# the store clients of elastic workers and of horovod_torch.runner.run's workers.
START_TIMEOUT_ENV = "HOROVOD_START_TIMEOUT"
DEFAULT_START_TIMEOUT_S = 30  # = start_timeout_s's default in csrc/common/config.h

_T = TypeVar("_T", int, float)


def start_timeout_s(parse: Callable[[str], _T] = float, lenient: bool = False) -> _T:
    """Seconds to wait for the start and rendezvous: $HOROVOD_START_TIMEOUT parsed by
    `parse`, or DEFAULT_START_TIMEOUT_S when unset or empty (as the engine reads it).
    A value `parse` refuses raises its ValueError, or with `lenient` gives the default
    (init() then reports the value when the engine reads its knobs)."""
    value = os.environ.get(START_TIMEOUT_ENV)
    if value:
        try:
            return parse(value)
        except ValueError:
            if not lenient:
                raise
    return parse(str(DEFAULT_START_TIMEOUT_S))


SPARK_START_TIMEOUT_ENV = "HOROVOD_SPARK_START_TIMEOUT"
DEFAULT_SPARK_START_TIMEOUT_S = 600.0


def spark_start_timeout_s() -> float:
    """$HOROVOD_SPARK_START_TIMEOUT in seconds (DEFAULT_SPARK_START_TIMEOUT_S when unset or
    empty); a value that is not a number raises ValueError naming the variable."""
    value = os.environ.get(SPARK_START_TIMEOUT_ENV)
    if not value:
        return DEFAULT_SPARK_START_TIMEOUT_S
    try:
        return float(value)
    except ValueError:
        raise ValueError(f"environment variable {SPARK_START_TIMEOUT_ENV}={value!r} is not "
                         "a number of seconds") from None


def knob_flags(env: str) -> List[str]:
    """The horovodrun options that set `env` (with their metavar), in KNOB_FLAGS order."""
    return [k.flags[0] + (f" {k.metavar}" if k.metavar else "")
            for k in KNOB_FLAGS if k.env == env]


# Variables horovodrun sets from Horovod's options although the engine does not read
# them (Horovod's own knobs); markdown() lists those the compiled engine lacks.
PASSED_THROUGH: Dict[str, str] = {
    "HOROVOD_TORUS_ALLREDUCE": "Horovod's 2D torus allreduce through NCCL (1 / 0).",
    "HOROVOD_STALL_CHECK_DISABLE": "Horovod: 1 turns the stall check off.",
    "HOROVOD_MPI_THREADS_DISABLE": "Horovod: 1 initialises MPI without thread support.",
    "HOROVOD_NUM_NCCL_STREAMS": "Horovod: number of NCCL streams per device.",
    "HOROVOD_THREAD_AFFINITY": "Horovod: core the background thread is pinned to.",
    "HOROVOD_GLOO_TIMEOUT_SECONDS": "Horovod: timeout of Gloo operations (nearest knob here: "
                                    "HOROVOD_TCP_TIMEOUT).",
    "NCCL_IB_DISABLE": "Read by NCCL itself: 1 keeps NCCL off InfiniBand.",
}


def knobs() -> List[Tuple[str, str, object, str, str]]:
    """(environment variable, type, default, meaning, values allowed in words or "")
    of every engine knob."""
    from horovod_torch import _C
    return [tuple(k) for k in _C.knobs()]


def markdown() -> str:
    lines = ["# Configuration", "",
             "Generated by `python -m horovod_torch.config --markdown` from the single list "
             "of knobs in `csrc/common/config.h`; do not edit by hand.", "",
             "## Engine knobs (read once, at `hvd.init()`)", "",
             "| variable | horovodrun flag | type | allowed | default | meaning |",
             "| --- | --- | --- | --- | --- | --- |"]
    for env, typ, default, doc, allowed in knobs():
        typ = {"int64_t": "integer", "double": "number", "std::string": "string"}.get(typ, typ)
        flag = " / ".join(f"`{f}`" for f in knob_flags(env))
        lines.append(f"| `{env}` | {flag} | {typ} | {allowed} | `{default}` | {doc} |")
    engine = {k[0] for k in knobs()}
    passed = [env for env in dict.fromkeys(k.env for k in KNOB_FLAGS) if env not in engine]
    if passed:
        lines += ["", "## Passed through for Horovod's options", "",
                  "`horovodrun` sets these for every worker when given Horovod's option, "
                  "like Horovod does; this build's engine does not read them.", "",
                  "| variable | horovodrun flag | meaning |", "| --- | --- | --- |"]
        for env in passed:
            flag = " / ".join(f"`{f}`" for f in knob_flags(env))
            lines.append(f"| `{env}` | {flag} | {PASSED_THROUGH.get(env, '')} |")
    lines += ["", "## Set by the launcher", "",
              "| variable | set from | meaning |", "| --- | --- | --- |"]
    for env, flag, doc in LAUNCHER_VARS:
        lines.append(f"| `{env}` | `{flag}` | {doc} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--markdown", action="store_true", help="print docs/config.md")
    args = p.parse_args(argv)
    if args.markdown:
        sys.stdout.write(markdown())
    else:
        for env, typ, default, doc, allowed in knobs():
            print(f"{env}={default}  # {doc}" + (f" Allowed: {allowed}." if allowed else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
