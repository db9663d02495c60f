"""Command line entry point of ``horovodrun``.

Usage::

    horovodrun -np 4 [-H host1:2,host2:2 | --hostfile FILE] [--nics eth0]
               [--ssh-port 22] [--ssh-identity-file KEY] [--ssh-command CMD]
               [--start-timeout 30] [--verbose] [--log-level INFO]
               [--disable-prefix] python train.py ...

Workers of local hosts are started directly, those of other hosts over ssh
(:mod:`horovod_torch.runner.remote`); :mod:`horovod_torch.runner.network`
picks the address of the rendezvous store.

Only the standard library is imported at module level; the C++ extension
(which loads torch) is imported lazily by :func:`_start_store`, so
``--help`` and argument errors return quickly.
"""
from __future__ import annotations

import argparse
import os
import secrets
import shlex
import shutil
import subprocess
import sys
from typing import Any, Dict, List, NoReturn, Optional, Sequence

from horovod_torch import config
from horovod_torch.runner import driver, hosts, network, remote

DEFAULT_START_TIMEOUT_S = 30
LOG_LEVELS = ("TRACE", "DEBUG", "INFO", "WARNING", "ERROR", "FATAL")


class _Parser(argparse.ArgumentParser):
    """ArgumentParser whose errors are a single line on stderr."""

    def error(self, message: str) -> NoReturn:
        """Print ``horovodrun: error: ...`` and exit with status 2."""
        self.exit(2, f"{self.prog}: error: {message} "
                     f"(see '{self.prog} --help')\n")


def make_parser() -> argparse.ArgumentParser:
    """Build the ``horovodrun`` argument parser."""
    parser = _Parser(
        prog="horovodrun", allow_abbrev=False,
        description="Launch a horovod_torch training job on this machine or on "
                    "several hosts (started over ssh).")
    parser.add_argument(
        "-np", "--num-proc", dest="num_proc", type=int, metavar="N",
        help="total number of worker processes (required)")
    parser.add_argument(
        "-H", "--hosts", dest="hosts", metavar="HOST:SLOTS[,...]",
        help="hosts and their slot counts, e.g. host1:4,host2:4; ranks fill the "
             "hosts in this order (default: localhost:N)")
    parser.add_argument(
        "--hostfile", dest="hostfile", metavar="FILE",
        help="file of hosts, one a line: 'host slots=N' or 'host:N' (# comments)")
    parser.add_argument(
        "--network-interface", "--nics", dest="nics", metavar="IFACE[,IFACE]",
        help="interface(s) for the rendezvous store and the workers' TCP mesh; "
             "the store listens on the first one's IPv4 address (default: the "
             "route to the first remote host, or 127.0.0.1 with local hosts only)")
    parser.add_argument(
        "--ssh-port", dest="ssh_port", type=int, metavar="PORT",
        help="port of sshd on the remote hosts")
    parser.add_argument(
        "--ssh-identity-file", dest="ssh_identity_file", metavar="FILE",
        help="private key ssh uses to log in to the remote hosts")
    parser.add_argument(
        "--ssh-command", dest="ssh_command", metavar="CMD",
        default=os.environ.get("HOROVOD_SSH_COMMAND") or None,
        help="command that replaces ssh to run workers on remote hosts, called as "
             "CMD HOST 'SHELL COMMAND' with the session's stdin connected "
             "(default: $HOROVOD_SSH_COMMAND, else 'ssh -o BatchMode=yes -o "
             "StrictHostKeyChecking=no')")
    parser.add_argument(
        "--start-timeout", dest="start_timeout", type=int, metavar="S",
        help="seconds workers wait for rendezvous (default: "
             f"$HOROVOD_START_TIMEOUT or {DEFAULT_START_TIMEOUT_S})")
    parser.add_argument(
        "--verbose", action="store_true",
        help="print the rank assignment and store address to stderr")
    parser.add_argument(
        "--log-level", dest="log_level", type=str.upper, choices=LOG_LEVELS,
        metavar="LEVEL",
        help="set HOROVOD_LOG_LEVEL for workers: " + ", ".join(LOG_LEVELS))
    parser.add_argument(
        "--disable-prefix", dest="disable_prefix", action="store_true",
        help="do not prefix worker output lines with [rank]<stdout>:")
    parser.add_argument(
        "--check-build", dest="check_build", action="store_true",
        help="show which frameworks, controllers and tensor operations "
             "this build supports, then exit")
    knobs = parser.add_argument_group(
        "engine knobs", "each sets a HOROVOD_* variable for every worker (docs/config.md)")
    for flag, env, kind, metavar, scale in config.KNOB_FLAGS:
        if flag in ("--start-timeout", "--log-level"):
            continue  # defined above, with their own checks
        dest = "knob_" + flag[2:].replace("-", "_")
        if kind is None:
            knobs.add_argument(flag, dest=dest, action="store_true", help=f"sets {env}=1")
        else:
            knobs.add_argument(flag, dest=dest, type=kind, metavar=metavar, help=f"sets {env}")
    mpi = parser.add_argument_group("MPI")
    mpi.add_argument("--mpi", dest="use_mpi", action="store_true",
                     help="start the workers with OpenMPI's mpirun; they run over MPI "
                          "(needs a build with MPI)")
    mpi.add_argument("--mpi-args", dest="mpi_args", default="", metavar="ARGS",
                     help="extra arguments for mpirun, e.g. \"--mca btl self,tcp\"")
    elastic = parser.add_argument_group("elastic mode")
    elastic.add_argument("--min-np", dest="min_np", type=int, metavar="N",
                         help="fewest workers the job may run with")
    elastic.add_argument("--max-np", dest="max_np", type=int, metavar="N",
                         help="most workers the job may grow to")
    elastic.add_argument("--host-discovery-script", dest="discovery", metavar="PATH",
                         help="executable printing the available hosts as host:slots lines; "
                              "enables elastic mode")
    elastic.add_argument("--slots", type=int, default=1, metavar="K",
                         help="slots of a discovered host that prints no count (default 1)")
    elastic.add_argument("--reset-limit", dest="reset_limit", type=int, default=0,
                         metavar="L", help="stop after L resets (default: no limit)")
    elastic.add_argument("--blacklist-cooldown-range", dest="cooldown", type=float, nargs=2,
                         metavar=("LO", "HI"),
                         help="a failed host may be used again after a random LO..HI "
                              "seconds (default: never)")
    elastic.add_argument("--elastic-timeout", dest="elastic_timeout", type=float,
                         default=600.0, metavar="T",
                         help="seconds to wait for enough workers (default 600)")
    parser.add_argument(
        "command", nargs=argparse.REMAINDER,
        help="command to run in every worker, e.g. python train.py")
    return parser


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """Parse and validate ``argv``; exits with status 2 on any error."""
    parser = make_parser()
    args = parser.parse_args(argv)
    if args.command and args.command[0] == "--":
        args.command = args.command[1:]
    if args.check_build:
        return args
    _check_remote_options(parser, args)

    if args.discovery:
        if args.use_mpi:
            parser.error("--mpi cannot be combined with elastic mode (--host-discovery-script); "
                         "elastic jobs use the TCP transport")
        return _check_elastic(parser, args)
    if args.min_np is not None or args.max_np is not None:
        parser.error("--min-np/--max-np need --host-discovery-script (elastic mode)")
    if args.num_proc is None:
        parser.error("argument -np/--num-proc is required")
    if args.num_proc < 1:
        parser.error(f"argument -np/--num-proc must be >= 1, "
                     f"got {args.num_proc}")
    if not args.command:
        parser.error("no command given to run in the workers")
    if args.start_timeout is None:
        env_value = os.environ.get("HOROVOD_START_TIMEOUT")
        try:
            args.start_timeout = (int(env_value) if env_value
                                  else DEFAULT_START_TIMEOUT_S)
        except ValueError:
            parser.error(f"invalid HOROVOD_START_TIMEOUT: {env_value!r}")
    if args.start_timeout <= 0:
        parser.error(f"start timeout must be > 0, got {args.start_timeout}")

    try:
        args.host_list = _host_list(args)
        args.slots = hosts.assign_ranks(args.host_list, args.num_proc)
        used = list(dict.fromkeys(s.hostname for s in args.slots))
        args.remote_hosts = [h for h in used if not hosts.is_local_host(h)]
        args.store_addr = network.store_address(args.nic_list, args.remote_hosts)
    except ValueError as exc:
        parser.error(str(exc))
    return args


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
    if args.nics is not None:
        try:
            args.nic_list = network.parse_nics(args.nics)
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
    """Validates the elastic-mode flags."""
    if not args.command:
        parser.error("no command given to run in the workers")
    if not os.access(args.discovery, os.X_OK):
        parser.error(f"--host-discovery-script {args.discovery!r} is not an executable file")
    args.min_np = args.min_np or args.num_proc or 1
    args.max_np = args.max_np or max(args.num_proc or 0, args.min_np)
    args.num_proc = args.num_proc or args.min_np
    if not 1 <= args.min_np <= args.num_proc <= args.max_np:
        parser.error(f"need 1 <= --min-np ({args.min_np}) <= -np ({args.num_proc}) <= "
                     f"--max-np ({args.max_np})")
    if args.cooldown and not 0 <= args.cooldown[0] <= args.cooldown[1]:
        parser.error("--blacklist-cooldown-range needs 0 <= LO <= HI")
    if args.start_timeout is None:
        args.start_timeout = int(os.environ.get("HOROVOD_START_TIMEOUT") or
                                 DEFAULT_START_TIMEOUT_S)
    return args


def _start_job(args: argparse.Namespace, local_command: bool = True,
               remote_exec: Optional[remote.RemoteExec] = None):
    """Checks the commands and starts the store: (secret, server), or an exit code."""
    if local_command and not _command_exists(args.command[0]):
        driver.log(f"command not found: {args.command[0]}")
        return 127
    if remote_exec is not None and not _command_exists(remote_exec.prefix[0]):
        driver.log(f"command not found: {remote_exec.prefix[0]} (it starts the workers "
                   "on remote hosts; install openssh-client or pass --ssh-command)")
        return 127
    secret = secrets.token_hex(16)
    try:
        return secret, _start_store(secret, args.store_addr)
    except Exception as exc:  # pylint: disable=broad-except
        driver.log(f"failed to start the rendezvous store on {args.store_addr}: {exc}")
        return 1


def _elastic_store_address(args: argparse.Namespace) -> Optional[str]:
    """Store address of an elastic job: --nics, else the route to the first remote
    host the discovery script lists now, else loopback (remote hosts found later
    are then refused: they could not reach the store)."""
    from horovod_torch.runner.elastic_driver import discover_hosts
    try:
        if args.nic_list:
            return network.store_address(args.nic_list, [])
        try:
            found = discover_hosts(args.discovery, args.slots)
        except (OSError, ValueError) as exc:
            driver.log(f"host discovery failed: {exc}")
            found = {}
        remote_hosts = [h for h in found if not hosts.is_local_host(h)]
        return network.store_address(None, remote_hosts)
    except ValueError as exc:
        driver.log(str(exc))
        return None


def run_elastic(args: argparse.Namespace) -> int:
    """Run an elastic job under the ElasticDriver."""
    from horovod_torch.runner.elastic_driver import ElasticDriver, ElasticOptions
    args.store_addr = _elastic_store_address(args)
    if args.store_addr is None:
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

    def env_for(worker_id: str, host: str, index: int) -> Dict[str, str]:
        slot = hosts.SlotInfo(host, 0, 0, 0, 1, 1, 1)
        env = _worker_env(slot, args, port, secret)
        for k in ("HOROVOD_RANK", "HOROVOD_SIZE", "HOROVOD_LOCAL_RANK", "HOROVOD_LOCAL_SIZE",
                  "HOROVOD_CROSS_RANK", "HOROVOD_CROSS_SIZE"):
            env.pop(k, None)
        # A joining worker waits at rendezvous until the survivors reach their next
        # commit: give it the elastic timeout, not the start timeout.
        env["HOROVOD_START_TIMEOUT"] = str(max(float(args.start_timeout), args.elastic_timeout))
        env.update({"HOROVOD_ELASTIC": "1", "HOROVOD_ELASTIC_WORKER_ID": worker_id,
                    "HOROVOD_ELASTIC_TIMEOUT": str(args.elastic_timeout),
                    "HOROVOD_ELASTIC_RESET_LIMIT": str(args.reset_limit)})
        return env

    opts = ElasticOptions(num_proc=args.num_proc, min_np=args.min_np, max_np=args.max_np,
                          discovery_script=args.discovery, slots=args.slots,
                          reset_limit=args.reset_limit,
                          cooldown=tuple(args.cooldown) if args.cooldown else None,
                          elastic_timeout=args.elastic_timeout, verbose=args.verbose,
                          start_timeout=float(args.start_timeout))
    if args.verbose:
        driver.log(f"rendezvous store at {args.store_addr}:{port}")
    try:
        return ElasticDriver(opts, server, args.command, env_for,
                             driver.OutputForwarder(sys.stdout.buffer,
                                                    prefix=not args.disable_prefix),
                             spawner=driver.HostSpawner(remote_exec)).run()
    finally:
        server.stop()


def check_build() -> int:
    """Print the features compiled into horovod_torch (``--check-build``)."""
    import horovod_torch  # pylint: disable=import-outside-toplevel

    def box(flag: bool) -> str:
        return "[X]" if flag else "[ ]"

    version = getattr(horovod_torch, "__version__", "unknown")
    print(f"horovod_torch v{version}:\n\n"
          "Available Frameworks:\n"
          "    [X] PyTorch\n\n"
          "Available Controllers:\n"
          "    [X] TCP (Gloo-compatible)\n"
          f"    {box(horovod_torch.mpi_built())} MPI\n\n"
          "Available Tensor Operations:\n"
          f"    {box(horovod_torch.nccl_built())} NCCL\n"
          "    [X] TCP")
    return 0


def _start_store(secret: str, addr: str) -> Any:
    """Start the in-process rendezvous store on ``addr``; ``.port()`` gives its port.

    Imported here, not at module level: loading ``_C`` loads torch.
    """
    from horovod_torch import _C  # pylint: disable=import-outside-toplevel

    return _C.StoreServer(addr, 0, secret)


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
    return env


def _knob_env(args: argparse.Namespace) -> Dict[str, str]:
    """The HOROVOD_* variables set by engine-knob flags (and --log-level)."""
    env = {}
    for flag, var, kind, metavar, scale in config.KNOB_FLAGS:
        if flag in ("--start-timeout", "--log-level"):
            continue
        value = getattr(args, "knob_" + flag[2:].replace("-", "_"), None)
        if kind is None:
            if value:
                env[var] = "1"
        elif value is not None:
            env[var] = str(value * scale) if scale != 1 else str(value)
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
    env = dict(os.environ, HOROVOD_CONTROLLER="mpi",
               HOROVOD_START_TIMEOUT=str(args.start_timeout), **_knob_env(args))
    exported = ["HOROVOD_CONTROLLER", "HOROVOD_START_TIMEOUT", *_knob_env(args),
                *[k for k in ("PYTHONPATH", "PATH", "LD_LIBRARY_PATH") if k in os.environ]]
    cmd = ["mpirun", "-np", str(args.num_proc), "-H", hosts_arg, "--bind-to", "none",
           "--oversubscribe"]
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        cmd.append("--allow-run-as-root")
    if not args.disable_prefix:
        cmd.append("--tag-output")
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
    """Run a fixed-size job: store, workers, supervision; return exit code."""
    remote_exec = _remote_exec(args) if args.remote_hosts else None
    any_local = len(args.remote_hosts) < len({s.hostname for s in args.slots})
    started = _start_job(args, local_command=any_local, remote_exec=remote_exec)
    if isinstance(started, int):
        return started
    secret, server = started
    try:
        port = int(server.port())
        if args.verbose:
            _print_assignment(args.slots, args.store_addr, port, remote_exec)
        supervisor = driver.Supervisor(
            jobs=args.slots,
            env_for=lambda slot: _worker_env(slot, args, port, secret),
            command=args.command,
            spawner=driver.HostSpawner(remote_exec),
            forwarder=driver.OutputForwarder(
                sys.stdout.buffer, prefix=not args.disable_prefix),
            start_timeout_s=float(args.start_timeout))
        return supervisor.run()
    finally:
        server.stop()


def run(args: argparse.Namespace) -> int:
    """Dispatch on the parsed arguments; the extension point for new modes.

    Elastic mode (``--min-np/--max-np/--host-discovery-script``) will be
    selected here and get its own ``run_elastic(args)``.
    """
    if args.check_build:
        return check_build()
    if args.discovery:
        return run_elastic(args)
    if args.use_mpi:
        return run_mpi(args)
    return run_static(args)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Console-script entry point; returns the process exit code."""
    args = parse_args(argv)
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
