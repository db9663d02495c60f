"""Command line entry point of ``horovodrun`` (static mode, local hosts).

Usage::

    horovodrun -np 4 [-H localhost:4] [--start-timeout 30] [--verbose]
               [--log-level INFO] [--disable-prefix] python train.py ...

Only the standard library is imported at module level; the C++ extension
(which loads torch) is imported lazily by :func:`_start_store`, so
``--help`` and argument errors return quickly.
"""
from __future__ import annotations

import argparse
import os
import secrets
import shutil
import sys
from typing import Any, Dict, List, NoReturn, Optional, Sequence

from horovod_torch.runner import driver, hosts

DEFAULT_START_TIMEOUT_S = 30
STORE_ADDR = "127.0.0.1"
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
        description="Launch a horovod_torch training job on this machine.")
    parser.add_argument(
        "-np", "--num-proc", dest="num_proc", type=int, metavar="N",
        help="total number of worker processes (required)")
    parser.add_argument(
        "-H", "--hosts", dest="hosts", metavar="HOST:SLOTS[,...]",
        help="hosts and their slot counts, e.g. localhost:4 "
             "(default: localhost:N); only local hosts are supported yet")
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

    if args.discovery:
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
        args.host_list = hosts.parse_hosts(
            args.hosts or f"localhost:{args.num_proc}")
        args.slots = hosts.assign_ranks(args.host_list, args.num_proc)
    except ValueError as exc:
        parser.error(str(exc))
    remote = [h.hostname for h in args.host_list if not hosts.is_local_host(
        h.hostname)]
    if remote:
        parser.error(f"remote hosts need ssh, not supported yet: "
                     f"{','.join(remote)}")
    return args


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


def _start_job(args: argparse.Namespace):
    """Checks the command and starts the store: (secret, server), or an exit code."""
    if not _command_exists(args.command[0]):
        driver.log(f"command not found: {args.command[0]}")
        return 127
    secret = secrets.token_hex(16)
    try:
        return secret, _start_store(secret)
    except Exception as exc:  # pylint: disable=broad-except
        driver.log(f"failed to start the rendezvous store: {exc}")
        return 1


def run_elastic(args: argparse.Namespace) -> int:
    """Run an elastic job under the ElasticDriver."""
    from horovod_torch.runner.elastic_driver import ElasticDriver, ElasticOptions
    started = _start_job(args)
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
                          elastic_timeout=args.elastic_timeout, verbose=args.verbose)
    try:
        return ElasticDriver(opts, server, args.command, env_for,
                             driver.OutputForwarder(sys.stdout.buffer,
                                                    prefix=not args.disable_prefix)).run()
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


def _start_store(secret: str) -> Any:
    """Start the in-process rendezvous store; ``.port()`` gives its port.

    Imported here, not at module level: loading ``_C`` loads torch.
    """
    from horovod_torch import _C  # pylint: disable=import-outside-toplevel

    return _C.StoreServer(STORE_ADDR, 0, secret)


def _command_exists(program: str) -> bool:
    """Return True if ``program`` is an executable path or on $PATH."""
    return shutil.which(program) is not None


def _worker_env(slot: hosts.SlotInfo, args: argparse.Namespace,
                port: int, secret: str) -> Dict[str, str]:
    """Build the environment of the worker placed at ``slot``."""
    env = dict(os.environ)
    env.update(slot.to_env())
    env.update({
        "HOROVOD_STORE_ADDR": STORE_ADDR,
        "HOROVOD_STORE_PORT": str(port),
        "HOROVOD_SECRET": secret,
        "HOROVOD_CONTROLLER": "tcp",
        "HOROVOD_START_TIMEOUT": str(args.start_timeout),
        "PYTHONUNBUFFERED": "1",
    })
    if args.log_level:
        env["HOROVOD_LOG_LEVEL"] = args.log_level
    return env


def _print_assignment(slots: List[hosts.SlotInfo], port: int) -> None:
    driver.log(f"rendezvous store at {STORE_ADDR}:{port}")
    driver.log(f"rank assignment ({len(slots)} processes):")
    for s in slots:
        driver.log(f"  rank {s.rank}: host={s.hostname} "
                   f"local_rank={s.local_rank} local_size={s.local_size} "
                   f"cross_rank={s.cross_rank} cross_size={s.cross_size}")


def run_static(args: argparse.Namespace) -> int:
    """Run a fixed-size job: store, workers, supervision; return exit code."""
    started = _start_job(args)
    if isinstance(started, int):
        return started
    secret, server = started
    try:
        port = int(server.port())
        if args.verbose:
            _print_assignment(args.slots, port)
        supervisor = driver.Supervisor(
            jobs=args.slots,
            env_for=lambda slot: _worker_env(slot, args, port, secret),
            command=args.command,
            spawner=driver.LocalSpawner(),
            forwarder=driver.OutputForwarder(
                sys.stdout.buffer, prefix=not args.disable_prefix))
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
    return run_static(args)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Console-script entry point; returns the process exit code."""
    args = parse_args(argv)
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
