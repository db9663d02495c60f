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
The options are defined in :mod:`horovod_torch.runner.options` and checked by
:func:`horovod_torch.runner.args.parse_args`; this module starts the job.

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
from typing import Any, Dict, List, Optional, Sequence

from horovod_torch.runner import driver, hosts, network, output, remote
from horovod_torch.runner.args import is_elastic, parse_args
from horovod_torch.runner.options import knob_env


def _remote_exec(args: argparse.Namespace) -> remote.RemoteExec:
    """How this job starts workers on remote hosts."""
    prefix = (shlex.split(args.ssh_command) if args.ssh_command else
              remote.ssh_prefix(args.ssh_port, args.ssh_identity_file))
    return remote.RemoteExec(prefix, grace_s=driver.GRACE_PERIOD_S)


def _check_commands(args: argparse.Namespace, local_command: bool = True,
                    remote_exec: Optional[remote.RemoteExec] = None) -> Optional[int]:
    """None if the worker command (and the remote-exec command) can be found, else
    the exit code after saying which one is missing."""
    if local_command and not _command_exists(args.command[0]):
        output.log(f"command not found: {args.command[0]}")
        return 127
    if remote_exec is not None and not _command_exists(remote_exec.prefix[0]):
        output.log(f"command not found: {remote_exec.prefix[0]} (it starts the workers "
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
        output.log(f"failed to start the rendezvous store on {args.store_addr}: {exc}")
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
        output.log(str(exc))
        return None


def store_address(args: argparse.Namespace) -> Optional[str]:
    """The address workers reach this machine at (the rendezvous store's), or None
    after saying why on stderr. Computed once; run_* use it."""
    if getattr(args, "store_addr", None) is None:
        args.store_addr = _elastic_store_address(args)
    return args.store_addr


def _output_forwarder(args: argparse.Namespace, ranks: int) -> output.OutputForwarder:
    """Worker output goes to our stdout/stderr, prefixed unless --disable-prefix, with
    the time with --prefix-output-with-timestamp, and into --output-filename DIR."""
    return output.OutputForwarder(
        _binary(sys.stdout), prefix=not args.disable_prefix,
        err_stream=_binary(sys.stderr), timestamp=args.prefix_timestamp,
        output_dir=args.output_filename, ranks=ranks)


def _binary(stream: Any) -> Any:
    """The byte stream under a text stream, or an adapter (Jupyter's have none)."""
    buffer = getattr(stream, "buffer", None)
    return buffer if buffer is not None else output.TextSink(stream)


def run_elastic(args: argparse.Namespace) -> int:
    """Run an elastic job under the ElasticDriver."""
    from horovod_torch.runner.elastic_driver import UNBOUNDED, ElasticDriver, ElasticOptions
    if store_address(args) is None:
        return 1
    remote_exec = None
    if args.store_addr != network.LOOPBACK:
        remote_exec = _remote_exec(args)
    elif args.ssh_command or args.ssh_port or args.ssh_identity_file:
        output.log("the discovery script lists only local hosts: the store listens on "
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
        output.log(f"rendezvous store at {args.store_addr}:{port}")
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
    env.update(knob_env(args))
    env.update(getattr(args, "extra_env", None) or {})
    return env


def run_mpi(args: argparse.Namespace) -> int:
    """horovodrun --mpi: hand the job to mpirun (same hosts and slots); the workers
    run over MPI. Output is tagged by mpirun unless --disable-prefix."""
    if not _command_exists("mpirun"):
        output.log("--mpi needs OpenMPI's mpirun on PATH (e.g. apt-get install openmpi-bin)")
        return 2
    import horovod_torch  # pylint: disable=import-outside-toplevel
    if not horovod_torch.mpi_built():
        output.log("--mpi needs a build of horovod_torch with MPI: install libopenmpi-dev "
                   "and rebuild, or run without --mpi (TCP transport)")
        return 2
    hosts_arg = ",".join(f"{h.hostname}:{h.slots}" for h in args.host_list)
    extra = {**knob_env(args), **(getattr(args, "extra_env", None) or {})}
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
        output.log("running: " + " ".join(shlex.quote(c) for c in cmd))
    return subprocess.call(cmd, env=env)


def _print_assignment(slots: List[hosts.SlotInfo], addr: str, port: int,
                      remote_exec: Optional[remote.RemoteExec]) -> None:
    output.log(f"rendezvous store at {addr}:{port}")
    output.log(f"rank assignment ({len(slots)} processes):")
    for s in slots:
        output.log(f"  rank {s.rank}: host={s.hostname} "
                   f"local_rank={s.local_rank} local_size={s.local_size} "
                   f"cross_rank={s.cross_rank} cross_size={s.cross_size}")
    if remote_exec is not None:
        output.log(f"remote workers start with: {' '.join(remote_exec.prefix)} HOST "
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
        output.log(f"failed to start the rendezvous store on {args.store_addr}: {exc}")
        return 1
    port = int(reservation.getsockname()[1])
    server: Any = None

    def start_store() -> Optional[int]:
        nonlocal server
        try:
            server = _start_store(secret, args.store_addr, port)
        except Exception as exc:  # pylint: disable=broad-except
            output.log(f"failed to start the rendezvous store on {args.store_addr}:{port}: "
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
