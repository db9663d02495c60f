"""Command line entry point of ``horovodrun``.

Usage::

    horovodrun -np 4 [-H host1:2,host2:2 | --hostfile FILE] [--nics eth0]
               [--ssh-port 22] [--ssh-identity-file KEY] [--ssh-command CMD]
               [--start-timeout 30] [--verbose] [--log-level INFO]
               [--disable-prefix] [engine and elastic options] python train.py ...

Every option of Horovod's ``horovodrun`` is accepted (with its abbreviations):
those that set an engine knob pass the knob's variable to the workers
(``horovod_torch.config.KNOB_FLAGS``), the few that mean nothing here say so once
on stderr; ``--config-file`` reads Horovod's YAML format. Words from the first one
that is not an option (or after ``--``) are the worker command, never parsed.

Workers of local hosts are started directly, those of other hosts over ssh
(:mod:`horovod_torch.runner.remote`); :mod:`horovod_torch.runner.network`
picks the address of the rendezvous store.

Only the standard library is imported at module level; the C++ extension
(which loads torch) is imported lazily by :func:`_start_store`, so
``--help`` and argument errors return quickly. A fixed-size job starts its
workers before that: their own ``import torch`` takes as long as ours, so the
store (on a port held for it since before the first worker started) is
listening long before the first of them asks for it (:func:`run_static`).
"""
from __future__ import annotations

import argparse
import os
import secrets
import shlex
import shutil
import socket
import subprocess
import sys
from typing import Any, Dict, List, NoReturn, Optional, Sequence, Tuple

from horovod_torch import config, extras
from horovod_torch.runner import driver, hosts, network, remote

LOG_LEVELS = ("TRACE", "DEBUG", "INFO", "WARNING", "ERROR", "FATAL")
# Defined by make_parser itself, with their own checks; listed in config.KNOB_FLAGS
# for docs/config.md.
_OWN_KNOB_OPTIONS = ("--start-timeout", "--log-level")

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


def _knob_dest(env: str) -> str:
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
        if knob.flags[0] in _OWN_KNOB_OPTIONS:
            continue
        dest = _knob_dest(knob.env)
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


def _notice(option: str, why: str) -> None:
    """One line on stderr for an accepted option that does nothing here."""
    driver.log(f"{option} has no effect in horovod_torch: {why}")


def parse_args(argv: Optional[Sequence[str]] = None,
               raise_errors: bool = False) -> argparse.Namespace:
    """Parse and validate ``argv``; exits with status 2 on any error (raises
    ValueError instead with ``raise_errors``)."""
    parser = make_parser()
    parser.raise_errors = raise_errors
    argv = list(sys.argv[1:] if argv is None else argv)
    split = parser.command_start(argv)
    args = parser.parse_args(argv[:split])
    args.command = argv[split + 1:] if argv[split:split + 1] == ["--"] else argv[split:]
    if args.config_file:
        _apply_config_file(parser, args)
    _check_knobs(parser, args)
    if args.check_build:
        return args
    if sum(map(bool, (args.use_gloo, args.use_mpi, args.use_jsrun))) > 1:
        parser.error("use at most one of --gloo, --mpi and --jsrun")
    if args.disable_cache:
        _notice("--disable-cache", "horovodrun keeps no cache of host checks")
    if args.use_jsrun:
        _notice("--jsrun", "IBM's jsrun is not supported; horovodrun starts the workers "
                           "itself over the TCP transport")
    streams = getattr(args, _knob_dest("HOROVOD_NUM_NCCL_STREAMS"), None)
    if streams is not None and streams != 1:
        _notice("--num-nccl-streams", "the NCCL backend runs one stream per GPU (its ops "
                                      "are ordered on it); the value is passed on and unused")
    if args.binding_args and not args.use_mpi:
        _notice("--binding-args", "it applies to mpirun (--mpi) only; horovodrun binds "
                                  "no processes")
    _check_remote_options(parser, args)
    if args.elastic_timeout is None:
        env_value = os.environ.get("HOROVOD_ELASTIC_TIMEOUT")
        try:
            args.elastic_timeout = float(env_value or 600)
        except ValueError:
            parser.error(f"invalid HOROVOD_ELASTIC_TIMEOUT: {env_value!r}")

    if args.discovery or args.min_np is not None:
        if args.use_mpi:
            parser.error("--mpi cannot be combined with elastic mode (--host-discovery-script "
                         "or --min-np); elastic jobs use the TCP transport")
        return _check_elastic(parser, args)
    if args.straggler_policy == "evict":
        parser.error("--straggler-policy evict applies to elastic jobs only (--min-np or "
                     "--host-discovery-script): a static job cannot go on without a host")
    if args.max_np is not None:
        _notice("--max-np", "it applies to elastic jobs only (--min-np or "
                            "--host-discovery-script)")
    if args.num_proc is None:
        parser.error("argument -np/--num-proc is required")
    if args.num_proc < 1:
        parser.error(f"argument -np/--num-proc must be >= 1, "
                     f"got {args.num_proc}")
    if not args.command:
        parser.error("no command given to run in the workers")
    _check_start_timeout(parser, args)

    try:
        args.host_list = _host_list(args)
        args.slots = hosts.assign_ranks(args.host_list, args.num_proc)
        used = list(dict.fromkeys(s.hostname for s in args.slots))
        args.remote_hosts = [h for h in used if not hosts.is_local_host(h)]
        args.store_addr = network.store_address(args.nic_list, args.remote_hosts)
    except ValueError as exc:
        parser.error(str(exc))
    return args


def _check_start_timeout(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.start_timeout is None:
        try:
            args.start_timeout = config.start_timeout_s(int)  # --start-timeout is an int
        except ValueError:
            parser.error(f"invalid HOROVOD_START_TIMEOUT: "
                         f"{os.environ.get(config.START_TIMEOUT_ENV)!r}")
    if args.start_timeout <= 0:
        parser.error(f"start timeout must be > 0, got {args.start_timeout}")


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


def _value_knob(env: str) -> Optional[config.KnobFlag]:
    return next((k for k in config.KNOB_FLAGS if k.env == env and k.kind is not None), None)


def _apply_config_file(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
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
            dest = _knob_dest(env)
            if value is None or getattr(args, dest, None) is not None:
                continue  # the command line wins
            if how == "value":
                knob = _value_knob(env)
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
        driver.log(f"{where}: ignoring unknown setting(s): {', '.join(unknown)}")


def _check_knobs(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Horovod's checks: numeric engine settings are >= 0, the noise in [0, 1]."""
    for knob in config.KNOB_FLAGS:
        if knob.kind not in (int, float) or knob.flags[0] in _OWN_KNOB_OPTIONS:
            continue
        value = getattr(args, _knob_dest(knob.env), None)
        if value is not None and value < 0:
            parser.error(f"{knob.flags[0]} must be >= 0, got {value}")
    noise = getattr(args, _knob_dest("HOROVOD_AUTOTUNE_GAUSSIAN_PROCESS_NOISE"), None)
    if noise is not None and not 0 <= noise <= 1:
        parser.error(f"--autotune-gaussian-process-noise must be in [0, 1], got {noise}")


def _host_list(args: argparse.Namespace) -> List[hosts.HostInfo]:
    """The hosts of a static job, from -H, --hostfile or the default."""
    if args.hosts and args.hostfile:
        raise ValueError("use either -H/--hosts or --hostfile, not both")
    if args.hostfile:
        try:
            with open(args.hostfile, encoding="utf-8") as f:
                text = f.read()
        except OSError as exc:
            raise ValueError(f"cannot read --hostfile {args.hostfile!r}: "
                             f"{exc.strerror}") from None
        return hosts.parse_hostfile(text, args.hostfile)
    return hosts.parse_hosts(args.hosts or f"localhost:{args.num_proc}")


def _check_remote_options(parser: argparse.ArgumentParser,
                          args: argparse.Namespace) -> None:
    """Validates --nics and the ssh options; sets args.nic_list."""
    args.nic_list = None
    if args.nics is None and os.environ.get("HOROVOD_GLOO_IFACE"):
        args.nics = os.environ["HOROVOD_GLOO_IFACE"]  # Horovod's variable for the same choice
    if args.nics is not None:
        try:
            args.nic_list = list(dict.fromkeys(network.parse_nics(args.nics)))
        except ValueError as exc:
            parser.error(str(exc))
    if args.ssh_port is not None and not 0 < args.ssh_port < 65536:
        parser.error(f"--ssh-port must be in 1..65535, got {args.ssh_port}")
    if args.ssh_identity_file and not os.access(args.ssh_identity_file, os.R_OK):
        parser.error(f"--ssh-identity-file {args.ssh_identity_file!r} is not a "
                     "readable file")
    if args.ssh_command is not None:
        try:
            prefix = shlex.split(args.ssh_command)
        except ValueError as exc:
            parser.error(f"invalid --ssh-command {args.ssh_command!r}: {exc}")
        if not prefix:
            parser.error("--ssh-command is empty")
        if args.ssh_port is not None or args.ssh_identity_file:
            parser.error("--ssh-port/--ssh-identity-file apply to the built-in ssh "
                         "command only; put these options into --ssh-command (or "
                         "$HOROVOD_SSH_COMMAND) instead")


def _remote_exec(args: argparse.Namespace) -> remote.RemoteExec:
    """How this job starts workers on remote hosts."""
    prefix = (shlex.split(args.ssh_command) if args.ssh_command else
              remote.ssh_prefix(args.ssh_port, args.ssh_identity_file))
    return remote.RemoteExec(prefix, grace_s=driver.GRACE_PERIOD_S)


def _check_elastic(parser: argparse.ArgumentParser,
                   args: argparse.Namespace) -> argparse.Namespace:
    """Validates the elastic-mode flags. Without --host-discovery-script the hosts are
    fixed: -H, --hostfile, or this machine with --max-np (else -np) slots. Without
    --max-np the job may grow to every slot found (elastic_driver.UNBOUNDED)."""
    if not args.command:
        parser.error("no command given to run in the workers")
    for option, value in (("--min-np", args.min_np), ("--max-np", args.max_np),
                          ("-np", args.num_proc)):
        if value is not None and value < 1:
            parser.error(f"{option} must be >= 1, got {value}")
    if args.reset_limit is not None and args.reset_limit < 0:
        parser.error(f"--reset-limit must be >= 0, got {args.reset_limit}")
    if not args.elastic_timeout > 0:
        parser.error(f"--elastic-timeout must be > 0 seconds, got {args.elastic_timeout:g}")
    if not args.straggler_evict_after > 0:
        parser.error("--straggler-evict-after must be > 0 seconds, got "
                     f"{args.straggler_evict_after:g}")
    args.min_np = args.min_np or args.num_proc or 1
    args.num_proc = args.num_proc or args.min_np
    # Without --max-np the job grows to every slot it finds, as Horovod's does.
    bound = args.max_np if args.max_np is not None else max(args.num_proc, args.min_np)
    if not args.min_np <= args.num_proc <= bound:  # each >= 1, checked above
        parser.error(f"need 1 <= --min-np ({args.min_np}) <= -np ({args.num_proc}) <= "
                     f"--max-np ({bound})")
    args.fixed_hosts = None
    if args.discovery:
        if args.hosts or args.hostfile:
            parser.error("use one of -H/--hosts, --hostfile and --host-discovery-script")
        if not os.access(args.discovery, os.X_OK):
            parser.error(f"--host-discovery-script {args.discovery!r} is not an "
                         "executable file")
    else:
        try:
            if not (args.hosts or args.hostfile):
                args.hosts = f"localhost:{bound}"
            args.fixed_hosts = {h.hostname: h.slots for h in _host_list(args)}
        except ValueError as exc:
            parser.error(str(exc))
    if args.slots_per_host < 1:
        parser.error(f"--slots-per-host must be >= 1, got {args.slots_per_host}")
    if args.cooldown and not 0 <= args.cooldown[0] <= args.cooldown[1]:
        parser.error("--blacklist-cooldown-range needs 0 <= LO <= HI")
    _check_start_timeout(parser, args)
    return args


def _check_commands(args: argparse.Namespace, local_command: bool = True,
                    remote_exec: Optional[remote.RemoteExec] = None) -> Optional[int]:
    """None if the worker command (and the remote-exec command) can be found, else
    the exit code after saying which one is missing."""
    if local_command and not _command_exists(args.command[0]):
        driver.log(f"command not found: {args.command[0]}")
        return 127
    if remote_exec is not None and not _command_exists(remote_exec.prefix[0]):
        driver.log(f"command not found: {remote_exec.prefix[0]} (it starts the workers "
                   "on remote hosts; install openssh-client or pass --ssh-command)")
        return 127
    return None


def _start_job(args: argparse.Namespace, local_command: bool = True,
               remote_exec: Optional[remote.RemoteExec] = None):
    """Checks the commands and starts the store: (secret, server), or an exit code."""
    missing = _check_commands(args, local_command, remote_exec)
    if missing is not None:
        return missing
    secret = secrets.token_hex(16)
    try:
        return secret, _start_store(secret, args.store_addr)
    except Exception as exc:  # pylint: disable=broad-except
        driver.log(f"failed to start the rendezvous store on {args.store_addr}: {exc}")
        return 1


def _elastic_store_address(args: argparse.Namespace) -> Optional[str]:
    """Store address of an elastic job: --nics, else the route to the first remote
    host the discovery script lists now (or of the fixed hosts), else loopback
    (remote hosts found later are then refused: they could not reach the store)."""
    from horovod_torch.runner.discovery import discover_hosts
    try:
        if args.nic_list:
            return network.store_address(args.nic_list, [])
        if args.fixed_hosts is not None:
            found = dict(args.fixed_hosts)
        else:
            try:
                found = discover_hosts(args.discovery, args.slots_per_host)
            except (OSError, ValueError):
                found = {}  # the driver runs it again and says what failed
        remote_hosts = [h for h in found if not hosts.is_local_host(h)]
        return network.store_address(None, remote_hosts)
    except ValueError as exc:
        driver.log(str(exc))
        return None


def store_address(args: argparse.Namespace) -> Optional[str]:
    """The address workers reach this machine at (the rendezvous store's), or None
    after saying why on stderr. Computed once; run_* use it."""
    if getattr(args, "store_addr", None) is None:
        args.store_addr = _elastic_store_address(args)
    return args.store_addr


def _output_forwarder(args: argparse.Namespace, ranks: int) -> driver.OutputForwarder:
    """Worker output goes to our stdout/stderr, prefixed unless --disable-prefix, with
    the time with --prefix-output-with-timestamp, and into --output-filename DIR."""
    return driver.OutputForwarder(
        _binary(sys.stdout), prefix=not args.disable_prefix,
        err_stream=_binary(sys.stderr), timestamp=args.prefix_timestamp,
        output_dir=args.output_filename, ranks=ranks)


def _binary(stream: Any) -> Any:
    """The byte stream under a text stream, or an adapter (Jupyter's have none)."""
    buffer = getattr(stream, "buffer", None)
    return buffer if buffer is not None else driver.TextSink(stream)


def run_elastic(args: argparse.Namespace) -> int:
    """Run an elastic job under the ElasticDriver."""
    from horovod_torch.runner.elastic_driver import UNBOUNDED, ElasticDriver, ElasticOptions
    if store_address(args) is None:
        return 1
    remote_exec = None
    if args.store_addr != network.LOOPBACK:
        remote_exec = _remote_exec(args)
    elif args.ssh_command or args.ssh_port or args.ssh_identity_file:
        driver.log("the discovery script lists only local hosts: the store listens on "
                   f"{network.LOOPBACK} and remote hosts found later will be refused "
                   "(pass --network-interface to allow them)")
    started = _start_job(args, remote_exec=remote_exec)
    if isinstance(started, int):
        return started
    secret, server = started
    port = int(server.port())

    def env_for(worker_id: str, slot: hosts.SlotInfo) -> Dict[str, str]:
        # HOROVOD_RANK & co. are the rank the worker is started for, as in Horovod;
        # hvd.init() of an elastic worker takes its rank from the store instead.
        env = _worker_env(slot, args, port, secret)
        # A joining worker waits at rendezvous until the survivors reach their next
        # commit: give it the elastic timeout, not the start timeout.
        env["HOROVOD_START_TIMEOUT"] = str(max(float(args.start_timeout), args.elastic_timeout))
        env.update({"HOROVOD_ELASTIC": "1", "HOROVOD_ELASTIC_WORKER_ID": worker_id,
                    "HOROVOD_ELASTIC_TIMEOUT": str(args.elastic_timeout)})
        if args.straggler_policy == "evict":
            env["HOROVOD_STRAGGLER_EVICT_AFTER"] = str(args.straggler_evict_after)
        return env

    opts = ElasticOptions(num_proc=args.num_proc, min_np=args.min_np,
                          max_np=args.max_np if args.max_np is not None else UNBOUNDED,
                          discovery_script=args.discovery, slots=args.slots_per_host,
                          fixed_hosts=args.fixed_hosts, reset_limit=args.reset_limit,
                          cooldown=tuple(args.cooldown) if args.cooldown else None,
                          elastic_timeout=args.elastic_timeout, verbose=args.verbose,
                          evict_stragglers=args.straggler_policy == "evict",
                          start_timeout=float(args.start_timeout))
    if args.verbose:
        driver.log(f"rendezvous store at {args.store_addr}:{port}")
    spawner = driver.HostSpawner(remote_exec)
    try:
        return ElasticDriver(opts, server, args.command, env_for,
                             _output_forwarder(args, args.max_np or args.num_proc),
                             spawner=spawner).run()
    finally:
        spawner.close()
        server.stop()


def check_build() -> int:
    """Print the features compiled into horovod_torch (``--check-build``)."""
    import horovod_torch  # pylint: disable=import-outside-toplevel

    def box(flag: bool) -> str:
        return "[X]" if flag else "[ ]"

    import torch  # pylint: disable=import-outside-toplevel

    # What is built and what is usable now: NCCL built on a machine without a GPU is
    # built, not usable.
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if not horovod_torch.nccl_built():
        nccl = "not built"
    else:
        nccl = f"built, {gpus} GPU(s) visible" if gpus else "built, no GPU visible"
    version = getattr(horovod_torch, "__version__", "unknown")
    mpi = horovod_torch.mpi_built()
    print(f"horovod_torch v{version}:\n\n"
          "Available Frameworks:\n"
          "    [X] PyTorch\n\n"
          "Available Controllers:\n"
          "    [X] TCP (Gloo-compatible)\n"
          f"    {box(mpi)} MPI{'' if mpi else ' (' + why_not_built('MPI') + ')'}\n\n"
          "Available Tensor Operations:\n"
          f"    {box(horovod_torch.nccl_built() and gpus > 0)} NCCL ({nccl}"
          f"{'' if horovod_torch.nccl_built() else ': ' + why_not_built('NCCL')})\n"
          "    [X] TCP")
    return 0


REBUILD = "pip install --no-build-isolation --force-reinstall --no-deps ."


def why_not_built(part: str, not_built: Optional[Dict[str, str]] = None,
                  wrapper: Optional[str] = None) -> str:
    """Why the build left out `part` (as setup.py recorded it), and how to build it
    when what it needs is here now. `not_built` and `wrapper` (the mpicxx found now)
    default to this installation's and this machine's."""
    if not_built is None:
        try:
            from horovod_torch import _build_info  # pylint: disable=import-outside-toplevel
            not_built = getattr(_build_info, "NOT_BUILT", {})
        except ImportError:
            not_built = {}
    why = "not built: " + not_built.get(part, "the build recorded no reason")
    if part == "MPI":
        wrapper = shutil.which("mpicxx") if wrapper is None else wrapper
        if wrapper:
            why += (f"; {wrapper} is here now: rebuild from the source tree with "
                    f"HOROVOD_WITH_MPI=1 {REBUILD}")
    return why


def _start_store(secret: str, addr: str, port: int = 0) -> Any:
    """Start the in-process rendezvous store on ``addr``:``port`` (0: any free port);
    ``.port()`` gives its port.

    Imported here, not at module level: loading ``_C`` loads torch.
    """
    from horovod_torch import _C  # pylint: disable=import-outside-toplevel

    return _C.StoreServer(addr, port, secret)


def reserve_port(addr: str) -> socket.socket:
    """A free TCP port on ``addr`` held for the rendezvous store until it listens: a
    socket bound with SO_REUSEADDR that never listens. While it is bound the kernel
    hands the port to nobody else (a bind to port 0, an outgoing connection), and the
    store, which binds with SO_REUSEADDR too, may bind it since nothing listens on
    it. A worker that connects before the store listens is refused, and retries
    until HOROVOD_START_TIMEOUT. The caller closes the socket once the store runs."""
    family = socket.AF_INET6 if ":" in addr else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((addr, 0))
    except OSError:
        sock.close()
        raise
    return sock


def _command_exists(program: str) -> bool:
    """Return True if ``program`` is an executable path or on $PATH."""
    return shutil.which(program) is not None


def _worker_env(slot: hosts.SlotInfo, args: argparse.Namespace,
                port: int, secret: str) -> Dict[str, str]:
    """Build the environment of the worker placed at ``slot``."""
    env = dict(os.environ)
    env.update(slot.to_env())
    env.update({
        "HOROVOD_STORE_ADDR": args.store_addr,
        "HOROVOD_STORE_PORT": str(port),
        "HOROVOD_SECRET": secret,
        "HOROVOD_CONTROLLER": "tcp",
        "HOROVOD_START_TIMEOUT": str(args.start_timeout),
        "PYTHONUNBUFFERED": "1",
    })
    env.update(_knob_env(args))
    env.update(getattr(args, "extra_env", None) or {})
    return env


def _knob_env(args: argparse.Namespace) -> Dict[str, str]:
    """The variables set by engine-knob options (and --log-level, --config-file)."""
    env = {}
    for knob in config.KNOB_FLAGS:
        if knob.flags[0] in _OWN_KNOB_OPTIONS or knob.env in env:
            continue
        value = getattr(args, _knob_dest(knob.env), None)
        if value is None:
            continue
        value_knob = _value_knob(knob.env)
        if isinstance(value, str) and (value_knob is None or value_knob.kind is not str):
            env[knob.env] = value  # a switch's constant
        else:
            assert value_knob is not None
            env[knob.env] = str(value * value_knob.scale if value_knob.scale != 1 else value)
    if args.log_level:
        env["HOROVOD_LOG_LEVEL"] = args.log_level
    return env


def run_mpi(args: argparse.Namespace) -> int:
    """horovodrun --mpi: hand the job to mpirun (same hosts and slots); the workers
    run over MPI. Output is tagged by mpirun unless --disable-prefix."""
    if not _command_exists("mpirun"):
        driver.log("--mpi needs OpenMPI's mpirun on PATH (e.g. apt-get install openmpi-bin)")
        return 2
    import horovod_torch  # pylint: disable=import-outside-toplevel
    if not horovod_torch.mpi_built():
        driver.log("--mpi needs a build of horovod_torch with MPI: install libopenmpi-dev "
                   "and rebuild, or run without --mpi (TCP transport)")
        return 2
    hosts_arg = ",".join(f"{h.hostname}:{h.slots}" for h in args.host_list)
    extra = {**_knob_env(args), **(getattr(args, "extra_env", None) or {})}
    env = dict(os.environ, HOROVOD_CONTROLLER="mpi",
               HOROVOD_START_TIMEOUT=str(args.start_timeout), **extra)
    exported = ["HOROVOD_CONTROLLER", "HOROVOD_START_TIMEOUT", *extra,
                *[k for k in ("PYTHONPATH", "PATH", "LD_LIBRARY_PATH") if k in os.environ]]
    binding = shlex.split(args.binding_args) if args.binding_args else ["--bind-to", "none"]
    cmd = ["mpirun", "-np", str(args.num_proc), "-H", hosts_arg, *binding, "--oversubscribe"]
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        cmd.append("--allow-run-as-root")
    if not args.disable_prefix:
        cmd.append("--tag-output")
    if args.prefix_timestamp:
        cmd.append("--timestamp-output")
    if args.output_filename:
        cmd += ["--output-filename", args.output_filename]
    if args.nic_list:
        cmd += ["--mca", "btl_tcp_if_include", ",".join(args.nic_list)]
    ssh_args = (([f"-p {args.ssh_port}"] if args.ssh_port else []) +
                ([f"-i {args.ssh_identity_file}"] if args.ssh_identity_file else []))
    if ssh_args:
        cmd += ["--mca", "plm_rsh_args", " ".join(ssh_args)]
    for k in exported:
        cmd += ["-x", k]
    cmd += shlex.split(args.mpi_args) + list(args.command)
    if args.verbose:
        driver.log("running: " + " ".join(shlex.quote(c) for c in cmd))
    return subprocess.call(cmd, env=env)


def _print_assignment(slots: List[hosts.SlotInfo], addr: str, port: int,
                      remote_exec: Optional[remote.RemoteExec]) -> None:
    driver.log(f"rendezvous store at {addr}:{port}")
    driver.log(f"rank assignment ({len(slots)} processes):")
    for s in slots:
        driver.log(f"  rank {s.rank}: host={s.hostname} "
                   f"local_rank={s.local_rank} local_size={s.local_size} "
                   f"cross_rank={s.cross_rank} cross_size={s.cross_size}")
    if remote_exec is not None:
        driver.log(f"remote workers start with: {' '.join(remote_exec.prefix)} HOST "
                   f"'{remote_exec.shell_command()[:60]}...' (job {remote_exec.job_id})")


def run_static(args: argparse.Namespace) -> int:
    """Run a fixed-size job: workers, store, supervision; return exit code.

    The workers start first, all of them, on a port held for the store
    (:func:`reserve_port`); then the store starts, which loads torch here (seconds),
    while the workers load theirs. Starting the store first would delay every
    worker by our own ``import torch``."""
    remote_exec = _remote_exec(args) if args.remote_hosts else None
    any_local = len(args.remote_hosts) < len({s.hostname for s in args.slots})
    missing = _check_commands(args, local_command=any_local, remote_exec=remote_exec)
    if missing is not None:
        return missing
    secret = secrets.token_hex(16)
    try:
        reservation = reserve_port(args.store_addr)
    except OSError as exc:
        driver.log(f"failed to start the rendezvous store on {args.store_addr}: {exc}")
        return 1
    port = int(reservation.getsockname()[1])
    server: Any = None

    def start_store() -> Optional[int]:
        nonlocal server
        try:
            server = _start_store(secret, args.store_addr, port)
        except Exception as exc:  # pylint: disable=broad-except
            driver.log(f"failed to start the rendezvous store on {args.store_addr}:{port}: "
                       f"{exc}")
            return 1
        finally:
            reservation.close()
        return None

    spawner = driver.HostSpawner(remote_exec)
    try:
        if args.verbose:
            _print_assignment(args.slots, args.store_addr, port, remote_exec)
        supervisor = driver.Supervisor(
            jobs=args.slots,
            env_for=lambda slot: _worker_env(slot, args, port, secret),
            command=args.command,
            spawner=spawner,
            forwarder=_output_forwarder(args, args.num_proc),
            start_timeout_s=float(args.start_timeout),
            after_spawn=start_store)
        return supervisor.run()
    finally:
        reservation.close()
        spawner.close()
        if server is not None:
            server.stop()


def is_elastic(args: argparse.Namespace) -> bool:
    """Elastic mode: a host discovery script or --min-np (Horovod's rule)."""
    return bool(getattr(args, "discovery", None)) or getattr(args, "fixed_hosts", None) \
        is not None


def run(args: argparse.Namespace) -> int:
    """Dispatch on the parsed arguments: --check-build, elastic, --mpi or static."""
    if args.check_build:
        return check_build()
    if is_elastic(args):
        return run_elastic(args)
    if args.use_mpi:
        return run_mpi(args)
    return run_static(args)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Console-script entry point; returns the process exit code."""
    args = parse_args(argv)
    return run(args)


def run_commandline() -> None:
    """Horovod's name of the entry point: runs ``horovodrun`` with ``sys.argv`` and
    exits with the job's code if that is not 0."""
    code = main()
    if code:
        sys.exit(code)


if __name__ == "__main__":
    sys.exit(main())
