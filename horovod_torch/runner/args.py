"""parse_args: horovodrun's command line read (options.py), checked and completed into
the Namespace that launch.py's run_* use: errors are one line and exit status 2 (a
ValueError for horovod_torch.runner.run), options that mean nothing here say so once.
"""
from __future__ import annotations

import argparse
import os
import shlex
import sys
from typing import List, Optional, Sequence

from horovod_torch.common import config
from horovod_torch.runner import hosts, network, output
from horovod_torch.runner.options import (OWN_KNOB_OPTIONS, apply_config_file, knob_dest,
                                          make_parser)

def notice(option: str, why: str) -> None:
    """One line on stderr for an accepted option that does nothing here."""
    output.log(f"{option} has no effect in horovod_torch: {why}")


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
        apply_config_file(parser, args)
    _check_knobs(parser, args)
    if args.check_build:
        return args
    if sum(map(bool, (args.use_gloo, args.use_mpi, args.use_jsrun))) > 1:
        parser.error("use at most one of --gloo, --mpi and --jsrun")
    if args.disable_cache:
        notice("--disable-cache", "horovodrun keeps no cache of host checks")
    if args.use_jsrun:
        notice("--jsrun", "IBM's jsrun is not supported; horovodrun starts the workers "
                           "itself over the TCP transport")
    streams = getattr(args, knob_dest("HOROVOD_NUM_NCCL_STREAMS"), None)
    if streams is not None and streams != 1:
        notice("--num-nccl-streams", "the NCCL backend runs one stream per GPU (its ops "
                                      "are ordered on it); the value is passed on and unused")
    if args.binding_args and not args.use_mpi:
        notice("--binding-args", "it applies to mpirun (--mpi) only; horovodrun binds "
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
        notice("--max-np", "it applies to elastic jobs only (--min-np or "
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


def _check_knobs(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Horovod's checks: numeric engine settings are >= 0, the noise in [0, 1]."""
    for knob in config.KNOB_FLAGS:
        if knob.kind not in (int, float) or knob.flags[0] in OWN_KNOB_OPTIONS:
            continue
        value = getattr(args, knob_dest(knob.env), None)
        if value is not None and value < 0:
            parser.error(f"{knob.flags[0]} must be >= 0, got {value}")
    noise = getattr(args, knob_dest("HOROVOD_AUTOTUNE_GAUSSIAN_PROCESS_NOISE"), None)
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


def is_elastic(args: argparse.Namespace) -> bool:
    """Elastic mode: a host discovery script or --min-np (Horovod's rule)."""
    return bool(getattr(args, "discovery", None)) or getattr(args, "fixed_hosts", None) \
        is not None
