"""Shared by the benchmarks: each launches itself under horovodrun, one process per
rank, with a free port for the peer library's own rendezvous (BENCH_PORT)."""
import os
import re
import socket
import subprocess
import sys
from typing import Dict, Optional, Sequence

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def size_str(n: int) -> str:
    if n >= 1 << 30:
        return f"{n >> 30} GB"
    return f"{n >> 20} MB" if n >= 1 << 20 else f"{n >> 10} KB"


def launch_self(script: str, np: int, worker_args: Sequence[str],
                env: Optional[Dict[str, str]] = None) -> int:
    """Runs `python script --worker worker_args...` on np ranks; returns the exit code."""
    full_env = dict(os.environ, BENCH_PORT=str(free_port()), NCCL_NVLS_ENABLE="0",
                    PYTHONPATH=os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")]),
                    **(env or {}))
    cmd = [sys.executable, "-m", "horovod_torch.runner", "-np", str(np), "--disable-prefix",
           sys.executable, os.path.abspath(script), "--worker", *worker_args]
    return subprocess.call(cmd, env=full_env)


def run_synthetic(np: int, bench_args: Sequence[str], env: Dict[str, str]) -> float:
    """Runs examples/pytorch_synthetic_benchmark.py on np ranks; returns total img/s."""
    full = dict(os.environ, NCCL_NVLS_ENABLE="0",
                PYTHONPATH=os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")]), **env)
    cmd = [sys.executable, "-m", "horovod_torch.runner", "-np", str(np), "--disable-prefix",
           sys.executable, os.path.join(REPO, "examples", "pytorch_synthetic_benchmark.py"),
           *bench_args]
    out = subprocess.run(cmd, env=full, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         text=True, timeout=1800).stdout
    m = re.search(r"Total img/sec on \d+ \w+\(s\): ([\d.]+)", out)
    if not m:
        sys.stdout.write(out[-3000:])
        raise SystemExit(f"no throughput in the output of {' '.join(cmd)}")
    return float(m.group(1))
