"""Elasticity, shown by itself: runs the OCI elastic MNIST script (train.py, unmodified)
on 2 local workers under horovodrun, kills one of them mid-training, and summarises
what the job did about it.

    python examples/elastic/demo.py                 # kill a worker, watch it come back
    python examples/elastic/demo.py --no-fault      # just train
    python examples/elastic/demo.py --epochs 5 -- --log-interval 5   # after --: train.py's

What happens (default, fault mode):
  1. MNIST-format data is written to --data-dir if it is not there
     (python -m horovod_torch.data mnist DIR), and the job starts, as `make demo` does:
         OCI__SYNC_DIR=SYNC horovodrun --verbose -np 2 --min-np 1 --max-np 2 \\
             --blacklist-cooldown-range 5 10 \\
             --host-discovery-script examples/elastic/discover_hosts.sh \\
             python examples/elastic/train.py --data-dir DIR --epochs 30
     (horovodrun is started as `python -m horovod_torch.runner`, the same program,
     with this checkout on PYTHONPATH when its extension is built in place (`make build`),
     so the demo also runs before `pip install`; else the installed package runs).
     Its output goes to our stdout and stderr as it is.
  2. Once training is under way (rank 0 has logged --kill-after progress lines, i.e.
     batch 20 of epoch 1 by default: train.py commits after every batch and logs
     every 10th), the demo SIGKILLs the worker of the highest rank (rank 1), found
     among horovodrun's children by the HOROVOD_RANK in /proc/PID/environ, and says
     so in one line: "demo: killing worker rank 1 (pid N) at ...".
  3. horovodrun blacklists the host (localhost) for 5-10 s and re-forms the job
     without the dead worker (generation 1: 1 worker); the survivor says which
     commit it restores, restores it and trains on. After the cooldown the
     discovery script's localhost:2 has a free slot again: a new worker starts and
     joins (generation 2: 2 workers), the survivor's state is broadcast to it, and
     the two finish the epochs; rank 0 prints the test accuracy.
  4. A summary: the generations and their sizes, the time from the kill to the next
     completed step, the commit the survivor restored, the time to the rejoin, the
     final test accuracy and the wall time. Whatever was not seen is said so.

The facts come from the job's own lines (train.py's "Train Epoch" and "Test set",
horovodrun's "generation N: K workers", and the survivor's "horovod_torch: rank 0
lost a peer (...); restoring commit 23 (epoch=1, batch=22) and re-forming the job")
and the demo's timestamps.

Exit status: the job's, or 1 if the job succeeded but the demo's promise (kill,
survive, rejoin, finish; in --no-fault mode: finish with an accuracy) was not kept.
"""
from __future__ import annotations

import argparse
import contextlib
import glob
import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Dict, IO, List, Optional, Tuple

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
TRAIN = os.path.join(HERE, "train.py")
DISCOVER = os.path.join(HERE, "discover_hosts.sh")

# The job's lines the demo watches for. Workers' lines carry horovodrun's
# "[rank]<stdout>:" prefix; horovodrun's own lines start with "horovodrun: ".
PROGRESS = re.compile(r"^(?:\[(\d+)\]<stdout>:)?Train Epoch: (\d+) \[(\d+)/(\d+) ")
GENERATION = re.compile(r"^horovodrun: generation (\d+): (\d+) workers? on ")
# A survivor's "horovod_torch: rank 0 lost a peer (<error>); restoring commit 23
# (epoch=1, batch=22) and re-forming the job" ("restoring the state it started with
# (no commit yet) and ..." before its first commit).
RESTORING = re.compile(r"horovod_torch: rank \S+ lost a peer .*; restoring (.+) and "
                       r"re-forming the job")
ACCURACY = re.compile(r"Test set: Average loss: [\d.]+, Accuracy: ([\d.]+)%")


_OUT_LOCK = threading.Lock()


def say(line: str) -> None:
    """One line of the demo's own, marked "demo:", between the job's lines."""
    with _OUT_LOCK:
        sys.stdout.write(f"demo: {line}\n")
        sys.stdout.flush()


def plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


# -- the job's processes ------------------------------------------------------------

def workers_of(launcher_pid: int) -> Dict[int, int]:
    """{rank: pid} of horovodrun's live workers: its children (from /proc) whose
    environment holds HOROVOD_RANK and an elastic worker id (not its reaper or
    discovery runs)."""
    found = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as f:
                # "pid (comm) state ppid ...": comm may hold spaces and parentheses.
                if int(f.read().rsplit(")", 1)[1].split()[1]) != launcher_pid:
                    continue
            with open(f"/proc/{entry}/environ", "rb") as f:
                env = dict(v.partition(b"=")[::2] for v in f.read().split(b"\0") if v)
        except (OSError, IndexError, ValueError):
            continue  # gone meanwhile, or not ours to read
        if b"HOROVOD_ELASTIC_WORKER_ID" in env and env.get(b"HOROVOD_RANK", b"").isdigit():
            found[int(env[b"HOROVOD_RANK"])] = int(entry)
    return found


# -- watching the job -----------------------------------------------------------------

@dataclass
class Kill:
    rank: int
    pid: int
    at: float
    last_logged: str  # rank 0's last progress ("epoch 1 [1280/6000]")


@dataclass
class Watch:
    """What the demo saw, with times in seconds since the job started. line() gets
    each line of the job's stdout and stderr (from a thread each) and does the kill."""
    fault: bool
    kill_after: int
    launcher_pid: int
    start: float = field(default_factory=time.monotonic)
    # (t, generation, workers) per "generation N" line; (t, rank, epoch, "epoch E [x/N]")
    # per progress line
    generations: List[Tuple[float, int, int]] = field(default_factory=list)
    progress: List[Tuple[float, int, int, str]] = field(default_factory=list)
    rank0_lines: int = 0
    kill: Optional[Kill] = None
    kill_error: Optional[str] = None
    restored: Optional[str] = None  # the survivor's "commit 23 (epoch=1, batch=22)"
    accuracy: Optional[float] = None
    lock: threading.Lock = field(default_factory=threading.Lock)

    def now(self) -> float:
        return time.monotonic() - self.start

    def line(self, text: str) -> None:
        with self.lock:
            t = self.now()
            m = GENERATION.match(text)
            if m:
                self.generations.append((t, int(m.group(1)), int(m.group(2))))
            m = PROGRESS.match(text)
            if m:
                rank = int(m.group(1) or 0)
                shown = f"epoch {m.group(2)} [{m.group(3)}/{m.group(4)}]"
                self.progress.append((t, rank, int(m.group(2)), shown))
                if rank == 0 and len(self.generations) <= 1:  # still the first generation
                    self.rank0_lines += 1
                    if self.fault and self.rank0_lines == max(self.kill_after, 1):
                        self._kill_one(shown)
            m = RESTORING.search(text)
            if m and self.kill is not None and self.restored is None:
                self.restored = m.group(1)
            m = ACCURACY.search(text)
            if m:
                self.accuracy = float(m.group(1))

    def _kill_one(self, shown: str) -> None:
        """SIGKILLs the worker of the highest rank (not rank 0, which prints the test
        accuracy at the end), and says so."""
        workers = workers_of(self.launcher_pid)
        victims = sorted(r for r in workers if r != 0)
        if not victims:
            self.kill_error = (f"found no worker other than rank 0 among horovodrun's "
                               f"children (ranks seen: {sorted(workers) or 'none'})")
            say(f"cannot kill a worker: {self.kill_error}")
            return
        rank = victims[-1]
        self.kill = Kill(rank, workers[rank], self.now(), shown)
        say(f"killing worker rank {rank} (pid {self.kill.pid}) at {self.kill.at:.1f} s "
            f"(SIGKILL), after rank 0 logged {shown}; the job should go on with "
            f"{plural(len(workers) - 1, 'worker')}, then grow back to {len(workers)} after "
            "the blacklist cooldown")
        try:
            os.kill(self.kill.pid, signal.SIGKILL)
        except ProcessLookupError:
            self.kill_error = f"worker rank {rank} (pid {self.kill.pid}) had already exited"
            self.kill = None
            say(f"cannot kill a worker: {self.kill_error}")


def pump(stream: IO[bytes], out: IO[bytes], watch: Watch) -> None:
    """Copies the job's stream to ours line by line, as it is, and shows each line
    to the watch."""
    for raw in iter(stream.readline, b""):
        with _OUT_LOCK:
            out.write(raw)
            out.flush()
        watch.line(raw.decode(errors="replace").rstrip("\n"))


# -- the summary ----------------------------------------------------------------------

def summarise(w: Watch, rc: int, wall: float) -> Tuple[List[str], List[str]]:
    """The summary lines, and the demo's promises that were not kept (none: all kept)."""
    lines: List[str] = []
    broken: List[str] = []
    gens = ", ".join(f"gen {g}: {plural(n, 'worker')}" for _, g, n in w.generations)
    lines.append(f"generations:     {gens or 'none seen'}")
    if w.fault:
        _fault_summary(w, lines, broken)
    if not w.progress:
        broken.append("no training step was logged")
    if w.accuracy is not None:
        lines.append(f"test accuracy:   {w.accuracy:.2f}%")
    else:
        lines.append("test accuracy:   not printed (the job did not finish its test)")
        broken.append("no test accuracy")
    lines.append(f"wall time:       {wall:.1f} s (job exit code {rc})")
    if rc != 0:
        broken.append(f"the job exited with code {rc}")
    return lines, broken


def _fault_summary(w: Watch, lines: List[str], broken: List[str]) -> None:
    k = w.kill
    if k is None:
        why = w.kill_error or (f"rank 0 logged {w.rank0_lines} of the {w.kill_after} progress "
                               "lines to wait for")
        lines.append(f"killed:          nothing ({why})")
        broken.append("no worker was killed")
        return
    lines.append(f"killed:          rank {k.rank} (pid {k.pid}) at {k.at:.1f} s, "
                 f"after rank 0 logged {k.last_logged}")
    # The first generation after the kill, and the first with more workers after that.
    after = [(t, g, n) for t, g, n in w.generations if t >= k.at]
    shrunk = after[0] if after else None
    if shrunk is None:
        lines.append("survived:        no new generation formed after the kill")
        broken.append("the job did not re-form after the kill")
        return
    first = next(((t, r, e) for t, r, e, _ in w.progress if t > shrunk[0]), None)
    if first is not None:
        lines.append(f"survived:        gen {shrunk[1]} ({plural(shrunk[2], 'worker')}) formed "
                     f"{shrunk[0] - k.at:.1f} s after the kill; next completed step "
                     f"{first[0] - k.at:.1f} s after the kill (epoch {first[2]}, rank {first[1]})")
    else:
        lines.append(f"survived:        gen {shrunk[1]} formed, but no step completed after it")
        broken.append("no step completed after the kill")
    restored = w.restored or "not observed (no survivor said it lost a peer)"
    if restored.startswith("commit "):
        restored += ", the survivor's last commit before the kill"
    lines.append("restored from:   " + restored)
    grown = next(((t, g, n) for t, g, n in after[1:] if n > shrunk[2]), None)
    if grown is None:
        lines.append("rejoined:        no: no later generation had more workers")
        broken.append("no worker rejoined")
        return
    # The first step of the grown job: the first line of a new worker (survivors keep
    # ranks 0..shrunk-1, new workers come after them); the survivors may still log a
    # step or two of the smaller job before they notice the new generation.
    more = [(t, r) for t, r, _, _ in w.progress if t > grown[0]]
    first_new = next((i for i, (_, r) in enumerate(more) if r >= shrunk[2]), None)
    if first_new is not None:
        lines.append(f"rejoined:        gen {grown[1]} ({plural(grown[2], 'worker')}) formed "
                     f"{grown[0] - k.at:.1f} s after the kill; first step with the new worker "
                     f"{more[first_new][0] - k.at:.1f} s after the kill, "
                     f"{plural(len(more) - first_new, 'progress line')} from then on")
    else:
        lines.append(f"rejoined:        gen {grown[1]} formed, but the new worker logged no step")
        broken.append("no step completed after the rejoin")


# -- main -----------------------------------------------------------------------------

def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        usage="%(prog)s [options] [-- train.py's options]",
        description="Run examples/elastic/train.py under horovodrun, kill a worker "
                    "mid-training, and summarise how the job recovered.",
        epilog="Arguments after -- go to train.py (e.g. -- --log-interval 5 --batch-size 32).")
    p.add_argument("--no-fault", action="store_true", help="just train: kill nothing")
    p.add_argument("--epochs", type=int, default=30,
                   help="train.py --epochs (default 30: the survivor trains on alone "
                        "while the new worker starts, so training must outlast the "
                        "cooldown and that start)")
    p.add_argument("--data-dir", default="data",
                   help="MNIST data; written there if missing (default: data)")
    p.add_argument("--sync-dir", default="/tmp/horovod_torch_demo",
                   help="OCI__SYNC_DIR: train.py's checkpoints and logs go under it "
                        "(default /tmp/horovod_torch_demo)")
    p.add_argument("-np", "--np", dest="np", type=int, default=2,
                   help="workers (= --max-np; default 2); other than 2, the discovery "
                        "script reads localhost:NP from SYNC_DIR/demo_hosts")
    p.add_argument("--python", default=sys.executable,
                   help="Python of the workers and horovodrun (default: this one)")
    p.add_argument("--kill-after", type=int, default=3, metavar="N",
                   help="kill once rank 0 has logged N progress lines (default 3: train.py "
                        "logs every 10th batch, so after batch 20)")
    p.add_argument("--cooldown", type=float, nargs=2, default=(5.0, 10.0), metavar=("LO", "HI"),
                   help="horovodrun --blacklist-cooldown-range (default 5 10)")
    p.add_argument("--timeout", type=float, default=600.0,
                   help="stop the job after this many seconds (default 600; 0: never)")
    p.add_argument("train_args", nargs="*", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if not args.no_fault and args.np < 2:
        p.error("killing a worker needs -np 2 or more (or pass --no-fault)")
    return args


def ensure_data(python: str, data_dir: str, env: Dict[str, str], cwd: str) -> int:
    """Writes MNIST-format data to data_dir unless some is there already."""
    if os.path.exists(os.path.join(data_dir, "MNIST", "raw", "train-images-idx3-ubyte")):
        return 0
    say(f"writing MNIST-format data to {data_dir}")
    return subprocess.call([python, "-m", "horovod_torch.data", "mnist", data_dir],
                           cwd=cwd, env=env)


def job_command(args: argparse.Namespace) -> List[str]:
    lo, hi = args.cooldown
    return [args.python, "-m", "horovod_torch.runner", "--verbose",
            "-np", str(args.np), "--min-np", "1", "--max-np", str(args.np),
            "--blacklist-cooldown-range", f"{lo:g}", f"{hi:g}",
            "--host-discovery-script", DISCOVER,
            args.python, TRAIN, "--data-dir", args.data_dir,
            "--epochs", str(args.epochs), *args.train_args]


def stop(proc: "subprocess.Popen[bytes]") -> None:
    """SIGTERM to horovodrun (it stops its workers), SIGKILL if it lingers."""
    with contextlib.suppress(ProcessLookupError):
        proc.terminate()
    try:
        proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def python_path(env: Dict[str, str], repo: str = REPO) -> str:
    """PYTHONPATH for the job: this checkout first when its extension is built in place,
    so that `horovod.torch` and horovodrun work without an install; else unchanged, so
    that an unbuilt checkout never hides an installed horovod_torch."""
    rest = [p for p in [env.get("PYTHONPATH")] if p]
    built = glob.glob(os.path.join(repo, "horovod_torch", "_C*.so"))
    return os.pathsep.join(([repo] if built else []) + rest)


def main(argv: Optional[List[str]] = None) -> int:
    started = time.monotonic()
    args = parse_args(argv)
    args.data_dir, args.sync_dir = os.path.abspath(args.data_dir), os.path.abspath(args.sync_dir)
    if os.sep in args.python:  # the job runs in the sync folder: a relative path would break
        args.python = os.path.abspath(args.python)
    env = dict(os.environ)
    env["PYTHONPATH"] = python_path(env)
    if not env["PYTHONPATH"]:
        del env["PYTHONPATH"]
    env["OCI__SYNC_DIR"] = args.sync_dir
    env["PYTHONUNBUFFERED"] = "1"
    # The job runs in the sync folder: `python -m` puts the working directory first on
    # the path, and an unbuilt checkout there would hide an installed horovod_torch.
    os.makedirs(args.sync_dir, exist_ok=True)
    rc = ensure_data(args.python, args.data_dir, env, cwd=args.sync_dir)
    if rc != 0:
        say(f"could not write the data (exit code {rc})")
        return rc
    if args.np != 2 and not env.get("HOROVOD_DISCOVERY_HOSTS"):
        # discover_hosts.sh offers localhost:2 unless pointed at a host:slots file.
        env["HOROVOD_DISCOVERY_HOSTS"] = os.path.join(args.sync_dir, "demo_hosts")
        with open(env["HOROVOD_DISCOVERY_HOSTS"], "w") as f:
            f.write(f"localhost:{args.np}\n")

    cmd = job_command(args)
    say("running: OCI__SYNC_DIR=" + args.sync_dir + " " + " ".join(
        os.path.relpath(c, os.getcwd()) if c.startswith(REPO) else c for c in cmd))
    proc = subprocess.Popen(cmd, cwd=args.sync_dir, env=env, stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    watch = Watch(fault=not args.no_fault, kill_after=args.kill_after, launcher_pid=proc.pid)
    readers = [threading.Thread(target=pump, args=(s, o, watch), daemon=True)
               for s, o in ((proc.stdout, sys.stdout.buffer), (proc.stderr, sys.stderr.buffer))]
    for r in readers:
        r.start()
    try:
        rc = proc.wait(timeout=args.timeout or None)
    except subprocess.TimeoutExpired:
        say(f"the job ran past --timeout {args.timeout:g} s; stopping it")
        stop(proc)
        rc = 124
    except KeyboardInterrupt:  # horovodrun got the terminal's SIGINT as well
        stop(proc)
        rc = 130
    for r in readers:
        r.join(timeout=5.0)

    with watch.lock:
        lines, broken = summarise(watch, rc, time.monotonic() - started)
    say("-" * 70)
    say("summary (" + ("fault mode" if watch.fault else "--no-fault") + ")")
    for line in lines:
        say("  " + line)
    if broken:
        for why in broken:
            say("NOT KEPT: " + why)
    elif watch.fault:
        say("kept: a worker was killed, the job went on without it, a new worker joined, "
            "and training finished")
    else:
        say("kept: training finished")
    return rc if rc != 0 else (1 if broken else 0)


if __name__ == "__main__":
    sys.exit(main())
