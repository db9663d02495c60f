"""horovodrun's options and what they set: the parser (every option of Horovod's
horovodrun, with its abbreviations, and a few more: EXTENSION_OPTIONS), Horovod's YAML
--config-file, and the engine-knob variables the options give the workers (knob_env).
args.py checks and completes what the parser read; launch.py starts the job.
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Dict, NoReturn, Optional, Sequence, Tuple

from horovod_torch.common import config, extras
from horovod_torch.runner import output

LOG_LEVELS = ("TRACE", "DEBUG", "INFO", "WARNING", "ERROR", "FATAL")
# Defined by make_parser itself, with their own checks; listed in config.KNOB_FLAGS
# for docs/config.md.
OWN_KNOB_OPTIONS = ("--start-timeout", "--log-level")

EXTENSION_OPTIONS = frozenset({
    "--nics", "--ssh-command", "--disable-prefix", "--slots",
    "--stall-check-time-seconds", "--stall-shutdown-time-seconds"})
"""Options of horovod_torch's horovodrun that Horovod's has not. An abbreviation that
could also mean one of Horovod's options means Horovod's (``--disable`` is
``--disable-cache``, as it is for Horovod)."""


class _Parser(argparse.ArgumentParser):
    """ArgumentParser whose errors are a single line on stderr (or a ValueError,
    for :func:`horovod_torch.runner.run`), which accepts unambiguous abbreviations
    like Horovod's, and which never reads the worker command as its own options."""

    raise_errors = False

    def error(self, message: str) -> NoReturn:
        """Print ``horovodrun: error: ...`` and exit with status 2."""
        if self.raise_errors:
            raise ValueError(message)
        self.exit(2, f"{self.prog}: error: {message} "
                     f"(see '{self.prog} --help')\n")

    def _get_option_tuples(self, option_string):  # type: ignore[override]
        """Abbreviations: one option reached through several of its names
        (``--min`` for ``--min-np`` / ``--min-num-proc``) is not ambiguous, and
        Horovod's options win over EXTENSION_OPTIONS."""
        by_action: Dict[int, list] = {}
        for tup in super()._get_option_tuples(option_string):
            by_action.setdefault(id(tup[0]), []).append(tup)
        if len(by_action) > 1:
            horovods = {k: v for k, v in by_action.items()
                        if any(t[1] not in EXTENSION_OPTIONS for t in v)}
            if len(horovods) == 1:
                by_action = horovods
        return [tups[0] for tups in by_action.values()]

    def command_start(self, argv: Sequence[str]) -> int:
        """Index of the first word of the worker command in ``argv`` (or of ``--``):
        the first word that is neither an option nor an option's value. The words
        after it are not parsed: a worker's ``--lr`` is never taken as ours."""
        i = 0
        while i < len(argv):
            word = argv[i]
            if word == "--":
                return i
            found = self._parse_optional(word)
            if found is None:
                return i
            if isinstance(found, list):  # Python >= 3.12.7: every reading of it
                found = found[0]
            action, explicit = found[0], found[-1]
            i += 1
            if action is None or explicit is not None:
                continue  # unknown (argparse reports it) or --opt=value
            if action.nargs is None:
                i += 1
            elif isinstance(action.nargs, int):
                i += action.nargs
        return len(argv)


class _VersionAction(argparse.Action):
    """``-v/--version``: print the version and exit (looked up only when asked)."""

    def __init__(self, option_strings, dest=argparse.SUPPRESS, help=None):
        super().__init__(option_strings, dest, default=argparse.SUPPRESS, nargs=0, help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        import horovod  # pylint: disable=import-outside-toplevel
        import horovod_torch  # pylint: disable=import-outside-toplevel
        ours = getattr(horovod_torch, "__version__", "unknown")
        sys.stdout.write(f"{ours} (horovod_torch; implements the Horovod "
                         f"{horovod.__version__} API)\n")
        sys.stdout.flush()
        parser.exit(0)


class _NicsAction(argparse.Action):
    """--network-interface(s)/--nics: repeatable; the names add up (comma lists too)."""

    def __call__(self, parser, namespace, values, option_string=None):
        previous = getattr(namespace, self.dest, None)
        setattr(namespace, self.dest, f"{previous},{values}" if previous else values)


def knob_dest(env: str) -> str:
    return "env_" + env


def make_parser() -> argparse.ArgumentParser:
    """Build the ``horovodrun`` argument parser: Horovod's options, and a few more
    (EXTENSION_OPTIONS). Options that have no effect here are accepted; parse_args
    says so once on stderr."""
    parser = _Parser(
        prog="horovodrun", allow_abbrev=True,
        description="Launch a horovod_torch training job on this machine or on "
                    "several hosts (started over ssh).")
    parser.add_argument("-v", "--version", action=_VersionAction,
                        help="print the version of horovod_torch (and of the Horovod API it "
                             "implements) and exit")
    parser.add_argument(
        "-np", "--num-proc", dest="num_proc", type=int, metavar="N",
        help="total number of worker processes (required; in elastic mode the number "
             "to start with)")
    parser.add_argument(
        "-cb", "--check-build", dest="check_build", action="store_true",
        help="show which frameworks, controllers and tensor operations "
             "this build supports, then exit")
    parser.add_argument(
        "--start-timeout", dest="start_timeout", type=int, metavar="S",
        help="seconds workers wait for rendezvous (default: "
             f"$HOROVOD_START_TIMEOUT or {config.DEFAULT_START_TIMEOUT_S})")
    parser.add_argument(
        "--network-interfaces", "--network-interface", "--nics", dest="nics",
        action=_NicsAction, metavar="IFACE[,IFACE]",
        help="interface(s) for the rendezvous store and the workers' TCP mesh "
             "(repeatable); the store listens on the first one's IPv4 address (default: "
             "the route to the first remote host, or 127.0.0.1 with local hosts only)")
    parser.add_argument(
        "--output-filename", dest="output_filename", metavar="DIR",
        help="also write each worker's output to DIR/rank.<rank>/stdout and stderr")
    parser.add_argument(
        "--verbose", action="store_true",
        help="print the rank assignment and store address to stderr")
    parser.add_argument(
        "--config-file", dest="config_file", metavar="FILE",
        help="YAML file of engine settings in Horovod's format (sections params, "
             "autotune, timeline, stall_check, library_options, logging, and "
             "controller); options given on the command line win")
    parser.add_argument(
        "--disable-cache", dest="disable_cache", action="store_true",
        help="accepted for Horovod compatibility (horovodrun caches nothing)")
    parser.add_argument(
        "--disable-prefix", dest="disable_prefix", action="store_true",
        help="do not prefix worker output lines with [rank]<stdout>:")
    parser.add_argument(
        "-prefix-timestamp", "--prefix-output-with-timestamp", dest="prefix_timestamp",
        action="store_true", help="start every line of worker output with the time")

    hosts_group = parser.add_argument_group("hosts")
    hosts_group.add_argument(
        "-H", "--hosts", dest="hosts", metavar="HOST:SLOTS[,...]",
        help="hosts and their slot counts, e.g. host1:4,host2:4; ranks fill the "
             "hosts in this order (default: localhost:N)")
    hosts_group.add_argument(
        "-hostfile", "--hostfile", dest="hostfile", metavar="FILE",
        help="file of hosts, one a line: 'host slots=N' or 'host:N' (# comments)")
    hosts_group.add_argument(
        "--host-discovery-script", dest="discovery", metavar="PATH",
        help="executable printing the available hosts as host:slots lines; "
             "enables elastic mode")

    ssh = parser.add_argument_group("ssh")
    ssh.add_argument(
        "-p", "--ssh-port", dest="ssh_port", type=int, metavar="PORT",
        help="port of sshd on the remote hosts")
    ssh.add_argument(
        "-i", "--ssh-identity-file", dest="ssh_identity_file", metavar="FILE",
        help="private key ssh uses to log in to the remote hosts")
    ssh.add_argument(
        "--ssh-command", dest="ssh_command", metavar="CMD",
        default=os.environ.get("HOROVOD_SSH_COMMAND") or None,
        help="command that replaces ssh to run workers on remote hosts, called as "
             "CMD HOST 'SHELL COMMAND' with the session's stdin connected "
             "(default: $HOROVOD_SSH_COMMAND, else 'ssh -o BatchMode=yes -o "
             "StrictHostKeyChecking=no')")

    controller = parser.add_argument_group("controller")
    controller.add_argument(
        "--gloo", dest="use_gloo", action="store_true",
        help="run over the TCP transport (Horovod's Gloo controller; the default)")
    controller.add_argument(
        "--mpi", dest="use_mpi", action="store_true",
        help="start the workers with OpenMPI's mpirun; they run over MPI "
             "(needs a build with MPI)")
    controller.add_argument(
        "--jsrun", dest="use_jsrun", action="store_true",
        help="accepted for Horovod compatibility; IBM's jsrun is not supported and "
             "the workers start as without it")
    controller.add_argument(
        "--mpi-args", dest="mpi_args", default="", metavar="ARGS",
        help="extra arguments for mpirun, e.g. \"--mca btl self,tcp\"")
    controller.add_argument(
        "--binding-args", dest="binding_args", metavar="ARGS",
        help="with --mpi: mpirun's process binding arguments (default: --bind-to none)")

    knobs = parser.add_argument_group(
        "engine knobs", "each sets a variable for every worker (docs/config.md)")
    for knob in config.KNOB_FLAGS:
        if knob.flags[0] in OWN_KNOB_OPTIONS:
            continue
        dest = knob_dest(knob.env)
        if knob.kind is None:
            knobs.add_argument(*knob.flags, dest=dest, action="store_const",
                               const=knob.const,
                               help=knob.help or f"sets {knob.env}={knob.const}")
        else:
            scaled = f" to {knob.metavar} * {knob.scale}" if knob.scale != 1 else ""
            knobs.add_argument(*knob.flags, dest=dest, type=knob.kind, metavar=knob.metavar,
                               help=knob.help or f"sets {knob.env}{scaled}")
    knobs.add_argument(
        "--log-level", dest="log_level", type=str.upper, choices=LOG_LEVELS,
        metavar="LEVEL",
        help="set HOROVOD_LOG_LEVEL for workers: " + ", ".join(LOG_LEVELS))

    elastic = parser.add_argument_group(
        "elastic mode", "on with --host-discovery-script or --min-np (then -H, --hostfile "
        "or localhost are the fixed hosts)")
    elastic.add_argument("--min-np", "--min-num-proc", dest="min_np", type=int, metavar="N",
                         help="fewest workers the job may run with")
    elastic.add_argument("--max-np", "--max-num-proc", dest="max_np", type=int, metavar="N",
                         help="most workers the job may grow to")
    elastic.add_argument("--slots-per-host", "--slots", dest="slots_per_host", type=int, default=1,
                         metavar="K",
                         help="slots of a discovered host that prints no count (default 1)")
    elastic.add_argument("--reset-limit", dest="reset_limit", type=int, default=None,
                         metavar="L", help="stop rather than re-form the job more than L "
                                           "times (default: no limit)")
    elastic.add_argument("--blacklist-cooldown-range", dest="cooldown", type=float, nargs=2,
                         metavar=("LO", "HI"),
                         help="a failed host may be used again after a random LO..HI "
                              "seconds (default: never)")
    elastic.add_argument("--elastic-timeout", dest="elastic_timeout", type=float,
                         default=None, metavar="T",
                         help="seconds to wait for enough workers (default: "
                              "$HOROVOD_ELASTIC_TIMEOUT or 600)")
    elastic.add_argument("--straggler-policy", dest="straggler_policy",
                         choices=("report", "evict"), default="report",
                         help="report (default): a persistent straggler is named in the log "
                              "and hvd.straggler_report(); evict: its host is also removed "
                              "from the job as a failed host is (back after the blacklist "
                              "cool-down), never below --min-np")
    elastic.add_argument("--straggler-evict-after", dest="straggler_evict_after", type=float,
                         default=30.0, metavar="S",
                         help="with --straggler-policy evict: seconds the same rank must stay "
                              "named a straggler before its host is evicted (default 30)")
    parser.add_argument(
        "command", nargs=argparse.REMAINDER,
        help="command to run in every worker, e.g. python train.py")
    return parser


# --config-file: Horovod's YAML sections and keys -> (variable, how a value becomes
# the variable's value: "value" as given (converted like the option), "bool" 1/0,
# "not" 0/1).
_CONFIG_KEYS: Dict[Tuple[str, str], Tuple[str, str]] = {
    ("params", "fusion_threshold_mb"): ("HOROVOD_FUSION_THRESHOLD", "value"),
    ("params", "cycle_time_ms"): ("HOROVOD_CYCLE_TIME", "value"),
    ("params", "cache_capacity"): ("HOROVOD_CACHE_CAPACITY", "value"),
    ("params", "hierarchical_allreduce"): ("HOROVOD_HIERARCHICAL_ALLREDUCE", "bool"),
    ("params", "hierarchical_allgather"): ("HOROVOD_HIERARCHICAL_ALLGATHER", "bool"),
    ("params", "torus_allreduce"): ("HOROVOD_TORUS_ALLREDUCE", "bool"),
    ("autotune", "enabled"): ("HOROVOD_AUTOTUNE", "bool"),
    ("autotune", "log_file"): ("HOROVOD_AUTOTUNE_LOG", "value"),
    ("autotune", "warmup_samples"): ("HOROVOD_AUTOTUNE_WARMUP_SAMPLES", "value"),
    ("autotune", "steps_per_sample"): ("HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE", "value"),
    ("autotune", "bayes_opt_max_samples"): ("HOROVOD_AUTOTUNE_BAYES_OPT_MAX_SAMPLES", "value"),
    ("autotune", "gaussian_process_noise"): ("HOROVOD_AUTOTUNE_GAUSSIAN_PROCESS_NOISE",
                                             "value"),
    ("timeline", "filename"): ("HOROVOD_TIMELINE", "value"),
    ("timeline", "mark_cycles"): ("HOROVOD_TIMELINE_MARK_CYCLES", "bool"),
    ("stall_check", "enabled"): ("HOROVOD_STALL_CHECK_DISABLE", "not"),
    ("stall_check", "warning_time_seconds"): ("HOROVOD_STALL_CHECK_TIME_SECONDS", "value"),
    ("stall_check", "shutdown_time_seconds"): ("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", "value"),
    ("library_options", "mpi_threads_disable"): ("HOROVOD_MPI_THREADS_DISABLE", "bool"),
    ("library_options", "num_nccl_streams"): ("HOROVOD_NUM_NCCL_STREAMS", "value"),
    ("library_options", "thread_affinity"): ("HOROVOD_THREAD_AFFINITY", "value"),
    ("library_options", "gloo_timeout_seconds"): ("HOROVOD_GLOO_TIMEOUT_SECONDS", "value"),
    ("logging", "with_timestamp"): ("HOROVOD_LOG_HIDE_TIME", "not"),
    ("logging", "hide_timestamp"): ("HOROVOD_LOG_HIDE_TIME", "bool"),
}


_CONFIG_SECTIONS = frozenset(section for section, _ in _CONFIG_KEYS)


def value_knob(env: str) -> Optional[config.KnobFlag]:
    return next((k for k in config.KNOB_FLAGS if k.env == env and k.kind is not None), None)


def apply_config_file(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """--config-file: fills in what the command line left unset (Horovod's rule)."""
    where = f"--config-file {args.config_file}"
    try:
        yaml = extras.require("yaml", where)
    except ImportError as exc:
        parser.error(str(exc))
    try:
        with open(args.config_file, encoding="utf-8") as f:
            data = yaml.safe_load(f)
    except OSError as exc:
        parser.error(f"cannot read {where}: {exc.strerror}")
    except yaml.YAMLError as exc:
        parser.error(f"{where} is not valid YAML: {' '.join(str(exc).split())}")
    if data is None:
        return
    if not isinstance(data, dict):
        parser.error(f"{where}: expected a mapping of sections, got {type(data).__name__}")
    unknown = []
    for section, body in data.items():
        if section == "controller":
            name = str(body).lower()
            if name not in ("gloo", "mpi"):
                parser.error(f"{where}: no such controller: {body!r} (gloo or mpi)")
            if not (args.use_gloo or args.use_mpi or args.use_jsrun):
                args.use_gloo, args.use_mpi = name == "gloo", name == "mpi"
            continue
        if not isinstance(body, dict) or section not in _CONFIG_SECTIONS:
            unknown.append(str(section))
            continue
        for key, value in body.items():
            if (section, key) == ("logging", "level"):
                level = str(value).upper()
                if level not in LOG_LEVELS:
                    parser.error(f"{where}: logging.level {value!r} is not one of "
                                 + ", ".join(LOG_LEVELS))
                args.log_level = args.log_level or level
                continue
            target = _CONFIG_KEYS.get((section, key))
            if target is None:
                unknown.append(f"{section}.{key}")
                continue
            env, how = target
            dest = knob_dest(env)
            if value is None or getattr(args, dest, None) is not None:
                continue  # the command line wins
            if how == "value":
                knob = value_knob(env)
                assert knob is not None and knob.kind is not None
                try:
                    value = knob.kind(value)
                except (TypeError, ValueError):
                    parser.error(f"{where}: {section}.{key} {value!r} is not "
                                 f"{'an integer' if knob.kind is int else 'a number'}")
            else:
                value = "1" if bool(value) == (how == "bool") else "0"
            setattr(args, dest, value)
    if unknown:
        output.log(f"{where}: ignoring unknown setting(s): {', '.join(unknown)}")


def knob_env(args: argparse.Namespace) -> Dict[str, str]:
    """The variables set by engine-knob options (and --log-level, --config-file)."""
    env = {}
    for knob in config.KNOB_FLAGS:
        if knob.flags[0] in OWN_KNOB_OPTIONS or knob.env in env:
            continue
        value = getattr(args, knob_dest(knob.env), None)
        if value is None:
            continue
        typed = value_knob(knob.env)
        if isinstance(value, str) and (typed is None or typed.kind is not str):
            env[knob.env] = value  # a switch's constant
        else:
            assert typed is not None
            env[knob.env] = str(value * typed.scale if typed.scale != 1 else value)
    if args.log_level:
        env["HOROVOD_LOG_LEVEL"] = args.log_level
    return env
